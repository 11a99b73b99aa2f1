"""Clean-up at process exit that also runs in workers forked by multiprocessing.

Python runs :mod:`atexit` functions when the interpreter exits normally, but multiprocessing ends a forked
child (the ``fork`` and ``forkserver`` start methods; podscale's local workers are forked) with
``os._exit`` once its target returns, which skips them.  podscale's own exit work -- draining engines that
were never closed, removing scratch swap files, stopping the watchdog -- is registered here: with
:mod:`atexit` for interpreters that exit normally, and run by :func:`run_exit_functions`, which the forked
worker's entry point calls when the launched function returns or raises.
"""
from __future__ import annotations

import atexit
import sys
import traceback
from collections.abc import Callable

_FUNCS: list[Callable[[], None]] = []


def at_exit(fn: Callable[[], None]) -> Callable[[], None]:
    """Register ``fn`` (no arguments) to run at exit; usable as a decorator."""
    atexit.register(fn)
    _FUNCS.append(fn)
    return fn


def unregister(fn: Callable[[], None]) -> None:
    """Forget ``fn`` (it ran already, e.g. an object closed explicitly)."""
    atexit.unregister(fn)
    while fn in _FUNCS:
        _FUNCS.remove(fn)


def run_exit_functions() -> None:
    """Run the registered functions now, last registered first, as :mod:`atexit` would (an exception is
    printed and the others still run), and unregister them."""
    while _FUNCS:
        fn = _FUNCS.pop()
        atexit.unregister(fn)
        try:
            fn()
        except Exception:
            traceback.print_exc(file=sys.stderr)
