"""DLRM (Naumov et al., "Deep Learning Recommendation Model for Personalization and Recommendation
Systems", 2019): a bottom MLP over the dense features, one embedding per sparse feature, pairwise dot
products between all of them ("dot" interaction, section 2.1.3), and a top MLP to one click logit.

The embeddings are not part of :class:`DLRMDense`: they live in a :class:`~podscale.table.
ShardedEmbeddingBags` (model-parallel, rows by key, updated by their owners), while the MLPs are ordinary
dense parameters for data parallelism or ZeRO -- the hybrid parallelism of the paper's section 4.
:class:`DLRM` joins the two for one forward.
"""
from __future__ import annotations

import torch
from torch import nn

from podscale.table import ShardedEmbeddingBags
from podscale.table.embedding import scale_grad


def mlp(sizes: list[int], last_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or last_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def dot_interaction(features: list[torch.Tensor]) -> torch.Tensor:
    """The strictly lower triangle of the Gram matrix of ``features`` (each ``[B, d]``): ``[B, n(n-1)/2]``."""
    x = torch.stack(features, dim=1)                      # [B, n, d]
    gram = torch.bmm(x, x.transpose(1, 2))                 # [B, n, n]
    n = x.shape[1]
    i, j = torch.tril_indices(n, n, offset=-1, device=x.device)
    return gram[:, i, j]


class DLRMDense(nn.Module):
    """DLRM's dense part: ``bottom`` maps the dense features to the embedding width, ``top`` maps the
    bottom output and the pairwise dots of all ``1 + num_sparse`` vectors to one logit."""

    def __init__(self, num_dense: int, num_sparse: int, dim: int, bottom: tuple[int, ...] = (64, 32),
                 top: tuple[int, ...] = (64, 32)):
        super().__init__()
        self.bottom = mlp([num_dense, *bottom, dim], last_activation=True)
        n = 1 + num_sparse
        self.top = mlp([dim + n * (n - 1) // 2, *top, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, pooled: list[torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        z = torch.cat([x, dot_interaction([x, *pooled])], dim=1)
        return self.top(z).squeeze(1)


class DLRM(nn.Module):
    """Sharded tables + :class:`DLRMDense`; ``forward(dense, sparse)`` returns click logits ``[B]``.

    ``tables`` may be attached later (:meth:`attach_tables`: the tables need the mesh, the dense part
    does not).  ``grad_divisor``: the pooled embeddings' gradients are divided by it on their way to the
    tables -- the data-parallel size when each rank's loss is the mean of its share, so that a row's summed
    gradient is the global mean loss's, as the dense gradients' all-reduce mean is.
    """

    def __init__(self, tables: ShardedEmbeddingBags | None, dense: DLRMDense, names: list[str],
                 grad_divisor: int = 1):
        super().__init__()
        self.tables, self.dense, self.names = tables, dense, list(names)
        self.grad_divisor = grad_divisor

    def attach_tables(self, tables: ShardedEmbeddingBags, grad_divisor: int = 1) -> None:
        self.tables, self.grad_divisor = tables, grad_divisor

    def forward(self, dense: torch.Tensor, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        if self.tables is None:
            raise RuntimeError("DLRM has no tables: attach_tables(ShardedEmbeddingBags(...)) first")
        pooled = self.tables(sparse)
        out = []
        for n in self.names:
            p = pooled[n].to(dense.device)
            if self.grad_divisor != 1 and p.requires_grad:
                p = scale_grad(p, 1.0 / self.grad_divisor)
            out.append(p)
        return self.dense(dense, out)
