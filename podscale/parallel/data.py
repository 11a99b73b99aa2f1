"""Data parallelism with bucketed gradient all-reduce overlapped with backward compute.

Gradients live in flat bucket buffers (each parameter's ``.grad`` is a view into its bucket), so a bucket
is reduced with one collective and no copies.  Buckets are filled in reverse registration order, which is
roughly the order backward produces gradients (Li et al. 2020, "PyTorch Distributed", section 3.2.3); a
post-accumulate-grad hook counts each bucket down and launches its asynchronous all-reduce as soon as it is
full, so communication of late layers overlaps backward through early layers.  Buckets are always launched
in index order so every rank issues the same collectives in the same order.  Gradients are pre-divided by
the group size so the all-reduce yields the mean.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from podscale.runtime import comm

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, None: None}


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    ready: int = 0
    handle: comm.Handle | None = None
    wire: torch.Tensor | None = None
    pending: set = field(default_factory=set)


class DataParallel:
    """Replicates ``module`` over the mesh axes ``axes`` and averages gradients across them.

    Use ``no_sync()`` around all but the last micro-batch of a gradient-accumulation step, and call
    ``finish_grad_sync()`` after the last backward, before reading gradients.
    """

    def __init__(self, module: nn.Module, mesh, axes: tuple[str, ...] = ("dp",), bucket_mb: float = 25.0,
                 reduce_dtype: str | None = None):
        self.module, self.mesh, self.axes = module, mesh, axes
        self.size = mesh.size(*axes)
        self.reduce_dtype = _DTYPES[reduce_dtype]
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._sync = True
        self._broadcast_parameters()
        self.buckets = self._make_buckets(int(bucket_mb * 2**20))
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._next_launch = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def _broadcast_parameters(self) -> None:
        """Start every replica from rank 0's weights and buffers, as DDP does."""
        if self.size == 1:
            return
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                comm.broadcast(t.data, 0, self.mesh, self.axes)

    def _make_buckets(self, cap_bytes: int) -> list[_Bucket]:
        buckets, current, size = [], [], 0
        for p in reversed(self.params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= cap_bytes:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
        out = []
        for params in buckets:
            dtype, dev = params[0].dtype, params[0].device
            buf = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=dev)
            offset = 0
            for p in params:
                p.grad = buf[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
            out.append(_Bucket(params=params, buffer=buf))
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communication (micro-steps of gradient accumulation)."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync or self.size == 1:
            return
        b = self.buckets[self._bucket_of[id(p)]]
        if id(p) in b.pending:
            return
        b.pending.add(id(p))
        b.ready += 1
        if b.ready == len(b.params):
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if not force and b.ready < len(b.params):
                return
            self._launch(b)
            self._next_launch += 1

    def _launch(self, b: _Bucket) -> None:
        if self.reduce_dtype is not None and self.reduce_dtype != b.buffer.dtype:
            b.wire = b.buffer.to(self.reduce_dtype).div_(self.size)
        else:
            b.wire = b.buffer.div_(self.size)
        b.handle = comm.all_reduce(b.wire, self.mesh, self.axes, async_op=True)

    def finish_grad_sync(self) -> None:
        """Launch buckets that unused parameters kept back, wait for all, and reset for the next step."""
        if self.size == 1:
            return
        self._launch_ready(force=True)
        for b in self.buckets:
            b.handle.wait()
            if b.wire is not b.buffer:
                b.buffer.copy_(b.wire)
            b.handle, b.wire, b.ready = None, None, 0
            b.pending.clear()
        self._next_launch = 0

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the (already averaged, hence identical on every replica) gradients."""
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(b.buffer) for b in self.buckets]))

    def grads(self) -> list[torch.Tensor]:
        return [b.buffer for b in self.buckets]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
