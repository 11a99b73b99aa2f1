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
import warnings
from dataclasses import dataclass
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


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed; the message is one line naming the file and the fix."""


@dataclass(frozen=True)
class Expected:
    """What the run that resumes a checkpoint needs it to hold (None: not checked).

    ``task`` is the task class as ``module:Class`` and ``model_config`` its :meth:`Task.model_config`, as
    ``meta.json`` records them; ``shapes`` maps each model tensor's stored key (``"model.<name>"``, the
    single-process name) to its full shape, as the DCP metadata records them."""

    task: str | None = None
    model_config: dict | None = None
    shapes: dict[str, tuple[int, ...]] | None = None


_FIX = "the checkpoint is damaged: delete it to resume from an earlier one, or start over with --fresh"


def check(path: Path, expected: Expected | None = None) -> None:
    """Raise :class:`CheckpointError` unless checkpoint ``path`` is complete and fits ``expected``.

    Complete: ``meta.json`` readable; the DCP metadata readable by the allow-list reader; every file it
    points at present and at least as long as the bytes it points into (a truncated shard is caught here,
    not half-way through a load); one ``rank_XXXXX.pt`` per rank of the world that wrote it.  Fits: the
    task, model config and tensor shapes are the resuming run's (metadata of another model is refused).
    Reads no tensor: costs a few ``stat`` calls and the metadata.
    """
    path = Path(path)
    try:
        meta = read_meta(path)
        md = SafeFileSystemReader(str(path)).read_metadata()
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    if expected is not None:  # (first: another model's metadata points past this one's files)
        _check_fits(path, meta, md, expected)
    needed: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint file '{f}' is missing: {_FIX}")
        have = f.stat().st_size
        if have < size:
            raise CheckpointError(f"checkpoint file '{f}' is truncated ({have} of {size} bytes): {_FIX}")
    for r in range(int(meta.get("world_size", 0))):
        f = path / f"rank_{r:05d}.pt"
        if not f.is_file():
            raise CheckpointError(f"checkpoint file '{f}' is missing: {_FIX}")


def _check_fits(path: Path, meta: dict, md, expected: Expected) -> None:
    """The task, model config (``meta.json``) and model tensor shapes (DCP metadata) are ``expected``'s."""
    other = ("resume it with the config it was written with, or start over with --fresh or another run.name")
    if expected.task is not None and meta.get("task", expected.task) != expected.task:
        raise CheckpointError(f"checkpoint '{path / 'meta.json'}' was written by task {meta.get('task')}, this run "
                              f"trains {expected.task}: {other}")
    if expected.model_config is not None and meta.get("model_config") not in (None, expected.model_config):
        theirs = meta["model_config"]
        diff = ", ".join(f"{k}={theirs.get(k)!r} there, {expected.model_config.get(k)!r} here"
                         for k in sorted(set(theirs) | set(expected.model_config))
                         if theirs.get(k) != expected.model_config.get(k))
        raise CheckpointError(f"checkpoint '{path / 'meta.json'}' was written for another model ({diff}): {other}")
    if expected.shapes is not None:
        stored = {k: tuple(e.size) for k, e in md.state_dict_metadata.items() if k.startswith("model.")}
        for key in sorted(set(stored) | set(expected.shapes)):
            if stored.get(key) != expected.shapes.get(key):
                what = (f"has no {key}" if key not in stored else f"holds {key} that this model has not"
                        if key not in expected.shapes else
                        f"has {key} of shape {list(stored[key])}, this model {list(expected.shapes[key])}")
                raise CheckpointError(f"checkpoint metadata '{path / '.metadata'}' describes another model (it "
                                      f"{what}): {other}")


def expected_of(task, model=None) -> Expected:
    """What resuming ``task`` needs of a checkpoint; with ``model`` (the task's plain model, on any device
    including meta) also the tensor shapes."""
    shapes = None if model is None else {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}
    return Expected(task=task_name(task), model_config=task.model_config(), shapes=shapes)


def task_name(task) -> str:
    """A task's class as ``module:Class`` (recorded in ``meta.json``)."""
    return task_class_name(type(task))


