"""``python -m podscale.runtime.bind SCRIPT [ARGS ...]``: a launched worker's script run pinned to its local rank's
share of the cores (``podscale launch --bind-cores``; DeepSpeed's launcher ``--bind_cores_to_rank``).

The elastic agent starts every local worker with the same command, so the binding happens here, in the worker,
from the launcher's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (:func:`~podscale.runtime.process.bind_local_cores`,
the rule ``parallel.bind_cores`` applies to ``podscale train``); then the script runs as ``python SCRIPT ARGS``
would run it: as ``__main__``, with its own folder first on ``sys.path`` and ``sys.argv`` its own.
"""
from __future__ import annotations

import os
import runpy
import sys

import torch

from podscale.runtime.process import bind_local_cores


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m podscale.runtime.bind SCRIPT [ARGS ...]")
    cores = bind_local_cores(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if cores and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(len(cores))
    script = os.path.abspath(argv[0])
    sys.argv = [script, *argv[1:]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
