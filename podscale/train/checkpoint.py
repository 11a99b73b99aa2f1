"""Sharded checkpoints with torch.distributed.checkpoint (DCP), written atomically.

A checkpoint of step ``N`` is the folder ``step_0000000N`` holding the DCP files (model and optimizer
tensors; only tensors, and read back through :mod:`podscale.train.safe_reader`'s allow-list, so loading
never unpickles), ``meta.json`` (step, data position, loss scale, layout,
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
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from podscale.storage.lazy import StreamingLoadPlanner, StreamingSavePlanner
from podscale.train import faults
from podscale.train.safe_reader import SafeFileSystemReader

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


def save(root: Path, step: int, tensors: dict, meta: dict, rank_state: dict, rank: int, keep: int,
         extra: Callable[[Path], None] | None = None) -> Path:
    """Collective: write checkpoint ``step`` under ``root`` atomically and keep the newest ``keep``.
    ``extra(partial_dir)`` (every rank) writes state beside the tensors before the folder is renamed into
    place (a task's :meth:`~podscale.tasks.Task.save_state`)."""
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
    if extra is not None:
        extra(partial)
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


def verify(path: Path) -> None:
    """Raise a one-line ValueError unless ``path`` has a readable meta.json and DCP metadata that the
    allow-list reader accepts (what the CLI checks before workers start)."""
    read_meta(path)
    SafeFileSystemReader(str(path)).read_metadata()


def load(path: Path, template: dict, rank: int) -> tuple[dict, dict | None]:
    """Collective: fill ``template``'s tensors in place from ``path``; returns (meta, this rank's state)."""
    meta = read_meta(path)
    reader = SafeFileSystemReader(str(path))  # never unpickles: see safe_reader
    reader.read_metadata()  # a refused checkpoint: its one line here (DCP would wrap it in tracebacks)
    dcp.load(template, storage_reader=reader, planner=StreamingLoadPlanner())
    rank_file = Path(path) / f"rank_{rank:05d}.pt"
    rank_state = torch.load(rank_file, weights_only=True) if rank_file.is_file() else None
    return meta, rank_state


EXPORT_FORMATS = ("torch", "safetensors")


def export(path: Path, out: Path, fmt: str = "torch") -> Path:
    """Consolidate the model weights of checkpoint ``path`` into one plain file.

    ``torch``: ``{"model": state_dict, "model_config": dict, "task": str, "step": int}`` (the task's class
    as ``module:Class`` and its :meth:`~podscale.tasks.Task.model_config`), loadable with
    ``torch.load(out, weights_only=True)``.  ``safetensors``: the tensors under their single-process names,
    with ``model_config`` (JSON), ``task`` and ``step`` in the file's metadata header
    (:func:`read_safetensors`).
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"export format '{fmt}' is unknown: use one of {', '.join(EXPORT_FORMATS)}")
    meta = read_meta(path)
    # Only the model's tensors, full size, through the reader that never unpickles; read before anything is
    # written.  DCP flattens the nested template to the stored keys "model.<parameter name>".
    reader = SafeFileSystemReader(str(path))
    entries = reader.read_metadata().state_dict_metadata
    state = {"model": {key.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype)
                       for key, md in entries.items() if key.startswith("model.")}}
    dcp.load(state, storage_reader=reader, no_dist=True)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmpdir:
        tmp = Path(tmpdir) / "out"
        task = meta.get("task", "podscale.tasks.gpt:GPTTask")
        if fmt == "safetensors":
            write_safetensors(state["model"], meta.get("model_config", {}), task, int(meta["step"]), tmp)
        else:
            torch.save({"model": state["model"], "model_config": meta.get("model_config", {}),
                        "task": task, "step": meta["step"]}, tmp)
        os.replace(tmp, out)
    return out


def write_safetensors(model: dict[str, torch.Tensor], model_config: dict, task: str, step: int,
                      out: Path) -> None:
    """``model``'s tensors in the safetensors format (no pickle: a JSON header and raw bytes), the model
    config, task and step as header metadata.  Tensors that share storage (a tied embedding) are written once
    each, as separate contiguous copies, which safetensors requires."""
    from safetensors.torch import save_file
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.items()}
    save_file(tensors, str(out), metadata={"model_config": json.dumps(model_config), "task": task, "step": str(step),
                                           "format": "pt", "producer": "podscale"})


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict, int]:
    """(state dict, model config, step) of a file written by :func:`write_safetensors`."""
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        header = f.metadata() or {}
        state = {k: f.get_tensor(k) for k in f.keys()}
    if "model_config" not in header:
        raise ValueError(f"'{path}' has no podscale model_config in its safetensors header: export it with "
                         "`podscale export RUN OUT.safetensors`")
    return state, json.loads(header["model_config"]), int(header.get("step", 0))
