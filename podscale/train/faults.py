"""Fault injection for tests of recovery: ``PODSCALE_FAULT`` holds comma-separated faults.

``kill@STEP:RANK``  the worker of global rank RANK sends itself SIGKILL before training step STEP;
``stall@STEP:RANK``  the worker of global rank RANK sleeps forever before training step STEP's collectives
(the hang watchdog, :mod:`podscale.runtime.watchdog`, must end the job);
``crash-in-save@STEP``  every rank dies (exit 1) in the middle of writing checkpoint STEP, after the
tensors are written and before the checkpoint is committed.
Faults fire only in the first attempt of an elastic job (restart count 0), so a restarted job recovers.
"""
from __future__ import annotations

import os
import signal
import time


def _faults(kind: str) -> list[tuple[int, ...]]:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return []
    out = []
    for item in filter(None, os.environ.get("PODSCALE_FAULT", "").split(",")):
        name, _, where = item.partition("@")
        if name == kind:
            out.append(tuple(int(x) for x in where.split(":")))
    return out


def maybe_kill(step: int, rank: int) -> None:
    for at in _faults("kill"):
        if at[0] == step and (len(at) < 2 or at[1] == rank):
            os.kill(os.getpid(), signal.SIGKILL)


def maybe_crash_in_save(step: int) -> None:
    for at in _faults("crash-in-save"):
        if at[0] == step:
            os._exit(1)


def maybe_stall(step: int, rank: int) -> None:
    for at in _faults("stall"):
        if at[0] == step and (len(at) < 2 or at[1] == rank):
            while True:
                time.sleep(3600)
