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


def init_process(timeout_s: float = 600.0) -> ProcessInfo:
    """Initialise torch.distributed from the launcher's environment (NCCL on CUDA, gloo on CPU).

    Without a launcher this is a single process and no process group is created.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not under_launcher():
        dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        return ProcessInfo(0, 1, 0, dev, restart)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return ProcessInfo(rank, world, local_rank, device, restart)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
