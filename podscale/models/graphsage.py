"""GraphSAGE and GCN over message-flow blocks: one model for full-graph and mini-batch training.

* GraphSAGE with the mean aggregator (Hamilton, Ying and Leskovec, "Inductive Representation Learning on Large
  Graphs", NeurIPS 2017, eq. 1 with the concatenation written as two linear maps, as PyG's ``SAGEConv``):
  ``h_v' = W_self h_v + W_neigh mean_{u in N(v)} h_u``.
* GCN (Kipf and Welling, "Semi-Supervised Classification with Graph Convolutional Networks", ICLR 2017):
  ``H' = D^-1/2 (A + I) D^-1/2 H W`` on the whole graph; on a sampled block, whose sources' degrees are not
  known, the row-normalised ``(D + I)^-1 (A + I)`` (GraphSAGE's "GCN aggregator").

A layer takes a :class:`~podscale.graph.sampler.Block` and the sources' states ``h [num_src, F]`` and returns the
destinations' ``[num_dst, F']``; the aggregation is one sparse CSR x dense product (the block's edges are CSR
over destinations already), built once per block.  ReLU and dropout between layers.

With ``embedding_dim > 0`` the input of every source node is its features followed by its learnable node
embedding (:class:`~podscale.graph.store.NodeEmbeddings`, rows of the sharded table looked up by the first
block's source ids; attached by the task once the mesh exists), so a graph without features trains on the
embeddings alone.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from podscale.graph.sampler import Block

KINDS = ("graphsage", "gcn")


@dataclass(frozen=True)
class GNNConfig:
    kind: str = "graphsage"
    in_dim: int = 32
    hidden: int = 64
    num_classes: int = 8
    layers: int = 2
    dropout: float = 0.5
    embedding_dim: int = 0   # learnable node embedding width appended to the features (0: none)

    def flops_per_node(self, avg_fanin: float) -> float:
        """Forward + backward FLOPs per output node, counting each layer's dense maps once per output
        (a rough figure: sampled blocks widen towards the input)."""
        dims = [self.in_dim + self.embedding_dim] + [self.hidden] * (self.layers - 1) + [self.num_classes]
        maps = 2 if self.kind == "graphsage" else 1
        dense = sum(2 * maps * a * b for a, b in zip(dims, dims[1:]))
        agg = sum(2 * avg_fanin * a for a in dims[:-1])
        return 3 * (dense + agg)


def _csr(indptr: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the product and its backward are what we use
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(indptr, indices, values, shape, check_invariants=False)


def mean_adjacency(block: Block) -> torch.Tensor:
    """``[num_dst, num_src]`` CSR with ``1 / in-degree`` on each in-edge (a mean over the neighbours)."""
    if "mean" not in block.cache:
        deg = (block.indptr[1:] - block.indptr[:-1]).clamp(min=1).to(torch.float32)
        vals = torch.repeat_interleave(1.0 / deg, block.indptr[1:] - block.indptr[:-1])
        block.cache["mean"] = _csr(block.indptr, block.indices, vals, (block.num_dst, block.num_src))
    return block.cache["mean"]


def gcn_adjacency(block: Block) -> torch.Tensor:
    """``[num_dst, num_src]`` CSR of GCN's normalised adjacency with self loops (symmetric on the whole
    graph, row-normalised on a sampled block)."""
    if "gcn" not in block.cache:
        ip, ix = block.indptr, block.indices
        deg = (ip[1:] - ip[:-1])
        n = block.num_dst
        # add the self loop of every destination (destination j is source j) at the end of its row
        counts = deg + 1
        new_ip = torch.zeros(n + 1, dtype=torch.int64, device=ip.device)
        new_ip[1:] = torch.cumsum(counts, 0)
        rows = torch.repeat_interleave(torch.arange(n, device=ip.device), counts)
        pos = torch.arange(int(new_ip[-1]), device=ip.device) - new_ip[rows]
        is_loop = pos == deg[rows]
        cols = torch.empty_like(rows)
        cols[is_loop] = rows[is_loop]
        cols[~is_loop] = ix
        d = (deg + 1).to(torch.float32)
        if block.full:  # sources beyond the destinations (a partition's halo) bring their own degrees
            d_src = d if block.src_deg is None else (block.src_deg + 1).to(torch.float32)
            vals = (d[rows] * d_src[cols]).rsqrt()
        else:
            vals = 1.0 / d[rows]
        block.cache["gcn"] = _csr(new_ip, cols, vals, (n, block.num_src))
    return block.cache["gcn"]


def aggregate_first(block: Block, nnz: int, in_dim: int, out_dim: int) -> bool:
    """Whether ``A (h W)`` costs more multiply-adds than ``(A h) W`` (the same product, associativity): the
    dense map on the ``num_dst`` aggregated rows plus ``nnz * in_dim`` in the sparse product, against the map on
    all ``num_src`` sources plus ``nnz * out_dim``.  On the whole graph (``num_src = num_dst``) it is the
    narrower width first; on a sampled block, whose sources outnumber its destinations several times, it is
    usually the aggregation first even when the map narrows (GraphSAGE on CiteSeer's 3,703 features: a quarter
    of the work)."""
    return block.num_dst * in_dim * out_dim + nnz * in_dim <= block.num_src * in_dim * out_dim + nnz * out_dim


class SAGEConv(nn.Module):
    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.lin_neigh = nn.Linear(in_dim, out_dim)
        self.lin_self = nn.Linear(in_dim, out_dim, bias=False)

    def forward(self, block: Block, h: torch.Tensor) -> torch.Tensor:
        adj = mean_adjacency(block)
        if aggregate_first(block, block.num_edges, self.lin_neigh.in_features, self.lin_neigh.out_features):
            agg = self.lin_neigh(torch.sparse.mm(adj, h))
        else:
            agg = torch.sparse.mm(adj, h @ self.lin_neigh.weight.t()) + self.lin_neigh.bias
        return agg + self.lin_self(h[: block.num_dst])


class GCNConv(nn.Module):
    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.lin = nn.Linear(in_dim, out_dim)

    def forward(self, block: Block, h: torch.Tensor) -> torch.Tensor:
        adj = gcn_adjacency(block)
        if aggregate_first(block, block.num_edges + block.num_dst, self.lin.in_features, self.lin.out_features):
            return self.lin(torch.sparse.mm(adj, h))
        return torch.sparse.mm(adj, h @ self.lin.weight.t()) + self.lin.bias


class GNN(nn.Module):
    """``layers`` GraphSAGE or GCN layers; ``forward(blocks, x)`` returns the last block's destinations'
    logits (``blocks`` input layer first; full-graph training passes the whole-graph block ``layers``
    times).  With ``cfg.embedding_dim`` the node embeddings must be attached (:meth:`attach_embeddings`)
    before the first forward."""

    def __init__(self, cfg: GNNConfig):
        super().__init__()
        self.cfg = cfg
        conv = SAGEConv if cfg.kind == "graphsage" else GCNConv
        dims = [cfg.in_dim + cfg.embedding_dim] + [cfg.hidden] * (cfg.layers - 1) + [cfg.num_classes]
        self.convs = nn.ModuleList(conv(a, b) for a, b in zip(dims, dims[1:]))
        self.dropout = cfg.dropout
        self.embeddings: nn.Module | None = None

    def attach_embeddings(self, embeddings: nn.Module) -> None:
        """``embeddings(ids) -> [len(ids), cfg.embedding_dim]``: the learnable rows of the given node ids."""
        self.embeddings = embeddings

    def forward(self, blocks: list[Block], x: torch.Tensor) -> torch.Tensor:
        h = x
        if self.cfg.embedding_dim:
            if self.embeddings is None:
                raise RuntimeError("GNN has embedding_dim > 0 but no node embeddings: attach_embeddings() first")
            h = torch.cat([x, self.embeddings(blocks[0].src_ids).to(x.device, x.dtype)], dim=1)
        for i, (conv, block) in enumerate(zip(self.convs, blocks)):
            if i and block.halo is not None:  # full-graph training over partitions: the halo's last states
                h = block.halo(h)
            h = F.dropout(h, self.dropout, self.training)
            h = conv(block, h)
            if i < len(self.convs) - 1:
                h = F.relu(h)
        return h
