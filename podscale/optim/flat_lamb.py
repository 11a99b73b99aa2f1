"""LAMB and LARS over flat shards, with per-tensor trust ratios that stay exact when a tensor is split.

Both optimizers scale each *tensor*'s update by a trust ratio built from norms over the whole tensor:

* LARS (You, Gitman & Ginsburg 2017, "Large Batch Training of Convolutional Networks", eq. 6 /
  Algorithm 1): local lr ``η ||w|| / (||g|| + β ||w||)``, then momentum SGD on ``g + β w``.
* LAMB (You et al. 2019/2020, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
  Algorithm 2): Adam direction ``r = m̂ / (sqrt(v̂) + ε)``, ``u = r + λ w``, step ``-lr · ||w|| / ||u|| · u``
  (ratio 1 when either norm is zero).

Under ZeRO a rank holds arbitrary flat *pieces* of tensors, and with ZeRO-Infinity's NVMe offload only a
chunk of them is in memory at a time.  So each rule is written once as two passes over pieces
(:class:`TrustRatioRule`): :meth:`~TrustRatioRule.measure` returns a piece's squared weight norm and the
squared norm of the quantity the ratio divides by (LAMB also updates its moments there), then
:meth:`TrustRatioNorms.reduce` sums the per-tensor squares over the data-parallel group with one
all-reduce of the ``2 × n_tensors`` vector — on the mesh's device, as NCCL reduces only device tensors —
and :meth:`~TrustRatioRule.apply` scales each piece by its tensor's ratio.  The in-memory
:class:`FlatTrustRatio` runs both passes over every piece; the NVMe state streams its chunks through the
same two methods (:mod:`podscale.parallel.zero.flat_state`).  LAMB's direction is recomputed in the second
pass from the moments written in the first (same inputs, same bits), so no update tensor is kept.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

#: names of a piece's arrays, as the streaming backend calls them
GRAD, MASTER, STATE1, STATE2 = "grad", "master", "state1", "state2"


@dataclass
class Piece:
    """The part of tensor ``index`` this rank holds: 1-D views of master, gradient and two state buffers."""
    index: int
    param: torch.Tensor
    grad: torch.Tensor
    state1: torch.Tensor   # LAMB: exp_avg; LARS: momentum buffer
    state2: torch.Tensor   # LAMB: exp_avg_sq; LARS: unused
    weight_decay: float


class TrustRatioRule(ABC):
    """One trust-ratio optimizer as two passes over pieces (see the module docstring).  ``t`` counts steps."""

    #: arrays each pass reads and writes (the streaming backend moves only these through memory)
    measure_reads: tuple[str, ...]
    measure_writes: tuple[str, ...]
    apply_reads: tuple[str, ...]
    apply_writes: tuple[str, ...]
    #: whether :meth:`apply` reads the gradient (it must then be scaled by the step's coefficient again)
    apply_uses_grad: bool

    def __init__(self) -> None:
        self.t = 0

    def begin_step(self) -> None:
        self.t += 1

    @abstractmethod
    def measure(self, p: Piece) -> tuple[float, float]:
        """(``||w||²``, ``||x||²``) of the piece, ``x`` the quantity the ratio divides by."""

    @abstractmethod
    def apply(self, p: Piece, w: float, x: float, lr: float) -> None:
        """Update the piece given its whole tensor's norms ``w = ||w||`` and ``x = ||x||``."""


