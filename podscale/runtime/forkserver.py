"""Starting local workers from a fork server that has already imported torch and podscale.

A spawned worker is a new interpreter: it imports torch (2-3 s of one core here) and podscale before it can
rendezvous, so a 2-rank job on a 2-core machine spends seconds on imports alone, every launch and every
elastic restart.  Python's ``forkserver`` start method forks each worker from a small server process
started once per parent; the server imports the modules named by :data:`PRELOAD` at its start, so a worker
begins with them loaded (shared copy-on-write).  The server itself never initialises CUDA, opens a process
group or starts a thread, so a fork of it is as clean as a spawned interpreter.

A forked worker's resident memory is not a fresh interpreter's: the library pages the server touched
are faulted into the worker as it runs, so its RSS grows during the run by what an import would have added
at the start.  Code that measures a worker's memory growth (tests of memory budgets, the benchmarks'
peak-RSS columns) launches with ``start_method="spawn"``.

What a fork does not bring along is the parent's *current* environment: torch's elastic agent hands each
worker only the variables it sets itself (``RANK``, ``MASTER_PORT``, ...), and a forked child otherwise
inherits the server's environment as it was when the server started.  :func:`run_with_parent_env` restores
the parent's environment as it is at launch, keeps what the agent set on top, and applies the C library
settings that are read from the environment only when a process starts (glibc's ``MALLOC_*_`` knobs).
"""
from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.reduction
import os
from collections.abc import Callable
from typing import Any

from podscale.runtime.exit import run_exit_functions
from podscale.runtime.hostmem import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, mallopt

#: What the fork server imports once, so that no worker pays for it.
PRELOAD = ["torch", "torch.distributed", "podscale.runtime.forkserver", "podscale.train.loop", "podscale.parallel.compose",
           "podscale.parallel.zero", "podscale.parallel.pipeline.schedule", "podscale.tasks.gpt"]

#: glibc's allocator variables (read at process start) and the mallopt(3) parameters they set
_MALLOC_VARS = {"MALLOC_MMAP_THRESHOLD_": M_MMAP_THRESHOLD, "MALLOC_TRIM_THRESHOLD_": M_TRIM_THRESHOLD}

# This module is imported in a worker when the pickled entry point is read, before torch's ``_wrap`` sets
# the agent's variables: in a fork of the server that is still the server's environment.
_INHERITED = dict(os.environ)


class InheritedFd:
    """A file descriptor of the launching process that a worker started by the fork server receives: when
    pickled for a new worker (during the request to the server) it is duplicated for that worker, which
    unpickles it as its own descriptor number."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _received, (multiprocessing.reduction.DupFd(self.fd),)


def _received(dup) -> int:
    return dup.detach()


def parent_streams() -> tuple[InheritedFd, InheritedFd]:
    """This process's standard output and error for the workers of one launch: a fork otherwise writes
    where the server's streams went when it started, not where the launching process's go now (a
    redirected descriptor, a test's capture)."""
    return InheritedFd(1), InheritedFd(2)


def run_with_parent_env(fn: Callable[..., Any], parent_env: dict[str, str], streams: tuple[int, int] | None,
                        *args: Any) -> Any:
    """Run ``fn(*args)`` in a forked worker with the environment its parent had at launch, plus the
    variables torch's agent set for this worker (those that differ from what the fork inherited), and
    with the parent's standard output and error (``streams`` from :func:`parent_streams`; None keeps the
    streams the agent redirected to its log files).

    Before anything else the worker moves every object the fork inherited (torch's and podscale's modules:
    a few hundred thousand) into the collector's permanent generation (``gc.freeze``, as CPython's
    documentation advises after a pre-fork server's imports): a full collection in the worker then walks
    only what the worker made, not 0.25-0.5 s of inherited objects each time, and never touches the
    inherited pages (copy-on-write stays shared)."""
    gc.freeze()
    agent = {k: v for k, v in os.environ.items() if _INHERITED.get(k) != v}
    os.environ.clear()
    os.environ.update(parent_env)
    os.environ.update(agent)
    apply_malloc_env()
    if streams is not None:
        for fd, received in zip((1, 2), streams):
            os.dup2(received, fd)
            os.close(received)
    try:
        return fn(*args)
    finally:  # multiprocessing ends a forked worker with os._exit: no atexit (see podscale.runtime.exit)
        run_exit_functions()


def start_server() -> None:
    """Start this process's fork server (once; again if it died) with :data:`PRELOAD` imported, and
    without glibc's ``MALLOC_*_`` variables: the server's allocator must not carry a setting into workers
    that are later launched without it."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    saved = {k: os.environ.pop(k) for k in _MALLOC_VARS if k in os.environ}
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.update(saved)


def apply_malloc_env() -> None:
    """glibc reads ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` only when a process starts; a
    forked worker gets them from its parent's environment through mallopt(3), the call they stand for."""
    for var, param in _MALLOC_VARS.items():
        value = os.environ.get(var, "")
        if value.isdigit():
            mallopt(param, int(value))
