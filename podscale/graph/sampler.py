"""Neighbour sampling into message-flow blocks, on one process or over partitions.

GraphSAGE's mini-batch training (Hamilton, Ying and Leskovec, "Inductive Representation Learning on Large
Graphs", NeurIPS 2017, Algorithm 2): for a batch of seed nodes, sample up to ``fanout`` in-neighbours of
every node, layer by layer from the output back to the input, uniformly without replacement (all of them
when a node has fewer).  Each layer becomes a :class:`Block`, a bipartite message-flow graph from its source
nodes to its destination nodes, whose destinations are the first sources (DGL's convention), so a layer
reads ``h[:num_dst]`` as the nodes' own state.

:class:`DistSampler` samples over partitions as DistDGL does (Zheng et al. 2020, section 3.4): a node owned by
this rank is sampled here, from the partition's in-edges; every other node is sampled by its owner, through
batched requests per hop: the ids go to their owners in one ``all_to_all_single`` (after one of the request counts), and
the sampled counts and neighbours come back in two more (all through :mod:`podscale.runtime.comm`, on its own mesh so that it can
run on a background thread beside the training collectives).  Every hop is collective: every rank calls
:meth:`DistSampler.sample` the same number of times, with its own seeds (possibly none).  On one rank it is
the single-process sampler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from podscale.graph.core import GraphError
from podscale.runtime import comm
from podscale.sortunique import unique

ALL = -1  # a fan-out that takes every neighbour (exact evaluation)


def check_fanouts(fanouts, layers: int | None = None) -> list[int]:
    """The fan-outs as ints; GraphError (one line) unless each is positive (or ALL) and one per layer."""
    fanouts = [int(f) for f in fanouts]
    if not fanouts or any(f <= 0 and f != ALL for f in fanouts):
        raise GraphError(f"fanouts={fanouts} must be positive neighbour counts, one per layer, e.g. [10, 5]")
    if layers is not None and len(fanouts) != layers:
        raise GraphError(f"fanouts={fanouts} has {len(fanouts)} entries but the model has {layers} layers: "
                         "give one fan-out per layer")
    return fanouts


def sample_csc(indptr: np.ndarray, indices: np.ndarray, rows: np.ndarray, k: int,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """For each row (a local node index) up to ``k`` of its in-neighbours, uniformly without replacement
    (all of them when ``k`` is ALL or the node has at most ``k``).  Returns ``(counts [len(rows)],
    neighbours [counts.sum()])``, grouped by row in order.

    Vectorised over the rows, with work proportional to the sampled edges, not to the rows' degrees (a
    power-law graph's hubs have 10^4-10^5 in-edges): a row with at most ``k`` in-edges takes them all; the
    others draw ``k`` edge offsets each by Floyd's algorithm (Bentley and Floyd, "Programming Pearls: A Sample
    of Brilliance", CACM 1987), one step for all of them at a time: at step ``i`` a row of degree ``d`` draws
    ``t`` uniform in ``[0, d - k + i]`` and keeps ``t``, or ``d - k + i`` when ``t`` is already taken, which
    yields every ``k``-subset with the same probability.  ``k`` steps of ``O(rows * k)`` each."""
    rows = np.asarray(rows, dtype=np.int64)
    start = indptr[rows]
    deg = indptr[rows + 1] - start
    if k == ALL or len(rows) == 0 or int(deg.max()) <= k:
        return deg, indices[_ranges(start, deg)]
    counts = np.minimum(deg, k)
    out_start = np.cumsum(counts) - counts
    out = np.empty(int(counts.sum()), dtype=indices.dtype)
    few = np.flatnonzero(deg <= k)
    out[_ranges(out_start[few], deg[few])] = indices[_ranges(start[few], deg[few])]
    many = np.flatnonzero(deg > k)
    d = deg[many]
    r = rng.random((k, len(many)))
    chosen = np.empty((k, len(many)), dtype=np.int64)
    for i in range(k):
        top = d - k + i                                   # draw from [0, top]
        t = (r[i] * (top + 1)).astype(np.int64)
        if i:
            t = np.where((chosen[:i] == t).any(axis=0), top, t)
        chosen[i] = t
    out[(out_start[many] + np.arange(k)[:, None]).ravel()] = indices[(start[many] + chosen).ravel()]
    return counts, out


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concat(arange(s, s + n) for s, n in zip(starts, lengths))``, vectorised."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    return np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(total, dtype=np.int64)


class SourceStates(Protocol):
    """The states of a block's sources from its destinations' (``[num_dst, F] -> [num_src, F]``): the halo
    exchange of full-graph training over partitions (:class:`~podscale.graph.halo.HaloExchange`)."""

    def __call__(self, h: torch.Tensor) -> torch.Tensor: ...


@dataclass
class Block:
    """One layer's message-flow graph: ``num_dst`` destinations (the first ``num_dst`` of ``src_ids``),
    in-edges in CSR over destinations (``indptr [num_dst + 1]``, ``indices``: positions in ``src_ids``)."""

    src_ids: torch.Tensor     # [num_src] node ids (new ids under partitions)
    num_dst: int
    indptr: torch.Tensor
    indices: torch.Tensor
    full: bool = False        # the whole graph (or a partition's whole neighbourhood): full-graph training
    src_deg: torch.Tensor | None = None   # the sources' in-degrees when not all are destinations (partitions)
    halo: SourceStates | None = None      # a later layer's sources from the previous one's destinations
    cache: dict = field(default_factory=dict, repr=False)  # the models' adjacency matrices, built once

    @property
    def num_src(self) -> int:
        return len(self.src_ids)

    @property
    def num_edges(self) -> int:
        return len(self.indices)

    def to(self, device: torch.device) -> "Block":
        if self.indptr.device == device:
            return self
        return Block(self.src_ids, self.num_dst, self.indptr.to(device), self.indices.to(device), self.full,
                     None if self.src_deg is None else self.src_deg.to(device), self.halo)


def make_block(dst: np.ndarray, counts: np.ndarray, nbrs: np.ndarray) -> Block:
    """The block from destinations ``dst`` (distinct ids) and their sampled in-neighbours: sources are
    ``dst`` followed by the other neighbours in increasing id order; one sort of ``dst`` and ``nbrs``
    together relabels both."""
    nd = len(dst)
    uniq, inv = unique(np.concatenate([dst, nbrs]), return_inverse=True)
    inv = inv.reshape(-1)
    extra = np.ones(len(uniq), dtype=bool)  # ids met only among the neighbours
    extra[inv[:nd]] = False
    local = np.empty(len(uniq), dtype=np.int64)
    local[inv[:nd]] = np.arange(nd)
    local[extra] = nd + np.arange(int(extra.sum()))
    src = np.concatenate([np.asarray(dst, dtype=np.int64), uniq[extra]])
    indptr = np.zeros(nd + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    return Block(torch.from_numpy(src), nd, torch.from_numpy(indptr), torch.from_numpy(local[inv[nd:]]))


def sample_blocks(hop: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]], seeds: np.ndarray,
                  fanouts: list[int]) -> list[Block]:
    """Blocks for ``seeds``, input layer first (``fanouts[i]`` is layer ``i``'s): from the seeds outwards,
    ``hop(dst, k) -> (counts, neighbours)`` samples each layer's in-neighbours (:func:`sample_csc` on one
    process, :meth:`DistSampler.hop` over partitions) and the next layer's destinations are its sources."""
    blocks = []
    dst = np.asarray(seeds, dtype=np.int64)
    for k in reversed(fanouts):
        counts, nbrs = hop(dst, k)
        b = make_block(dst, counts, nbrs)
        blocks.append(b)
        dst = b.src_ids.numpy()
    return blocks[::-1]


