"""The distributed feature store: node features as read-only rows of the sharded table, by node id.

DistDGL's KVStore (Zheng et al. 2020, section 3.3) on podscale's one sharded table (DESIGN.md, principle 5):
the table ``feat`` holds one row per node, placed on the rank that owns the node's partition (the partition
book is the table's :class:`~podscale.table.hashing.KeyOwner`), so a node's features live with its
in-edges.  :meth:`FeatureStore.fetch` reads

* owned nodes from the partition's own rows (no exchange),
* remote nodes from a cache of remote rows when it holds them (features are read-only, so a cached row is
  never stale: the cache keeps the first ``cache_rows`` remote rows it sees, as PaGraph's static cache
  does; Lin et al., SoCC 2020),
* the rest from their owners in one batched :meth:`~podscale.table.embedding.ShardedEmbeddingBags.lookup`
  (two ``all_to_all_single`` exchanges), counted in :attr:`FeatureStore.remote_bytes`.

``fetch`` is collective over the store's ranks: every rank calls it once per batch, with its own ids
(possibly none).

:class:`NodeEmbeddings` are the learnable counterpart (the issue's "optional learnable node embeddings"; the
free node embeddings of DGL's sparse ``NodeEmbedding`` and of DistDGL's KVStore, section 3.3): one trainable
row per node in a table ``node_emb`` placed by the same partition book, read by node id in the forward pass
and updated in backward by the row's owner with the table's sparse optimizer (row-wise Adagrad, lazy Adam or
SGD: :mod:`podscale.table.optim`), so a node's embedding, like its features, lives with its partition.
"""
from __future__ import annotations

import numpy as np
import torch

from podscale.graph.partition import Partition
from podscale.sortunique import unique
from podscale.storage.rows import MemoryRowStore
from podscale.table.embedding import ShardedEmbeddingBags, TableSpec, scale_grad
from podscale.table.hashing import init_rows, name_seed
from podscale.table.optim import SparseOptimizer


class PartitionOwner:
    """The partition book as a :class:`~podscale.table.hashing.KeyOwner`: partition ``p`` owns the new ids
    ``offsets[p]..offsets[p+1]-1``."""

    def __init__(self, offsets: np.ndarray):
        self.offsets = torch.as_tensor(np.asarray(offsets), dtype=torch.int64)

    def __call__(self, keys: torch.Tensor, n: int) -> torch.Tensor:
        return torch.searchsorted(self.offsets, keys.to(torch.int64), right=True) - 1


class FeatureStore:
    """Node features of all partitions, each rank holding its own; ``fetch(ids)`` returns ``[len(ids), F]``."""

    def __init__(self, part: Partition, mesh, axes: str = "dp", cache_rows: int = 0):
        self.part, self.mesh, self.axes = part, mesh, axes
        self.dim = part.features.shape[1]
        self.table = ShardedEmbeddingBags(
            [TableSpec("feat", max(1, self.dim), trainable=False, num_keys=int(part.offsets[-1]))], mesh,
            axes=axes, owner=PartitionOwner(part.offsets))
        own = torch.arange(part.start, part.start + part.num_inner, dtype=torch.int64)
        self.local = torch.from_numpy(part.features)
        if self.dim:
            self.table.load_rows("feat", own, self.local)
        self.cache_rows = cache_rows
        self.cache = MemoryRowStore(max(1, self.dim)) if cache_rows else None
        self.remote_bytes = 0   # feature bytes received from other ranks since the last reset
        self.remote_rows = 0
        self.cache_hits = 0

    def fetch(self, ids: torch.Tensor) -> torch.Tensor:
        """Features of new ids ``ids`` (collective)."""
        ids = ids.to(torch.int64)
        out = torch.empty(len(ids), self.dim)
        mine = (ids >= self.part.start) & (ids < self.part.start + self.part.num_inner)
        out[mine] = self.local[ids[mine] - self.part.start]
        rpos = (~mine).nonzero().reshape(-1)
        remote = ids[rpos]
        need = torch.ones(len(remote), dtype=torch.bool)
        if self.cache is not None and len(remote):
            rows, found = self.cache.get(remote)
            out[rpos[found]] = rows[found, : self.dim]
            need = ~found
            self.cache_hits += int(found.sum())
        miss = remote[need]
        got = self.table.lookup({"feat": miss})["feat"][:, : self.dim]  # every rank calls it, even with no ids
        out[rpos[need]] = got
        self.remote_rows += len(miss)
        self.remote_bytes += got.numel() * got.element_size()
        if self.cache is not None and len(miss):
            room = self.cache_rows - len(self.cache)
            if room > 0:
                u, first = unique(miss.numpy(), return_index=True)
                keep = first[:room]
                self.cache.put(miss[keep], torch.nn.functional.pad(got[keep], (0, max(1, self.dim) - self.dim)))
        return out

    def reset_stats(self) -> None:
        self.remote_bytes = self.remote_rows = self.cache_hits = 0

    def close(self) -> None:
        self.table.close()


class NodeEmbeddings(torch.nn.Module):
    """Learnable node embeddings ``[num_nodes, dim]`` over ``mesh``'s ``axes``, each row on the rank that owns
    the node's partition; ``forward(ids)`` returns the rows of new ids ``ids`` (collective: every rank calls
    it once per forward pass, with its own ids).

    A row starts uniform in ``[-1/sqrt(dim), 1/sqrt(dim))`` from a hash of (seed, *original* node id), so any
    partitioning of the graph (and one process) starts from the same embedding of every node.  In backward
    the rows' gradients, divided by ``grad_divisor`` (the data-parallel size: each rank's loss is ``dp`` times
    its share of the step's mean, as the dense gradients' all-reduce mean expects), go to the owners, which
    apply ``optimizer`` to the touched rows only.
    """

    NAME = "node_emb"

    def __init__(self, part: Partition, mesh, dim: int, optimizer: SparseOptimizer, seed: int = 0,
                 axes: str = "dp", grad_divisor: int = 1):
        super().__init__()
        self.dim, self.grad_divisor = dim, grad_divisor
        self.table = ShardedEmbeddingBags(
            [TableSpec(self.NAME, dim, trainable=True, num_keys=int(part.offsets[-1]))], mesh, optimizer,
            seed=seed, axes=axes, owner=PartitionOwner(part.offsets))
        own = torch.arange(part.start, part.start + part.num_inner, dtype=torch.int64)
        orig = torch.from_numpy(np.asarray(part.orig_id, dtype=np.int64))
        self.table.load_rows(self.NAME, own, init_rows(name_seed(seed, self.NAME), orig, 0, dim, dim ** -0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.lookup({self.NAME: ids})[self.NAME]
        if self.grad_divisor != 1 and rows.requires_grad:
            rows = scale_grad(rows, 1.0 / self.grad_divisor)
        return rows

    def close(self) -> None:
        self.table.close()
