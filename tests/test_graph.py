"""Graph formats, loaders and generators (podscale/graph): CSC/CSR from edge lists, one-line errors for edges
outside the node range and for features of the wrong shape, the Planetoid and OGB-style loaders, R-MAT and
the stochastic block model."""
from pathlib import Path

import numpy as np
import pytest

from podscale.graph import GraphError, from_edges, load_ogb_dir, load_planetoid, rmat, sbm

DATA = Path(__file__).resolve().parent / "data"


def test_csc_and_csr_hold_every_edge_once():
    rng = np.random.default_rng(0)
    src, dst = rng.integers(0, 50, 400), rng.integers(0, 50, 400)
    g = from_edges(src, dst, 50)
    s, d = g.edges()
    assert sorted(zip(s.tolist(), d.tolist())) == sorted(zip(src.tolist(), dst.tolist()))
    indptr, out = g.csr()
    for u in range(50):
        assert sorted(out[indptr[u]:indptr[u + 1]].tolist()) == sorted(dst[src == u].tolist())
    u = from_edges(src, dst, 50, symmetric=True, dedupe=True, drop_self_loops=True)
    pairs = set(zip(*[a.tolist() for a in u.edges()]))
    assert all((b, a) in pairs and a != b for a, b in pairs) and len(pairs) == u.num_edges


def test_bad_edges_and_features_are_one_line():
    with pytest.raises(GraphError, match=r"names node 7, outside the node range \[0, 5\)") as e:
        from_edges([0, 1], [2, 7], 5)
    assert "\n" not in str(e.value)
    with pytest.raises(GraphError, match="node -1"):
        from_edges([-1], [2], 5)
    with pytest.raises(GraphError, match=r"features have shape \(4, 3\) but the graph has 5 nodes"):
        from_edges([0], [1], 5, features=np.zeros((4, 3)))
    with pytest.raises(GraphError, match="split 'train' names node 9"):
        from_edges([0], [1], 5, labels=np.zeros(5), splits={"train": [9]})


def test_planetoid_cora_and_citeseer():
    for name, n, e, f, c, tr in (("cora", 2708, 10556, 1433, 7, 140), ("citeseer", 3327, 9104, 3703, 6, 120)):
        g = load_planetoid(DATA / f"{name}.npz")
        assert (g.num_nodes, g.num_edges, g.features.shape[1], g.num_classes) == (n, e, f, c)
        assert len(g.splits["train"]) == tr and len(g.splits["test"]) == 1000
        rows = g.features.sum(axis=1)
        assert np.allclose(rows[rows > 0], 1.0)  # row-normalised


def test_ogb_directory(tmp_path):
    raw = tmp_path / "ogbn-toy" / "raw"
    raw.mkdir(parents=True)
    np.savetxt(raw / "edge.csv.gz", np.array([[0, 1], [1, 2], [3, 0]]), fmt="%d", delimiter=",")
    np.save(raw / "node-feat.npy", np.arange(8, dtype=np.float32).reshape(4, 2))
    np.savetxt(raw / "node-label.csv", np.array([0, 1, 1, 0]), fmt="%d")
    split = tmp_path / "ogbn-toy" / "split" / "random"
    split.mkdir(parents=True)
    for name, ids in (("train", [0, 1]), ("valid", [2]), ("test", [3])):
        np.savetxt(split / f"{name}.csv", np.array(ids), fmt="%d")
    g = load_ogb_dir(tmp_path / "ogbn-toy", symmetric=True)
    assert g.num_nodes == 4 and g.num_edges == 6 and g.features.shape == (4, 2)
    assert g.splits["train"].tolist() == [0, 1] and g.splits["val"].tolist() == [2] and g.labels.tolist() == [0, 1, 1, 0]
    with pytest.raises(GraphError, match="holds no edge.npy"):
        load_ogb_dir(tmp_path)


def test_rmat_is_skewed_and_sbm_follows_its_blocks():
    g = rmat(12, edge_factor=8, seed=1)
    deg = g.in_degree()
    assert g.num_nodes == 4096 and g.num_edges > 30000
    assert deg.max() > 20 * deg.mean()  # power law: hubs far above the mean
    s = sbm(1000, blocks=4, avg_degree=10, homophily=0.9, seed=2)
    src, dst = s.edges()
    inside = (s.labels[src] == s.labels[dst]).mean()
    assert 0.85 < inside < 0.95
    # features follow the blocks: each node is nearest to its own block's mean more often than not
    means = np.stack([s.features[s.labels == k].mean(0) for k in range(4)])
    near = ((s.features[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    assert (near == s.labels).mean() > 0.6
    assert sbm(1000, blocks=4, seed=2).num_edges == sbm(1000, blocks=4, seed=2).num_edges