def full_block(indptr: np.ndarray, indices: np.ndarray) -> Block:
    """The whole graph as one block (full-graph training: every node is a source and a destination)."""
    n = len(indptr) - 1
    return Block(torch.arange(n), n, torch.from_numpy(indptr), torch.from_numpy(indices), full=True)


class DistSampler:
    """Neighbour sampling over the partitions of ``mesh``'s ``axes`` (one rank: plain local sampling).

    ``indptr``/``indices``: the in-edges of the nodes this rank owns (new ids ``offsets[r]..offsets[r+1]-1``),
    sources in new ids.  ``seed`` and the rank seed the generator, so a run samples the same blocks again."""

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, offsets: np.ndarray, mesh, axes: str = "dp",
                 seed: int = 0):
        self.indptr, self.indices = indptr, indices
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.mesh, self.axes = mesh, axes
        self.n = mesh.size(axes)
        self.me = mesh.local_rank(axes)
        if len(self.offsets) != self.n + 1:
            raise GraphError(f"{len(self.offsets) - 1} partitions but {self.n} ranks sample: partition into {self.n}")
        self.start = int(self.offsets[self.me])
        self.rng = np.random.default_rng([seed, self.me])
        self.remote_bytes = 0     # sampling request and reply bytes sent to other ranks since the last reset
        self.sampled_edges = 0

    def owner(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, ids, side="right") - 1

    def _a2a(self, send: np.ndarray, send_splits: list[int], recv_splits: list[int]) -> np.ndarray:
        dev = self.mesh.device
        out = torch.empty(sum(recv_splits), dtype=torch.int64, device=dev)
        comm.all_to_all(out, torch.from_numpy(np.ascontiguousarray(send, dtype=np.int64)).to(dev), self.mesh,
                        self.axes, recv_splits, send_splits)
        me = self.me
        self.remote_bytes += 8 * (sum(send_splits) - send_splits[me])
        return out.cpu().numpy()

    def hop(self, dst: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Sampled in-neighbours ``(counts, neighbours)`` of every node of ``dst`` (collective)."""
        if self.n == 1:
            counts, nbrs = sample_csc(self.indptr, self.indices, dst - self.start, k, self.rng)
            self.sampled_edges += len(nbrs)
            return counts, nbrs
        own = self.owner(dst)
        mine = np.flatnonzero(own == self.me)
        far = np.flatnonzero(own != self.me)
        far = far[np.argsort(own[far], kind="stable")]        # requests grouped by owner
        # local nodes: sampled here, from the partition's in-edges
        lc, ln = sample_csc(self.indptr, self.indices, dst[mine] - self.start, k, self.rng)
        # remote nodes: one batched request per owner; the owner samples and replies
        send_n = np.bincount(own[far], minlength=self.n)
        recv_n = self._a2a(send_n, [1] * self.n, [1] * self.n)
        got = self._a2a(dst[far], send_n.tolist(), recv_n.tolist())
        counts, nbrs = sample_csc(self.indptr, self.indices, got - self.start, k, self.rng)
        self.sampled_edges += len(nbrs) + len(ln)
        rc = self._a2a(counts, recv_n.tolist(), send_n.tolist())
        per_src = np.bincount(np.repeat(np.arange(self.n), recv_n), weights=counts, minlength=self.n)
        per_dst = np.bincount(np.repeat(np.arange(self.n), send_n), weights=rc, minlength=self.n)
        rn = self._a2a(nbrs, per_src.astype(np.int64).tolist(), per_dst.astype(np.int64).tolist())
        # merge both, in the order of dst
        c = np.zeros(len(dst), dtype=np.int64)
        c[mine], c[far] = lc, rc
        start = np.cumsum(c) - c
        out = np.empty(int(c.sum()), dtype=np.int64)
        out[_ranges(start[mine], lc)] = ln
        out[_ranges(start[far], rc)] = rn
        return c, out

    def sample(self, seeds: np.ndarray, fanouts: list[int]) -> list[Block]:
        """Blocks for ``seeds`` (new ids), input layer first: ``fanouts[i]`` is layer ``i``'s (collective)."""
        return sample_blocks(self.hop, seeds, fanouts)

    def reset_stats(self) -> None:
        self.remote_bytes = self.sampled_edges = 0