class Lamb(TrustRatioRule):
    """LAMB (You et al. 2019, Algorithm 2) with bias-corrected Adam moments."""

    measure_reads = (GRAD, MASTER, STATE1, STATE2)
    measure_writes = (STATE1, STATE2)
    apply_reads = (MASTER, STATE1, STATE2)
    apply_writes = (MASTER,)
    apply_uses_grad = False

    def __init__(self, betas=(0.9, 0.999), eps: float = 1e-6):
        super().__init__()
        self.beta1, self.beta2 = betas
        self.eps = eps

    def _direction(self, p: Piece) -> torch.Tensor:
        c1, c2 = 1 - self.beta1 ** self.t, 1 - self.beta2 ** self.t
        u = (p.state1 / c1) / ((p.state2 / c2).sqrt_().add_(self.eps))
        if p.weight_decay:
            u.add_(p.param, alpha=p.weight_decay)
        return u

    def measure(self, p: Piece) -> tuple[float, float]:
        p.state1.lerp_(p.grad, 1 - self.beta1)
        p.state2.mul_(self.beta2).addcmul_(p.grad, p.grad, value=1 - self.beta2)
        return (float(torch.linalg.vector_norm(p.param).square()),
                float(torch.linalg.vector_norm(self._direction(p)).square()))

    def apply(self, p: Piece, w: float, x: float, lr: float) -> None:
        ratio = w / x if w > 0 and x > 0 else 1.0
        p.param.add_(self._direction(p), alpha=-lr * ratio)


class Lars(TrustRatioRule):
    """LARS (You et al. 2017, eq. 6 / Algorithm 1): momentum SGD with a layer-wise local learning rate."""

    measure_reads = (GRAD, MASTER)
    measure_writes = ()
    apply_reads = (GRAD, MASTER, STATE1)
    apply_writes = (MASTER, STATE1)
    apply_uses_grad = True

    def __init__(self, momentum: float = 0.9, trust: float = 0.001, eps: float = 0.0):
        super().__init__()
        self.momentum, self.trust, self.eps = momentum, trust, eps

    def measure(self, p: Piece) -> tuple[float, float]:
        return (float(torch.linalg.vector_norm(p.param).square()),
                float(torch.linalg.vector_norm(p.grad).square()))

    def apply(self, p: Piece, w: float, x: float, lr: float) -> None:
        wd = p.weight_decay
        local = self.trust * w / (x + wd * w + self.eps) if w > 0 and x > 0 else 1.0
        d = p.grad.add(p.param, alpha=wd) if wd else p.grad
        p.state1.mul_(self.momentum).add_(d, alpha=lr * local)
        p.param.sub_(p.state1)


def make_rule(name: str, betas, eps: float) -> TrustRatioRule:
    """The rule ``zero.optimizer`` names (``lamb`` or ``lars``; LARS's momentum is ``beta1``)."""
    if name == "lamb":
        return Lamb(betas, eps)
    if name == "lars":
        return Lars(momentum=betas[0])
    raise ValueError(f"no trust-ratio optimizer '{name}' (lamb, lars)")


class TrustRatioNorms:
    """Per-tensor sums of squares over this rank's pieces, reduced over the data-parallel group.

    ``allreduce(t)`` sums ``t`` in place over the group; the vector it gets lives on ``device`` (the
    mesh's: NCCL refuses host tensors), accumulation happens on the host in float64."""

    def __init__(self, n_tensors: int, allreduce: Callable[[torch.Tensor], None], device: torch.device):
        self.n, self.allreduce, self.device = n_tensors, allreduce, torch.device(device)
        self.sq = torch.zeros(2, n_tensors, dtype=torch.float64)

    def add(self, index: int, w_sq: float, x_sq: float) -> None:
        self.sq[0, index] += w_sq
        self.sq[1, index] += x_sq

    def reduce(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The global norms (``||w||`` and ``||x||`` per tensor, on the host)."""
        total = self.sq.to(self.device)
        self.allreduce(total)
        total = total.cpu().sqrt()
        return total[0], total[1]


class FlatTrustRatio:
    """A trust-ratio rule over in-memory pieces (device memory, or host memory with CPU offload)."""

    def __init__(self, rule: TrustRatioRule, pieces: list[Piece], n_tensors: int,
                 allreduce: Callable[[torch.Tensor], None], device: torch.device):
        self.rule, self.pieces, self.n, self.allreduce, self.device = rule, pieces, n_tensors, allreduce, device

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.rule.begin_step()
        norms = TrustRatioNorms(self.n, self.allreduce, self.device)
        for p in self.pieces:
            norms.add(p.index, *self.rule.measure(p))
        wn, xn = norms.reduce()
        for p in self.pieces:
            self.rule.apply(p, float(wn[p.index]), float(xn[p.index]), lr)
