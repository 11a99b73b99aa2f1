"""Graphs that need no file: R-MAT power-law graphs and stochastic block models with planted communities.

* :func:`rmat` follows Graph500's Kronecker generator (Chakrabarti, Zhan and Faloutsos, "R-MAT: A Recursive
  Model for Graph Mining", SDM 2004; Graph500 specification: a, b, c = 0.57, 0.19, 0.19, edge factor 16):
  each edge picks one quadrant of the adjacency matrix per bit of the node id.  Node ids are then permuted
  (as Graph500 does) so that high degree is not tied to low ids.  Features and labels are random, so it is a
  workload for timing, not for accuracy.
* :func:`sbm` is a stochastic block model (Holland, Laskey and Leinhardt 1983) with planted communities:
  every node belongs to one of ``blocks`` communities, an edge stays inside its community with probability
  ``homophily``, node features are the community's centroid plus Gaussian noise and the label is the
  community.  A GNN that aggregates neighbours learns it well above what the features alone give: the
  embedded default of the GNN task.

Both are pure functions of their arguments (seeded ``numpy.random.default_rng``).
"""
from __future__ import annotations

import numpy as np

from podscale.graph.core import Graph, GraphError, from_edges

GRAPH500 = (0.57, 0.19, 0.19)


def random_splits(n: int, rng: np.random.Generator, train: float, val: float) -> dict[str, np.ndarray]:
    """A random split of ``n`` nodes: ``train`` and ``val`` shares, the rest test (sorted ids)."""
    perm = rng.permutation(n)
    a, b = int(round(train * n)), int(round((train + val) * n))
    return {"train": np.sort(perm[:a]), "val": np.sort(perm[a:b]), "test": np.sort(perm[b:])}


def rmat(scale: int, edge_factor: int = 16, abc: tuple[float, float, float] = GRAPH500, features: int = 32,
         classes: int = 8, seed: int = 0, train: float = 0.1, val: float = 0.05) -> Graph:
    """An undirected R-MAT graph of ``2**scale`` nodes and about ``2 * edge_factor * 2**scale`` directed edges
    (both directions, self loops and duplicates removed)."""
    a, b, c = abc
    if scale < 1 or edge_factor < 1:
        raise GraphError(f"rmat: scale={scale} and edge_factor={edge_factor} must be positive")
    if min(a, b, c) < 0 or a + b + c >= 1:
        raise GraphError(f"rmat: a, b, c = {abc} must be non-negative with a + b + c < 1 (d = 1 - a - b - c)")
    rng = np.random.default_rng(seed)
    n, m = 1 << scale, edge_factor << scale
    src = np.zeros(m, dtype=np.int64)
    dst = np.zeros(m, dtype=np.int64)
    for bit in range(scale):
        r = rng.random(m)
        down = r >= a + b                      # quadrants c and d: the source's bit is 1
        right = ((r >= a) & (r < a + b)) | (r >= a + b + c)  # quadrants b and d: the destination's bit is 1
        src |= down.astype(np.int64) << bit
        dst |= right.astype(np.int64) << bit
    perm = rng.permutation(n)
    src, dst = perm[src], perm[dst]
    x = rng.standard_normal((n, features), dtype=np.float32)
    y = rng.integers(0, classes, n)
    return from_edges(src, dst, n, features=x, labels=y, splits=random_splits(n, rng, train, val),
                      name=f"rmat{scale}", symmetric=True, dedupe=True, drop_self_loops=True)


def sbm(nodes: int = 2000, blocks: int = 8, avg_degree: float = 10.0, homophily: float = 0.8, features: int = 32,
        noise: float = 2.0, seed: int = 0, train: float = 0.1, val: float = 0.2) -> Graph:
    """A stochastic block model: ``nodes`` nodes in ``blocks`` equal communities, about ``avg_degree``
    neighbours each (undirected), a share ``homophily`` of edges inside a community; features
    ``centroid[block] + noise * N(0, I)`` and label = block."""
    if nodes < blocks or blocks < 2:
        raise GraphError(f"sbm: nodes={nodes} and blocks={blocks}: need 2 <= blocks <= nodes")
    if not 0.0 <= homophily <= 1.0 or avg_degree <= 0:
        raise GraphError(f"sbm: homophily={homophily} must be in [0, 1] and avg_degree={avg_degree} positive")
    rng = np.random.default_rng(seed)
    block = rng.permutation(np.arange(nodes) % blocks)
    members = [np.flatnonzero(block == k) for k in range(blocks)]
    m = int(round(nodes * avg_degree / 2))
    src = rng.integers(0, nodes, m)
    inside = rng.random(m) < homophily
    dst = rng.integers(0, nodes, m)
    for k in range(blocks):  # an inside edge draws its other end from the source's community
        sel = np.flatnonzero(inside & (block[src] == k))
        dst[sel] = members[k][rng.integers(0, len(members[k]), len(sel))]
    centroids = rng.standard_normal((blocks, features)).astype(np.float32)
    x = centroids[block] + noise * rng.standard_normal((nodes, features), dtype=np.float32)
    return from_edges(src, dst, nodes, features=x, labels=block, splits=random_splits(nodes, rng, train, val),
                      name="sbm", symmetric=True, dedupe=True, drop_self_loops=True)
