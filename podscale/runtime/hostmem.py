"""Host-memory release for buffers that are allocated and freed every step (ZeRO-3 on a CPU).

glibc's malloc serves a request above ``M_MMAP_THRESHOLD`` with its own ``mmap`` and unmaps it on free,
so the pages leave the process.  The threshold is *dynamic* by default: freeing an mmapped chunk raises it
to that chunk's size (up to 32 MiB on 64-bit), after which same-sized requests are carved from the heap,
whose free pages stay resident (mallopt(3), "M_MMAP_THRESHOLD").  ZeRO-3 gathers and releases a block-sized
buffer several times per step; on the 57M-parameter benchmark the heap grew to 946 MiB with 114 MiB of it
in use, and peak resident memory was 1.6x the model states plus the working set.  Fixing the threshold
turns the dynamic adjustment off; ZeRO-3 fixes it at glibc's cap (32 MiB) and the trim threshold at twice
that (the ratio glibc's dynamic rule keeps), then trims the heap once per step (:func:`trim_heap`).  On
bench/zero.py's stage 3 that held peak RSS to 0.83x FSDP2's at 0.77x its step time.  A threshold below the
block size makes every released block leave the process (lowest RSS) but faults each gather back in, at
one fault per 2 MiB with transparent huge pages (:func:`advise_huge_pages`; allocating and filling 28 MB:
0.55 ms from the heap, 11 ms mmapped with 4 KiB pages, 2.5 ms with huge pages) -- measured 1.4x slower
steps at 0.75x the RSS of the 32 MiB setting.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
# ZeRO-3's mmap threshold on a CPU unless zero.host_mmap_threshold_mb says otherwise: glibc's cap on 64-bit
DEFAULT_MMAP_THRESHOLD = 32 << 20

_applied: int | None = None


@functools.cache
def _libc():
    """The C library, or None; looked up once: ``find_library`` runs ``ldconfig -p`` in a subprocess (~6 ms),
    and ZeRO-3 trims the heap after every step."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.cache
def _function(name: str, argtypes: tuple, restype, glibc: bool = False):
    """The C library's ``name`` with its C signature set, or None where the library lacks it (``glibc``:
    or is not glibc)."""
    libc = _libc()
    if libc is None:
        return None
    try:
        if glibc:
            libc["gnu_get_libc_version"]
        fn = libc[name]
    except AttributeError:
        return None
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


def mallopt(param: int, value: int) -> bool:
    """glibc's mallopt(3); False, changing nothing, where the C library is not glibc."""
    fn = _function("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int, glibc=True)
    return fn is not None and fn(param, value) == 1


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve allocations of at least ``nbytes`` with mmap (returned to the OS on free); process-wide and
    idempotent.  Returns False, changing nothing, where the C library is not glibc or the environment
    sets ``MALLOC_MMAP_THRESHOLD_`` itself."""
    global _applied
    if _applied == nbytes:
        return True
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:  # the user's own setting (read by glibc at start) wins
        return False
    if not mallopt(M_MMAP_THRESHOLD, int(nbytes)):
        return False
    # Setting the mmap threshold also freezes the trim threshold at its 128 KiB default, so every free at
    # the top of the heap (activations, small gradients) would be returned and faulted in again next
    # micro-batch; glibc's dynamic rule keeps it at twice the mmap threshold, and so do we.
    mallopt(M_TRIM_THRESHOLD, 2 * int(nbytes))
    _applied = nbytes
    return True


MADV_HUGEPAGE = 14  # <sys/mman.h>
_HUGE = 2 << 20


def advise_huge_pages(t) -> None:
    """Ask for transparent huge pages over the 2 MiB-aligned interior of tensor ``t``'s (untouched)
    memory, so its first touch costs one fault per 2 MiB instead of one per 4 KiB (madvise(2),
    MADV_HUGEPAGE; a no-op where THP is disabled or the C library lacks madvise)."""
    madvise = _function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int)
    if madvise is None:
        return
    ptr = t.data_ptr()
    lo, hi = (ptr + _HUGE - 1) & ~(_HUGE - 1), (ptr + t.numel() * t.element_size()) & ~(_HUGE - 1)
    if hi > lo:
        madvise(lo, hi - lo, MADV_HUGEPAGE)


def trim_heap() -> None:
    """Give the heap's free pages back to the OS (malloc_trim(3): the top of each arena, and free
    chunks inside it via MADV_DONTNEED); a no-op where the C library is not glibc."""
    trim = _function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)
    if trim is not None:
        trim(0)
