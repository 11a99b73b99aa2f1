"""``python -m podscale.runtime.bind SCRIPT [ARGS ...]``: a launched worker's script run pinned to its local rank's
share of the cores (``podscale launch --bind-cores``; DeepSpeed's launcher ``--bind_cores_to_rank``).

The elastic agent starts every local worker with the same command, so the binding happens here, in the worker,
from the launcher's environment (:func:`~podscale.runtime.process.bind_this_worker`, as ``parallel.bind_cores``
does for ``podscale train``); then the script runs as ``python SCRIPT ARGS``
would run it: as ``__main__``, with its own folder first on ``sys.path`` and ``sys.argv`` its own.
"""
from __future__ import annotations

import os
import runpy
import sys

from podscale.runtime.process import bind_this_worker


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m podscale.runtime.bind SCRIPT [ARGS ...]")
    bind_this_worker()
    script = os.path.abspath(argv[0])
    sys.argv = [script, *argv[1:]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
