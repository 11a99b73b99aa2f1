"""Bad input found inside the workers, reported as one line by the command that launched them.

Configuration errors are caught before any worker starts (:class:`podscale.config.ConfigError`).  Some bad
input can only be found later, inside the workers: ids outside a table's declared range, a disk that fills
up under the SSD tier, a data file that is damaged past its first line.  Such errors subclass
:class:`InputError`; their message is one line that names the problem and the fix, and code that raises
one makes every rank raise it (the sharded tables agree on a verdict before the collective that would
otherwise hang), so no rank is left waiting.

A worker that fails with one (:func:`exit_on_input_error`) records the line in torch elastic's error file,
the channel the agent already reads for a failed worker's exception, and exits with status 1 without a
traceback; the launching command (``podscale train``) prints the line once, with the ranks that raised it
(:func:`input_error_line`).
"""
from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import Iterator

_PREFIX = "InputError: "


class InputError(ValueError):
    """Bad input found at run time: the message is one line naming what is wrong and the fix."""


@contextmanager
def exit_on_input_error(rank: int | None = None) -> Iterator[None]:
    """In a worker: turn an :class:`InputError` (or a :class:`~podscale.config.ConfigError` raised late) into
    exit status 1 with its one line in the agent's error file (``TORCHELASTIC_ERROR_FILE``) and on
    standard error, instead of a traceback."""
    from podscale.config import ConfigError

    try:
        yield
    except (InputError, ConfigError) as err:
        line = " ".join(str(err).split())  # one line, whatever the message held
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
        try:
            raise InputError(line) from None
        except InputError as wrapped:  # the handler records the exception being handled
            ErrorHandler().record_exception(wrapped)
        where = f"rank {rank}: " if rank is not None else ""
        print(f"podscale: {where}{line}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def input_error_line(messages: dict[int, object]) -> str | None:
    """The one line for a failed group whose ranks' error-file ``messages`` are ``{rank: message}`` (the
    agent reports the first rank that failed): its :class:`InputError`'s line; None when it failed
    otherwise."""
    found = {}
    for r, m in sorted(messages.items()):
        if isinstance(m, dict):  # a recorded exception: {"message": "Type: text", "extraInfo": {...}}
            m = m.get("message")
        if isinstance(m, str) and m.startswith(_PREFIX):
            found[r] = m[len(_PREFIX):]
    if not found:
        return None
    return next(iter(found.values()))


class _DropInputExits(logging.Filter):
    """Drops the agent's traceback of a worker that exited with status 1 (what :func:`exit_on_input_error`
    does after printing its line); a worker that raised or died of a signal is still logged in full."""

    def filter(self, record: logging.LogRecord) -> bool:
        from torch.multiprocessing import ProcessExitedException
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, ProcessExitedException) and exc.exit_code == 1)


def quiet_input_exits() -> None:
    """In the launching process: no agent traceback for workers that stopped on an :class:`InputError`."""
    log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, _DropInputExits) for f in log.filters):
        log.addFilter(_DropInputExits())
