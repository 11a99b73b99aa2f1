"""Full-graph training over partitions: each rank computes every layer for the nodes it owns, reading its
1-hop halo's states of the previous layer from their owners.

The partition holds the in-edges of its own nodes, whose sources are its own nodes and its halo (nodes
owned elsewhere).  Layer ``l`` of an owned node needs layer ``l - 1`` of its in-neighbours, so before every
layer but the first the rank receives its halo's states from their owners, and in backward sends their
gradients back (summed by the owner into its own nodes' gradients): one ``all_to_all_single`` each way per
layer, through :mod:`podscale.runtime.comm`.  This is the layer-wise halo exchange of distributed
full-graph GNN training (NeuGraph, Ma et al., ATC 2019; ROC, Jia et al., MLSys 2020; CAGNET's 1-D
partitioning, Tripathy et al., SC 2020): the whole graph's forward and backward, computed by owners, so
the data-parallel mean of the ranks' gradients is the one-process gradient.

The first layer's inputs are the halo's features and node embeddings, read from the feature store and the
embedding table by node id (the same path as mini-batch training).
"""
from __future__ import annotations

import numpy as np
import torch

from podscale.graph.partition import Partition
from podscale.graph.sampler import Block
from podscale.runtime import comm


class HaloExchange:
    """The halo of one partition and the rows this rank serves to the other ranks' halos.

    Built once (collective: the halos' ids go to their owners); :meth:`__call__` then turns the owned
    nodes' states ``[num_inner, F]`` into the sources' ``[num_inner + len(halo), F]`` (collective,
    differentiable)."""

    def __init__(self, part: Partition, mesh, axes: str = "dp"):
        self.mesh, self.axes = mesh, axes
        self.n = mesh.size(axes)
        self.start, self.num_inner = part.start, part.num_inner
        self.halo = np.asarray(part.halo, dtype=np.int64)           # sorted new ids, so grouped by owner
        owner = part.owner(self.halo)
        self.recv_splits = np.bincount(owner, minlength=self.n).astype(np.int64).tolist()
        counts = self._a2a(torch.tensor(self.recv_splits, dtype=torch.int64), [1] * self.n, [1] * self.n)
        self.serve_splits = counts.tolist()
        asked = self._a2a(torch.from_numpy(self.halo), self.serve_splits, self.recv_splits)
        self.serve = asked - self.start                                # local positions of the rows served
        self.remote_bytes = 0   # states sent to other ranks and gradients sent back to their owners

    def _a2a(self, send: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        dev = self.mesh.device
        out = torch.empty((sum(out_splits),) + tuple(send.shape[1:]), dtype=send.dtype, device=dev)
        comm.all_to_all(out, send.contiguous().to(dev), self.mesh, self.axes, out_splits, in_splits)
        return out.to(send.device)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([h, _Halo.apply(h, self)], dim=0)


class _Halo(torch.autograd.Function):
    """The halo's rows of the owners' ``h``; backward returns the halo's gradients to the owners."""

    @staticmethod
    def forward(ctx, h, ex: HaloExchange):
        ctx.ex = ex
        send = h.detach()[ex.serve.to(h.device)]
        ex.remote_bytes += send.numel() * send.element_size()   # a halo never holds the rank's own nodes
        return ex._a2a(send, ex.recv_splits, ex.serve_splits)

    @staticmethod
    def backward(ctx, g):
        ex = ctx.ex
        back = ex._a2a(g.contiguous(), ex.serve_splits, ex.recv_splits)
        ex.remote_bytes += g.numel() * g.element_size()
        grad = torch.zeros(ex.num_inner, g.shape[1], dtype=g.dtype, device=g.device)
        grad.index_add_(0, ex.serve.to(g.device), back)
        return grad, None


def partition_block(part: Partition, exchange: HaloExchange) -> Block:
    """The partition's full neighbourhood as one block: destinations its own nodes, sources its own nodes
    then its halo (collective: the halo's in-degrees, for GCN's symmetric normalisation, come from their
    owners through ``exchange``, which later layers use for the halo's states)."""
    halo = np.asarray(part.halo, dtype=np.int64)
    idx = np.asarray(part.indices, dtype=np.int64)
    inner = (idx >= part.start) & (idx < part.start + part.num_inner)
    local = np.where(inner, idx - part.start, part.num_inner + np.searchsorted(halo, idx))
    deg = torch.from_numpy(np.diff(np.asarray(part.indptr, dtype=np.int64))).to(torch.float32)[:, None]
    with torch.no_grad():
        src_deg = exchange(deg)[:, 0].to(torch.int64)
    src = np.concatenate([np.arange(part.start, part.start + part.num_inner, dtype=np.int64), halo])
    return Block(torch.from_numpy(src), part.num_inner, torch.from_numpy(np.asarray(part.indptr, dtype=np.int64)),
                 torch.from_numpy(local), full=True, src_deg=src_deg, halo=exchange)
