"""AdamW over flat fp32 shards (the optimizer of ZeRO's partitioned optimizer state).

ZeRO (Rajbhandari et al. 2020, section 5.1) gives each data-parallel rank a contiguous 1/N_d slice of the
flattened parameters and keeps the fp32 master weights and both Adam moments only for that slice.  The
update is elementwise, so the slice is stepped as a handful of long contiguous *segments* (one per
(sub-group, weight-decay class)) instead of one kernel per parameter tensor.

An Adam step reads the parameter, gradient and both moments and writes back parameter and moments:
4 reads + 3 writes of 4 bytes = 28 bytes per parameter, so on a CPU it is bound by memory bandwidth
(ZeRO-Offload, Ren et al. 2021, section 4.2 makes the same point for its CPU-Adam).  The segments go to
torch's fused AdamW kernel (``torch._fused_adamw_``: one pass over memory, vectorised and multi-threaded
on CPU, one launch on CUDA), which is the same arithmetic as ``torch.optim.AdamW(fused=True)`` — the
single-process reference the correctness tests compare against.

Gradients may be kept in 16 bits (ZeRO's 2Ψ/N_d gradient shard in mixed precision: the reduce dtype, as
DeepSpeed keeps them); the fused kernel needs one dtype, so a 16-bit gradient is upcast in chunks of
``UPCAST_CHUNK`` elements into one reused fp32 buffer (small enough to stay in the L2 cache, so the extra
pass costs little bandwidth) and multiplied there by the step's gradient coefficient (loss-scale
unscaling and global-norm clipping, which therefore never round in 16 bits).

Segments may be stepped in any grouping (``step(lr, only=...)``): the NVMe offload steps one sub-group at
a time while the next one is read from disk (ZeRO-Infinity, Rajbhandari et al. 2021, section 6.2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

UPCAST_CHUNK = 1 << 18  # elements of a 16-bit gradient upcast at once (1 MiB of fp32)


@dataclass
class Segment:
    """A contiguous run of the shard with one weight-decay value; all four tensors are 1-D views."""
    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    weight_decay: float
    step: torch.Tensor  # float32 scalar, as torch.optim keeps it


class FlatAdamW:
    """AdamW (Loshchilov & Hutter 2019; Kingma & Ba 2015, Algorithm 1) over :class:`Segment` lists.

    ``segments`` is a list of sub-groups (each a list of segments); the whole list, or some sub-groups,
    are stepped with :meth:`step`.
    """

    def __init__(self, groups: list[list[Segment]], betas=(0.9, 0.95), eps: float = 1e-8):
        self.groups = groups
        self.beta1, self.beta2 = betas
        self.eps = eps
        self._upcast: torch.Tensor | None = None  # fp32 chunk buffer for 16-bit gradients

    def upcast_buffer_bytes(self) -> int:
        return 0 if self._upcast is None else self._upcast.numel() * 4

    @staticmethod
    def step_segments(segs: list[Segment], lr: float, beta1: float, beta2: float, eps: float) -> None:
        """One fused AdamW update of ``segs`` with fp32 gradients (grouped by weight decay: one kernel
        launch per value)."""
        by_wd: dict[float, list[Segment]] = {}
        for s in segs:
            if s.param.numel():
                by_wd.setdefault(s.weight_decay, []).append(s)
        for wd, ss in by_wd.items():
            steps = [s.step for s in ss]
            torch._foreach_add_(steps, 1.0)
            torch._fused_adamw_([s.param for s in ss], [s.grad for s in ss], [s.exp_avg for s in ss],
                                [s.exp_avg_sq for s in ss], [], steps, lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=wd, eps=eps, amsgrad=False, maximize=False)

    def step_mixed(self, segs: list[Segment], lr: float, grad_coef: torch.Tensor | None) -> None:
        """As :meth:`step_segments` for segments with 16-bit gradients: each is upcast chunk by chunk
        and multiplied by ``grad_coef`` (a one-element fp32 tensor) before the fused update."""
        kw = dict(lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps, amsgrad=False, maximize=False)
        for s in segs:
            if s.param.numel():
                s.step.add_(1.0)
                self._step_upcast(s, s.weight_decay, grad_coef, kw)

    def _step_upcast(self, s: Segment, wd: float, coef: torch.Tensor | None, kw: dict) -> None:
        n = s.param.numel()
        if self._upcast is None or self._upcast.device != s.param.device:
            self._upcast = torch.empty(UPCAST_CHUNK, dtype=torch.float32, device=s.param.device)
        for lo in range(0, n, UPCAST_CHUNK):
            hi = min(n, lo + UPCAST_CHUNK)
            g = self._upcast[: hi - lo]
            g.copy_(s.grad[lo:hi])
            if coef is not None:
                g.mul_(coef)
            torch._fused_adamw_([s.param[lo:hi]], [g], [s.exp_avg[lo:hi]], [s.exp_avg_sq[lo:hi]], [], [s.step],
                                weight_decay=wd, **kw)

    def step(self, lr: float, only: list[int] | None = None, grad_coef: torch.Tensor | None = None) -> None:
        """Step the sub-groups ``only`` (default all).  ``grad_coef`` multiplies 16-bit gradients as
        they are upcast; fp32 gradients are used as they are (the caller scaled them in place)."""
        idx = range(len(self.groups)) if only is None else only
        segs = [s for i in idx for s in self.groups[i]]
        narrow = [s for s in segs if s.grad.dtype != s.param.dtype]
        if narrow:
            self.step_mixed(narrow, lr, grad_coef)
        self.step_segments([s for s in segs if s.grad.dtype == s.param.dtype], lr, self.beta1, self.beta2,
                           self.eps)
