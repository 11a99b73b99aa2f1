"""LAMB and LARS over flat shards, with per-tensor trust ratios that stay exact when a tensor is split.

Both optimizers scale each *tensor*'s update by a trust ratio built from norms over the whole tensor:

* LARS (You, Gitman & Ginsburg 2017, eq. 6 / Algorithm 1): local lr ``η ||w|| / (||g|| + β ||w||)``, then
  momentum SGD on ``g + β w``.
* LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
  Algorithm 2): Adam direction ``r = m̂ / (sqrt(v̂) + ε)``, ``u = r + λ w``, step ``-lr · ||w|| / ||u|| · u``
  (ratio 1 when either norm is zero).

Under ZeRO a rank holds arbitrary flat *pieces* of tensors.  Each rank sums squares per tensor over its
pieces, one all-reduce of the ``2 × n_tensors`` vector over the data-parallel group gives the true global
norms (the same trick as global-norm clipping), and each piece is scaled by its tensor's ratio.  The
correctness test checks the result against a per-tensor implementation on one process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Piece:
    """The part of tensor ``index`` this rank holds: 1-D views of master, gradient and two state buffers."""
    index: int
    param: torch.Tensor
    grad: torch.Tensor
    state1: torch.Tensor   # LAMB: exp_avg; LARS: momentum buffer
    state2: torch.Tensor   # LAMB: exp_avg_sq; LARS: unused
    weight_decay: float


def _tensor_norms(pieces: list[Piece], n: int, values: list[torch.Tensor],
                  allreduce: Callable[[torch.Tensor], None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Global L2 norms per tensor of the params and of ``values`` (one tensor per piece)."""
    sq = torch.zeros(2, n, dtype=torch.float64)
    for p, val in zip(pieces, values):
        sq[0, p.index] += float(torch.linalg.vector_norm(p.param).square())
        sq[1, p.index] += float(torch.linalg.vector_norm(val).square())
    allreduce(sq)
    return sq[0].sqrt(), sq[1].sqrt()


class FlatLamb:
    def __init__(self, pieces: list[Piece], n_tensors: int, allreduce: Callable[[torch.Tensor], None],
                 betas=(0.9, 0.999), eps: float = 1e-6):
        self.pieces, self.n, self.allreduce = pieces, n_tensors, allreduce
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.t = 0

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        c1, c2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        updates = []
        for p in self.pieces:
            p.state1.lerp_(p.grad, 1 - b1)
            p.state2.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            u = (p.state1 / c1) / ((p.state2 / c2).sqrt_().add_(self.eps))
            if p.weight_decay:
                u.add_(p.param, alpha=p.weight_decay)
            updates.append(u)
        wn, un = _tensor_norms(self.pieces, self.n, updates, self.allreduce)
        ratio = torch.where((wn > 0) & (un > 0), wn / un.clamp_min(1e-300), torch.ones_like(wn))
        for p, u in zip(self.pieces, updates):
            p.param.add_(u, alpha=-lr * float(ratio[p.index]))


class FlatLars:
    def __init__(self, pieces: list[Piece], n_tensors: int, allreduce: Callable[[torch.Tensor], None],
                 momentum: float = 0.9, trust: float = 0.001, eps: float = 0.0):
        self.pieces, self.n, self.allreduce = pieces, n_tensors, allreduce
        self.momentum, self.trust, self.eps = momentum, trust, eps

    @torch.no_grad()
    def step(self, lr: float) -> None:
        wn, gn = _tensor_norms(self.pieces, self.n, [p.grad for p in self.pieces], self.allreduce)
        for p in self.pieces:
            w, g = float(wn[p.index]), float(gn[p.index])
            wd = p.weight_decay
            local = self.trust * w / (g + wd * w + self.eps) if w > 0 and g > 0 else 1.0
            d = p.grad.add(p.param, alpha=wd) if wd else p.grad.clone()
            p.state1.mul_(self.momentum).add_(d, alpha=lr * local)
            p.param.sub_(p.state1)
