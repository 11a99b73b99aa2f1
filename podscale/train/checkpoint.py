"""Sharded checkpoints with torch.distributed.checkpoint (DCP), written atomically.

A checkpoint of step ``N`` is the folder ``step_0000000N`` holding the DCP files (model and optimizer
tensors; only tensors, so loading never unpickles), ``meta.json`` (step, data position, loss scale, layout,
model config) and one ``rank_XXXXX.pt`` per rank with its RNG state.  Everything is first written to
``.step_0000000N.partial``; after every rank has finished, rank 0 writes ``meta.json`` last, fsyncs and
renames the folder into place.  A crash at any point before the rename leaves only a ``.partial`` folder,
which is never read, so the previous checkpoint stays the latest good one.  Tensors backed by a
:class:`~podscale.storage.lazy.LazyPool` (ZeRO-Infinity's state on NVMe) are made resident one buffer at a
time as DCP writes or fills them, so saving and loading such a run streams its state.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from podscale.storage.lazy import StreamingLoadPlanner, StreamingSavePlanner
from podscale.train import faults

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def completed(root: Path) -> list[Path]:
    """Finished checkpoints under ``root``, oldest first."""
    if not Path(root).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(root).iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / "meta.json").is_file()]
    return [p for _, p in sorted(found)]


def latest(root: Path) -> Path | None:
    done = completed(root)
    return done[-1] if done else None


def save(root: Path, step: int, tensors: dict, meta: dict, rank_state: dict, rank: int, keep: int) -> Path:
    """Collective: write checkpoint ``step`` under ``root`` atomically and keep the newest ``keep``."""
    root = Path(root)
    final, partial = root / f"step_{step:08d}", root / f".step_{step:08d}.partial"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir()
    _barrier()
    dcp.save(tensors, checkpoint_id=str(partial), planner=StreamingSavePlanner())  # (NVMe state: unit by unit)
    rank_file = partial / f"rank_{rank:05d}.pt"
    torch.save(rank_state, rank_file.with_suffix(".tmp"))
    os.replace(rank_file.with_suffix(".tmp"), rank_file)
    faults.maybe_crash_in_save(step)
    _barrier()
    if rank == 0:
        write_json_atomic(partial / "meta.json", meta)
        _fsync_dir(partial)
        if final.exists():  # the same step saved again after a resume: swap, then drop the old copy
            old = root / f".step_{step:08d}.old"
            os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old)
        else:
            os.replace(partial, final)
        _fsync_dir(root)
        for stale in completed(root)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return final


def read_meta(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "meta.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"checkpoint '{path}' has no readable meta.json ({err}): "
                         "point at a step_XXXXXXXX folder written by podscale") from None


def load(path: Path, template: dict, rank: int) -> tuple[dict, dict | None]:
    """Collective: fill ``template``'s tensors in place from ``path``; returns (meta, this rank's state)."""
    meta = read_meta(path)
    dcp.load(template, checkpoint_id=str(path), planner=StreamingLoadPlanner())
    rank_file = Path(path) / f"rank_{rank:05d}.pt"
    rank_state = torch.load(rank_file, weights_only=True) if rank_file.is_file() else None
    return meta, rank_state


def export(path: Path, out: Path) -> Path:
    """Consolidate the model weights of checkpoint ``path`` into one plain ``torch.save`` file.

    The file holds ``{"model": state_dict, "model_config": dict, "step": int}`` and loads with
    ``torch.load(out, weights_only=True)``.
    """
    meta = read_meta(path)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmpdir:
        full = Path(tmpdir) / "full.pt"
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        dcp_to_torch_save(str(path), str(full))
        state = torch.load(full, weights_only=True)
        tmp = Path(tmpdir) / "out.pt"
        torch.save({"model": state["model"], "model_config": meta.get("model_config", {}),
                    "step": meta["step"]}, tmp)
        os.replace(tmp, out)
    return out
