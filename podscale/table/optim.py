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

    def state_columns(self, state: torch.Tensor, width: int, a: int, b: int) -> torch.Tensor:
        """The state of columns ``[a, b)`` of rows of ``width`` columns (resharding a checkpoint into other
        column blocks).  Default: per-column state laid out as ``state_width(width) // width`` blocks of
        ``width`` columns."""
        k = self.state_width(width) // width if width else 0
        return torch.cat([state[:, j * width + a: j * width + b] for j in range(k)], dim=1) if k else state[:, :0]

    def join_state(self, parts: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
        """The state of rows joined from column pieces ``(state, width)`` in column order (the inverse of
        :meth:`state_columns`)."""
        total = sum(w for _, w in parts)
        k = self.state_width(total) // total if total else 0
        return torch.cat([p[:, j * w: (j + 1) * w] for j in range(k) for p, w in parts], dim=1) if k else \
            parts[0][0][:, :0]


class SparseSGD(SparseOptimizer):
    def __init__(self, lr: float):
        self.lr = lr

    def state_width(self, dim):
        return 0

    def update(self, w, state, g, step):
        w.add_(g, alpha=-self.lr)


class RowWiseAdagrad(SparseOptimizer):
    def __init__(self, lr: float, eps: float = 1e-8, initial_accumulator: float = 0.0):
        self.lr, self.eps, self.initial_accumulator = lr, eps, initial_accumulator

    def state_width(self, dim):
        return 1

    def init_state(self, n: int, dim: int) -> torch.Tensor:
        return torch.full((n, 1), self.initial_accumulator)

    def update(self, w, state, g, step):
        state.add_(g.pow(2).mean(dim=1, keepdim=True))
        w.addcdiv_(g, state.sqrt().add_(self.eps), value=-self.lr)  # one fused pass over the rows

    def state_columns(self, state, width, a, b):
        """A column block starts from the row's accumulator (exact when blocks were joined from the same
        row; an estimate of the block's own mean otherwise)."""
        return state.clone()

    def join_state(self, parts):
        """The row's accumulator from the blocks': their column-weighted mean (exact: the mean of g^2 over
        the row is the weighted mean of the blocks' means)."""
        total = sum(w for _, w in parts)
        return sum(p * (w / total) for p, w in parts)


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
