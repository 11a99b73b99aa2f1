"""Joining the process group: from torchrun's / the elastic agent's environment, or as a lone process."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from podscale.runtime.env import under_launcher


@dataclass(frozen=True)
class ProcessInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    restart_count: int


def device_kind(choice: str = "auto", local_ranks: int = 1) -> str:
    """``"cuda"`` or ``"cpu"`` for ``choice`` in auto|cpu|cuda, with ``local_ranks`` processes on this host.

    ``auto`` defers to the ``PODSCALE_DEVICE`` environment variable when it is set.
    Raises ValueError (one line, with the fix) when CUDA is asked for but absent, or when there are more
    local ranks than visible GPUs: NCCL refuses two ranks on one GPU.
    """
    if choice == "auto":  # the environment may pin it (the test suite runs on the CPU even beside a GPU)
        choice = os.environ.get("PODSCALE_DEVICE", "auto")
    if choice not in ("auto", "cpu", "cuda"):
        raise ValueError(f"run.device='{choice}' must be 'auto', 'cpu' or 'cuda'")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise ValueError("run.device='cuda' but no CUDA device is visible: set run.device = 'cpu' or 'auto'")
    gpus = torch.cuda.device_count()
    if local_ranks > gpus:
        raise ValueError(f"{local_ranks} processes on this host but {gpus} GPU(s) visible (NCCL needs one GPU "
                         f"per rank): set parallel.nproc <= {gpus}, or run.device = 'cpu' to train on the CPU")
    return "cuda"


def bind_local_cores(local_rank: int, local_world: int) -> list[int] | None:
    """Pin the calling thread, and every thread it starts from then on, to this worker's share of the CPUs it may
    run on: the ``local_rank``-th of ``local_world`` equal, contiguous slices of its affinity mask (the whole
    machine, or the cpuset a scheduler gave the job).  Called before the process group is created, so its
    communication threads are bound too (Linux binds threads: ones started earlier keep their mask).  Returns
    the cores, or None, changing nothing, when there are fewer cores than local workers or the platform has no
    ``sched_setaffinity``.

    A CPU worker left to the kernel's scheduler migrates between cores and shares them with its peers'
    communication threads; bound, each keeps its caches and its core (DeepSpeed's launcher
    ``--bind_cores_to_rank``, Intel's ``ipexrun``).  Two jobs bound on one machine would share the same cores,
    hence ``parallel.bind_cores`` is off unless asked for."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    per = len(cpus) // max(1, local_world)
    if per < 1 or not 0 <= local_rank < local_world:
        return None
    mine = cpus[local_rank * per:(local_rank + 1) * per]
    os.sched_setaffinity(0, mine)
    return mine


def local_slot() -> tuple[int, int]:
    """(this worker's local rank, the number of local workers) from the launcher's environment (torchrun's and
    the elastic agent's ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``, podscale's ``PODSCALE_LOCAL_WORLD``); (0, 1)
    without a launcher."""
    world = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("PODSCALE_LOCAL_WORLD", "1"))
    return int(os.environ.get("LOCAL_RANK", "0")), int(world)


def bind_this_worker() -> list[int] | None:
    """:func:`bind_local_cores` for this worker's :func:`local_slot`, with one torch thread per bound core unless
    ``OMP_NUM_THREADS`` says otherwise (``parallel.bind_cores``, ``podscale launch --bind-cores``)."""
    cores = bind_local_cores(*local_slot())
    if cores and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(len(cores))
    return cores


DEFAULT_TIMEOUT_S = 600.0  # torch's process-group timeout when no config sets one


def init_process(timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "auto") -> ProcessInfo:
    """Initialise torch.distributed from the launcher's environment (NCCL on CUDA, gloo on CPU).

    ``device`` is auto|cpu|cuda (see :func:`device_kind`).  Without a launcher this is a single process
    and no process group is created.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not under_launcher():
        kind = device_kind(device, 1)
        return ProcessInfo(0, 1, 0, torch.device(kind, 0) if kind == "cuda" else torch.device("cpu"), restart)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    kind = device_kind(device, int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1)))
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        dev, backend = torch.device("cuda", local_rank), "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return ProcessInfo(rank, world, local_rank, dev, restart)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
