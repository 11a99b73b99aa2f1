"""A graph in compressed sparse form, with node features, labels and splits.

:class:`Graph` keeps the edges as CSC over destinations (``indptr``/``indices``: the in-neighbours of node
``v`` are ``indices[indptr[v]:indptr[v + 1]]``), the layout message passing reads (a node aggregates what
its in-neighbours send) and the one neighbour sampling draws from; :meth:`Graph.csr` gives the out-edge
view.  Node ids are ``0..num_nodes-1``; labels are int64 with ``-1`` for unlabelled nodes; the splits are
index arrays.  Arrays are NumPy (the partitioner and the sampler work on them without autograd); the
models turn what they need into tensors.

Every check is made once, in :func:`from_edges` and :meth:`Graph.check`, and fails with one line that
names what is wrong and the fix (:class:`GraphError`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from podscale.sortunique import unique


class GraphError(ValueError):
    """A graph, a partitioning or a sampling setting that cannot work (one line, with the fix)."""


def compress(keys: np.ndarray, values: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(indptr [n + 1], values sorted by key)``: the compressed form of pairs ``(keys[i], values[i])``.

    A stable sort, so the values of one key keep their input order."""
    order = np.argsort(keys, kind="stable")
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(keys, minlength=n), out=indptr[1:])
    return indptr, values[order].astype(np.int64, copy=False)


@dataclass
class Graph:
    """A directed graph (an undirected one holds both directions) in CSC, with node data."""

    num_nodes: int
    indptr: np.ndarray                 # [num_nodes + 1] int64: in-edges of v at indptr[v]:indptr[v+1]
    indices: np.ndarray                # [num_edges] int64: source of each in-edge
    features: np.ndarray | None = None  # [num_nodes, F] float32
    labels: np.ndarray | None = None    # [num_nodes] int64, -1 = unlabelled
    splits: dict[str, np.ndarray] = field(default_factory=dict)  # "train"/"val"/"test" -> node ids
    name: str = "graph"

    @property
    def num_edges(self) -> int:
        return len(self.indices)

    def in_degree(self) -> np.ndarray:
        return np.diff(self.indptr)

    def edges(self) -> tuple[np.ndarray, np.ndarray]:
        """``(src, dst)`` of every edge, ordered by destination."""
        return self.indices, np.repeat(np.arange(self.num_nodes, dtype=np.int64), self.in_degree())

    def csr(self) -> tuple[np.ndarray, np.ndarray]:
        """``(indptr, indices)`` over sources: the out-neighbours of ``u`` are ``indices[indptr[u]:indptr[u+1]]``."""
        src, dst = self.edges()
        return compress(src, dst, self.num_nodes)

    @property
    def num_classes(self) -> int:
        return int(self.labels.max()) + 1 if self.labels is not None and len(self.labels) else 0

    def check(self) -> "Graph":
        """Raise GraphError (one line) unless features, labels and splits fit the nodes; returns self."""
        n = self.num_nodes
        if self.features is not None:
            if self.features.ndim != 2 or self.features.shape[0] != n:
                raise GraphError(f"graph '{self.name}': features have shape {tuple(self.features.shape)} but the "
                                 f"graph has {n} nodes: give one row of features per node, shape ({n}, F)")
        if self.labels is not None and (self.labels.ndim != 1 or len(self.labels) != n):
            raise GraphError(f"graph '{self.name}': labels have shape {tuple(self.labels.shape)} but the graph has "
                             f"{n} nodes: give one label per node (-1 for unlabelled)")
        for name, idx in self.splits.items():
            if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= n):
                raise GraphError(f"graph '{self.name}': split '{name}' names node {int(idx.max())} outside "
                                 f"[0, {n}): fix the split's node ids")
            if self.labels is not None and len(idx) and int(self.labels[idx].min()) < 0:
                raise GraphError(f"graph '{self.name}': split '{name}' holds unlabelled nodes (label -1): "
                                 "remove them from the split or label them")
        return self


def from_edges(src, dst, num_nodes: int, *, features=None, labels=None, splits=None, name: str = "graph",
               symmetric: bool = False, dedupe: bool = False, drop_self_loops: bool = False) -> Graph:
    """A :class:`Graph` from an edge list ``src -> dst`` over nodes ``0..num_nodes-1``.

    ``symmetric`` adds the reverse of every edge; ``dedupe`` removes repeated edges; ``drop_self_loops``
    removes ``v -> v``.  Edges outside the node range raise :class:`GraphError` (one line)."""
    src = np.asarray(src, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst, dtype=np.int64).reshape(-1)
    if len(src) != len(dst):
        raise GraphError(f"graph '{name}': {len(src)} sources but {len(dst)} destinations: give both ends of "
                         "every edge")
    if num_nodes < 1:
        raise GraphError(f"graph '{name}': num_nodes={num_nodes} must be positive")
    if len(src):
        lo, hi = min(int(src.min()), int(dst.min())), max(int(src.max()), int(dst.max()))
        if lo < 0 or hi >= num_nodes:
            bad = lo if lo < 0 else hi
            raise GraphError(f"graph '{name}': an edge names node {bad}, outside the node range [0, {num_nodes}): "
                             "fix the edge list or raise num_nodes")
    if symmetric:
        src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
    if drop_self_loops:
        keep = src != dst
        src, dst = src[keep], dst[keep]
    if dedupe and len(src):
        key = unique(dst * num_nodes + src)
        dst, src = key // num_nodes, key % num_nodes
    indptr, indices = compress(dst, src, num_nodes)
    g = Graph(num_nodes, indptr, indices,
              features=None if features is None else np.ascontiguousarray(features, dtype=np.float32),
              labels=None if labels is None else np.asarray(labels, dtype=np.int64),
              splits={k: np.asarray(v, dtype=np.int64) for k, v in (splits or {}).items()}, name=name)
    return g.check()
