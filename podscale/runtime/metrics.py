"""Measured machine peak, per-rank memory, and the JSONL metrics log.

Model FLOP/s utilisation (MFU, Chowdhery et al. 2022, Appendix B) is the model's training FLOPs per second
divided by the device's peak.  On a CPU there is no datasheet peak worth quoting, so podscale measures the
best sustained matmul rate once per (device, dtype, thread count) and caches it.
"""
from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import torch

from podscale.cache import cache_dir

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _device_key(device: torch.device, dtype: str) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).replace(" ", "_")
    else:
        name = f"cpu{os.cpu_count()}"
    return f"{name}-{dtype}-threads{torch.get_num_threads()}"


def measure_matmul_peak(device: torch.device, dtype: str = "fp32", n: int | None = None,
                        seconds: float = 0.5) -> float:
    """Best FLOP/s of square ``n``-matmuls over ``seconds`` (2·n³ FLOPs each); ``n`` defaults to 1024 on
    a CPU and 8192 on a GPU (smaller products leave a GPU's matrix units idle and understate its peak)."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=_DTYPES[dtype])
    b = torch.randn(n, n, device=device, dtype=_DTYPES[dtype])
    for _ in range(2):
        a @ b
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return best


def matmul_peak(device: torch.device, dtype: str = "fp32") -> float:
    """The cached peak for this device, dtype and thread count, measuring it on first use."""
    path = cache_dir() / "peak_flops.json"
    key = _device_key(device, dtype)
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if key not in table:
        table[key] = measure_matmul_peak(device, dtype)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(table, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home only costs a re-measurement next time
    return float(table[key])


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: the allocator's peak on CUDA, the process's peak RSS on CPU.  On Linux the
    peak is the kernel's VmHWM of this process's address space: ``ru_maxrss`` also counts the peak of the
    process that started this one before its ``exec`` (a launcher, a large pytest), which is not ours."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics record under '/'-joined names (TensorBoard tags): nested dicts become
    paths (``comm/tp/all_reduce/bytes``), per-rank lists get a rank suffix (``peak_mem_bytes/rank1``),
    booleans count as 0/1; anything else (text) is left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, name + "/"))
        elif isinstance(value, (list, tuple)):
            out.update({f"{name}/rank{i}": float(v) for i, v in enumerate(value) if isinstance(v, (int, float))})
        elif isinstance(value, (bool, int, float)) and key != "step":
            out[name] = float(value)
    return out


class TensorBoardLog:
    """Writes each metrics record's numbers as TensorBoard scalars at its step, into ``folder``
    (``tensorboard --logdir runs/NAME/tensorboard``).  Needs the ``tensorboard`` package (the
    ``[tensorboard]`` extra); its absence is a one-line error naming the fix."""

    def __init__(self, folder: Path, purge_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RuntimeError("run.tensorboard = true needs the tensorboard package: pip install tensorboard "
                               "(or podscale[tensorboard]), or set run.tensorboard = false") from None
        # purge_step: on resume, TensorBoard hides what an interrupted run logged after its checkpoint
        self._w = SummaryWriter(str(folder), purge_step=purge_step)

    def write(self, record: dict) -> None:
        step = int(record["step"])
        for tag, value in scalars(record).items():
            self._w.add_scalar(tag, value, step)

    def close(self) -> None:
        self._w.close()


class MetricsLog:
    """Appends one JSON object per line to ``path``, and with ``tensorboard`` the same numbers to TensorBoard
    event files in ``path``'s folder under ``tensorboard/``; written by one rank."""

    def __init__(self, path: Path, truncate_from_step: int | None = None, tensorboard: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if truncate_from_step is not None and self.path.exists():
            # On resume, drop records the interrupted run wrote after its last checkpoint.
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= truncate_from_step]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(k + "\n" for k in kept))
            os.replace(tmp, self.path)
        self._tb = TensorBoardLog(self.path.parent / "tensorboard",
                                  purge_step=truncate_from_step + 1 if truncate_from_step else None) \
            if tensorboard else None
        self._f = open(self.path, "a", buffering=1)

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            self._tb.write(record)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
