"""Sparse optimizers applied by a row's owner, fused into the gradient push.

Each optimizer updates only the rows a step touched (the keys whose gradients arrived), in place, with its
state stored in the same row as the weights (``state_width`` values after the ``dim`` weights), so the
state moves through the tiers with the row and is never held for untouched keys.

* :class:`SparseSGD`: ``w -= lr * g``.
* :class:`RowWiseAdagrad`: Adagrad (Duchi, Hazan and Singer, "Adaptive Subgradient Methods for Online
  Learning and Stochastic Optimization", JMLR 2011) with one accumulator per row, ``acc += mean(g^2)``,
  ``w -= lr * g / (sqrt(acc) + eps)`` -- the row-wise form used for recommendation embeddings (one float of
  state per row instead of ``dim``).  Under column-wise sharding each column block keeps its own
  accumulator over its columns (as FBGEMM's table-batched embeddings do for column shards).
* :class:`LazyAdam`: Adam (Kingma and Ba 2015) whose moments are updated only for touched rows, bias
  corrected with the table's step count (as ``torch.optim.SparseAdam``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class SparseOptimizer(ABC):
    """An update rule for touched rows; ``lr`` may be changed between steps (schedules)."""

    lr: float

    @abstractmethod
    def state_width(self, dim: int) -> int:
        """Floats of optimizer state stored after a row's ``dim`` weights."""

    def init_state(self, n: int, dim: int) -> torch.Tensor:
        """State of ``n`` new rows (zeros unless the rule says otherwise)."""
        return torch.zeros(n, self.state_width(dim))

    @abstractmethod
    def update(self, w: torch.Tensor, state: torch.Tensor, g: torch.Tensor, step: int) -> None:
        """Update weights ``w [n, dim]`` and ``state [n, state_width]`` in place from the summed row
        gradients ``g [n, dim]``; ``step`` counts this table's updates, starting at 1."""


class SparseSGD(SparseOptimizer):
    def __init__(self, lr: float):
        self.lr = lr

    def state_width(self, dim):
        return 0

    def update(self, w, state, g, step):
        w.sub_(self.lr * g)


class RowWiseAdagrad(SparseOptimizer):
    def __init__(self, lr: float, eps: float = 1e-8, initial_accumulator: float = 0.0):
        self.lr, self.eps, self.initial_accumulator = lr, eps, initial_accumulator

    def state_width(self, dim):
        return 1

    def init_state(self, n: int, dim: int) -> torch.Tensor:
        return torch.full((n, 1), self.initial_accumulator)

    def update(self, w, state, g, step):
        state.add_(g.pow(2).mean(dim=1, keepdim=True))
        w.sub_(self.lr * g / (state.sqrt() + self.eps))


class LazyAdam(SparseOptimizer):
    def __init__(self, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.lr, self.betas, self.eps = lr, betas, eps

    def state_width(self, dim):
        return 2 * dim

    def update(self, w, state, g, step):
        b1, b2 = self.betas
        d = w.shape[1]
        m, v = state[:, :d], state[:, d:]
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        mhat = m / (1 - b1 ** step)
        vhat = v / (1 - b2 ** step)
        w.sub_(self.lr * mhat / (vhat.sqrt() + self.eps))
