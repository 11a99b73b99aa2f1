"""ZeRO-Infinity's NVMe optimizer offload: fp32 gradient, master and Adam moments of this rank's shard on
disk, streamed through memory in fixed-size chunks.

Rajbhandari et al. 2021 ("ZeRO-Infinity", sections 5.1 and 6.2-6.3): the optimizer state of a shard is
split into sub-groups; while one sub-group is stepped on the CPU, the next is read from NVMe and the
previous one is written back ("write-behind"), so the step runs at the disk's sequential bandwidth.  Here
the rank's flat shard of ``S`` elements is one file holding four fp32 arrays ``[grad | master | m | v]``;
a chunk of ``C`` elements is four large sequential reads into one of two chunk buffers (double
buffering), a fused AdamW over the chunk's segments, the compute-dtype copy of the new master, and three
asynchronous writes.  Gradients reach the file as each unit's reduce-scatter completes (gradient
offload), so resident memory is the compute-dtype shard, two chunk buffers and the working set of
the layers in use — independent of the optimizer state's size.

Scaling of the gradient (fp16 unscale, clipping) is deferred: the engine multiplies the one-element
``coef`` tensor the strategy returns from ``grads()``, and the step applies it to each chunk.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from podscale.optim.flat_adam import FlatAdamW, Segment
from podscale.storage.aio import AsyncFile

GRAD, MASTER, EXP_AVG, EXP_AVG_SQ = range(4)


class NvmeOptimizerState:
    def __init__(self, units, total: int, folder: str, rank: int, chunk_elems: int, betas, eps: float,
                 weight_decay: float, threads: int = 4, param_dtype: torch.dtype | None = None):
        self.units, self.S = units, int(total)
        self.C = max(1, min(int(chunk_elems), self.S))
        self.betas, self.eps, self.wd = betas, eps, weight_decay
        self.path = Path(folder) / f"podscale-zero-rank{rank:05d}-{os.getpid()}.swp"
        # optional fifth region: the compute-dtype parameter shard (ZeRO-Infinity parameter offload)
        self.psize = torch.empty((), dtype=param_dtype).element_size() if param_dtype is not None else 0
        self.file = AsyncFile(self.path, (16 + self.psize) * self.S, threads=threads,
                              block_bytes=min(8 << 20, 4 * self.C))
        self.bufs = [torch.zeros(4, self.C, dtype=torch.float32) for _ in range(2)]
        self._writes: list[list] = [[], []]
        self._grad_writes: list = []
        self.t = 0
        # (chunk start, chunk end) -> segments as (array offset within chunk, length, decay, unit)
        self.chunks = [(a, min(a + self.C, self.S)) for a in range(0, self.S, self.C)]
        self._plan = [self._segments_of(a, b) for a, b in self.chunks]

    def _off(self, array: int, elem: int) -> int:
        return (array * self.S + elem) * 4

    def _segments_of(self, a: int, b: int):
        out = []
        for u in self.units:
            for s, e, decay in u.segments():
                lo, hi = max(a, u.goff + s), min(b, u.goff + e)
                if hi > lo:
                    out.append((lo - a, hi - lo, decay, u, lo - u.goff))
        return out

    # parameter offload -----------------------------------------------------------------------------
    def write_param(self, u, lo: int, t: torch.Tensor) -> None:
        self.file.write(16 * self.S + (u.goff + lo) * self.psize, t.detach().to("cpu", copy=True)).wait()

    def read_param(self, u, out: torch.Tensor):
        return self.file.read(16 * self.S + u.goff * self.psize, out)

    # initial state / gradients -------------------------------------------------------------------
    def write_master(self, u, master_fp32: torch.Tensor) -> None:
        # a host copy with its own storage (from the GPU, or a view numpy would pin)
        self.file.write(self._off(MASTER, u.goff), master_fp32.detach().to("cpu", copy=True)).wait()

    def add_grad(self, u, g: torch.Tensor, fresh: bool) -> None:
        """Store (fresh) or accumulate unit ``u``'s fp32 gradient shard on disk."""
        g = g.float().contiguous()
        if not fresh:
            self.wait_grads()
            old = torch.empty_like(g)
            self.file.read(self._off(GRAD, u.goff), old).wait()
            g = g.add_(old)
        self._grad_writes.append((self.file.write(self._off(GRAD, u.goff), g), g))
        while len(self._grad_writes) > 2:  # bound the gradient shards held in memory until written
            req, _keep = self._grad_writes.pop(0)
            req.wait()

    def wait_grads(self) -> None:
        for req, _keep in self._grad_writes:
            req.wait()
        self._grad_writes.clear()

    def grad_sumsq(self) -> float:
        """Sum of squares of the gradient shard, read back chunk by chunk (after accumulation)."""
        self.wait_grads()
        total = 0.0
        for a, b in self.chunks:
            buf = self.bufs[0][GRAD, : b - a]
            self._wait_writes(0)
            self.file.read(self._off(GRAD, a), buf).wait()
            total += float(torch.linalg.vector_norm(buf).square())
        return total

    # the step --------------------------------------------------------------------------------------
    def _wait_writes(self, slot: int) -> None:
        for r in self._writes[slot]:
            r.wait()
        self._writes[slot].clear()

    def _read(self, i: int, slot: int):
        a, b = self.chunks[i]
        self._wait_writes(slot)  # the buffer's previous chunk must be on disk before it is overwritten
        n = b - a
        buf = self.bufs[slot]
        return [self.file.read(self._off(k, a), buf[k, :n]) for k in range(4)]

    def step(self, lr: float, coef: float, publish) -> None:
        """AdamW over every chunk: read ahead i+1 while stepping i, write i behind.  ``publish(u, lo, hi,
        master_view)`` receives the new master of unit ``u``'s shard-local range [lo, hi)."""
        self.wait_grads()
        self.t += 1
        pending = self._read(0, 0)
        for i, (a, b) in enumerate(self.chunks):
            slot = i % 2
            for r in pending:
                r.wait()
            if i + 1 < len(self.chunks):
                pending = self._read(i + 1, 1 - slot)
            buf, n = self.bufs[slot], b - a
            if coef != 1.0:
                buf[GRAD, :n].mul_(coef)
            segs = [Segment(buf[MASTER, o:o + k], buf[GRAD, o:o + k], buf[EXP_AVG, o:o + k],
                            buf[EXP_AVG_SQ, o:o + k], self.wd if decay else 0.0,
                            torch.tensor(float(self.t - 1)))
                    for o, k, decay, _u, _l in self._plan[i]]
            FlatAdamW.step_segments(segs, lr, self.betas[0], self.betas[1], self.eps)
            for o, k, _d, u, lo in self._plan[i]:
                publish(u, lo, lo + k, buf[MASTER, o:o + k])
            self._writes[slot] = [self.file.write(self._off(k, a), buf[k, :n]) for k in (MASTER, EXP_AVG, EXP_AVG_SQ)]

    def flush(self) -> None:
        self.wait_grads()
        for s in (0, 1):
            self._wait_writes(s)

    # checkpoints: whole arrays through memory -------------------------------------------------------
    def read_array(self, array: int) -> torch.Tensor:
        self.flush()
        out = torch.empty(self.S, dtype=torch.float32)
        self.file.read(self._off(array, 0), out).wait()
        return out

    def write_array(self, array: int, t: torch.Tensor) -> None:
        self.flush()
        self.file.write(self._off(array, 0), t.to("cpu").contiguous()).wait()

    def close(self) -> None:
        self.flush()
        self.file.close()
