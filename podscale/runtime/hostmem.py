"""Host-memory release for buffers that are allocated and freed every step (ZeRO-3 on a CPU).

glibc's malloc serves a request above ``M_MMAP_THRESHOLD`` with its own ``mmap`` and unmaps it on free,
so the pages leave the process.  The threshold is *dynamic* by default: freeing an mmapped chunk raises it
to that chunk's size (up to 32 MiB on 64-bit), after which same-sized requests are carved from the heap,
whose free pages stay resident (mallopt(3), "M_MMAP_THRESHOLD").  ZeRO-3 gathers and releases a block-sized
buffer several times per step; on the 57M-parameter benchmark the heap grew to 946 MiB with 114 MiB of it
in use, and peak resident memory was 1.6x the model states plus the working set.  Fixing the threshold
(which also turns the dynamic adjustment off) returns every released block buffer to the OS: resident
memory then follows the model states and the working set that :mod:`podscale.parallel.zero.memory`
describes, at the cost of first-touch page faults on each gather.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # <malloc.h>

_applied: int | None = None


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve allocations of at least ``nbytes`` with mmap (returned to the OS on free); process-wide and
    idempotent.  Returns False, changing nothing, where the C library is not glibc or the environment
    sets ``MALLOC_MMAP_THRESHOLD_`` itself."""
    global _applied
    if _applied == nbytes:
        return True
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:  # the user's own setting (read by glibc at start) wins
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, int(nbytes)) != 1:
        return False
    _applied = nbytes
    return True