def latest_usable(root: Path, expected: Expected | None = None) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under ``root`` that passes :func:`check`, and one line for each newer one
    passed over (what was wrong with it); (None, lines) when none is usable."""
    skipped: list[str] = []
    for path in reversed(completed(root)):
        try:
            check(path, expected)
            return path, skipped
        except CheckpointError as err:
            skipped.append(str(err))
    return None, skipped


def fallback_note(skipped: list[str], found: Path | None) -> str:
    """The line that says which checkpoint a resume falls back to, and why."""
    then = "starting from step 0: no earlier checkpoint is usable" if found is None else \
        f"resuming from {found.name}, the previous complete checkpoint"
    return f"podscale: warning: {'; '.join(skipped)}; {then}"


def verify(path: Path) -> None:
    """Raise a one-line ValueError unless ``path`` has a readable meta.json and DCP metadata that the
    allow-list reader accepts."""
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


def resolve(path: Path) -> Path | None:
    """The checkpoint a user names: a ``step_XXXXXXXX`` folder itself, or the newest complete one of a run
    directory or of its ``checkpoints`` folder (None when there is none)."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    return latest(path / "checkpoints" if (path / "checkpoints").is_dir() else path)


def task_class_name(cls: type) -> str:
    """A task class as ``module:Class`` (what ``meta.json`` records)."""
    return f"{cls.__module__}:{cls.__qualname__}"


@dataclass(frozen=True)
class ModelWeights:
    """The model tensors of a checkpoint, read whole under their single-process names: what
    ``train.init_from`` starts a run from (the same model's weights, or another model's that the task
    converts, e.g. a dense GPT's that a GPT-MoE upcycles).  ``shapes`` and ``dtypes`` come from the DCP
    metadata; no tensor is read until :meth:`read`."""

    path: Path
    task: str
    model_config: dict
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]

    @classmethod
    def open(cls, path: Path) -> "ModelWeights":
        """Checkpoint ``path`` (complete: :func:`check`); a one-line :class:`CheckpointError` otherwise."""
        check(path)
        meta = read_meta(path)
        entries = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
        model = {k.removeprefix("model."): md for k, md in entries.items() if k.startswith("model.")}
        return cls(Path(path), meta.get("task", "podscale.tasks.gpt:GPTTask"), meta.get("model_config", {}),
                   {k: tuple(md.size) for k, md in model.items()},
                   {k: md.properties.dtype for k, md in model.items()})

    def read(self, names) -> dict[str, torch.Tensor]:
        """The named tensors, whole, on the CPU (each process reads for itself: no collective), through the
        reader that never unpickles."""
        state = {"model": {n: torch.empty(self.shapes[n], dtype=self.dtypes[n]) for n in names}}
        if state["model"]:
            with warnings.catch_warnings():  # DCP warns that it loads in a single process even when asked to
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.load(state, storage_reader=SafeFileSystemReader(str(self.path)), no_dist=True)
        return state["model"]

    def require_same_model(self, task: str, shapes: dict[str, tuple[int, ...]]) -> None:
        """A one-line :class:`CheckpointError` unless these are the weights of ``task``'s model with tensors
        of exactly ``shapes`` (one-process names)."""
        fix = ("point train.init_from at a checkpoint of this model (a GPT-MoE also takes a dense GPT's, "
               "which it upcycles) or remove it")
        if self.task != task:
            raise CheckpointError(f"train.init_from: '{self.path}' holds a {self.task} model, this run trains "
                                  f"{task}: {fix}")
        for key in sorted(set(self.shapes) | set(shapes)):
            if self.shapes.get(key) != shapes.get(key):
                what = (f"has no {key}" if key not in self.shapes else f"holds {key}, which this model has not"
                        if key not in shapes else
                        f"has {key} of shape {list(self.shapes[key])}, this model {list(shapes[key])}")
                raise CheckpointError(f"train.init_from: '{self.path}' {what}: {fix}")


def initial_weights(path: Path, task, shapes: dict[str, tuple[int, ...]]):
    """``train.init_from``: the checkpoint ``path`` names (:func:`resolve`) as :class:`ModelWeights`, and the
    task's conversion of it (None: it is this model's own, checked against the one-process ``shapes``, keyed
    as :func:`expected_of` keys them).  One-line ValueErrors naming what does not fit; reads no tensor."""
    found = resolve(path)
    if found is None:
        raise CheckpointError(f"train.init_from: no checkpoint in '{path}': give a run directory or a "
                              "step_XXXXXXXX folder")
    source = ModelWeights.open(found)
    conversion = task.convert_weights(source)
    if conversion is None:
        source.require_same_model(task_name(task), {k.removeprefix("model."): v for k, v in shapes.items()})
    return source, conversion


def load_model(path: Path, template: dict) -> None:
    """Collective: fill a strategy's ``model_state()`` template in place with checkpoint ``path``'s model
    tensors (its optimizer state, data position and step are not read)."""
    dcp.load({"model": template}, storage_reader=SafeFileSystemReader(str(path)), planner=StreamingLoadPlanner())


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
    # Only the model's tensors, full size; read before anything is written
    weights = ModelWeights.open(path)
    state = {"model": weights.read(weights.shapes)}
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
