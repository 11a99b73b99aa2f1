"""Partitions (podscale/graph/partition.py and `podscale graph partition`): on Cora and a generated SBM, every
edge is held exactly once, by its destination's owner, so every training node's L-hop neighbourhood is reachable
through the partitions and the partition book; halos are exactly the in-neighbours owned elsewhere; METIS keeps
nodes, training nodes and edges within the requested imbalance and cuts far fewer edges than random; the folder
is written once, atomically, and checked against the world size and the graph."""
from pathlib import Path

import numpy as np
import pytest

from podscale.cli import main
from podscale.graph import GraphError, load_planetoid, sbm
from podscale.graph.partition import (assign, balance, check_matches, constraint_weights, load_book,
                                      load_partition, read_meta, write_partitions)

DATA = Path(__file__).resolve().parent / "data"
IMBALANCE = 0.05


def _graphs():
    return [(load_planetoid(DATA / "cora.npz"), 2), (sbm(3000, blocks=6, seed=3), 2), (sbm(3000, blocks=6, seed=3), 4)]


def _neighbourhood(seeds, indptr, indices, hops):
    seen, frontier = set(seeds.tolist()), np.asarray(seeds)
    for _ in range(hops):
        nxt = np.concatenate([indices[indptr[v]:indptr[v + 1]] for v in frontier]) if len(frontier) else frontier
        frontier = np.setdiff1d(nxt, np.fromiter(seen, dtype=np.int64))
        seen.update(frontier.tolist())
    return seen


@pytest.mark.parametrize("case", range(3))
def test_partition_invariants(tmp_path, case):
    g, k = _graphs()[case]
    part = assign(g, k, "metis", IMBALANCE)
    assert (balance(part, constraint_weights(g), k) <= 1 + IMBALANCE).all()
    meta = write_partitions(g, part, tmp_path / "p", "metis")
    assert meta["report"]["edge_cut"] < 0.5 * (1 - 1 / k)  # random cuts 1 - 1/k of the edges
    book = load_book(tmp_path / "p")
    parts = [load_partition(tmp_path / "p", r) for r in range(k)]
    offsets = parts[0].offsets
    assert offsets[-1] == g.num_nodes and (np.diff(offsets) == np.bincount(part, minlength=k)).all()
    assert (book["orig_id"][book["new_id"]] == np.arange(g.num_nodes)).all()
    edges, train = [], []
    for p in parts:
        own = np.arange(p.start, p.start + p.num_inner)
        assert (book["part"][book["orig_id"][own]] == p.rank).all() and (p.orig_id == book["orig_id"][own]).all()
        dst = np.repeat(own, np.diff(p.indptr))
        edges.append(np.stack([p.indices, dst]))
        outside = (p.owner(p.indices) != p.rank)
        assert (p.halo == np.unique(p.indices[outside])).all()          # halos exact
        assert (p.features == g.features[p.orig_id]).all() and (p.labels == g.labels[p.orig_id]).all()
        train.append(p.orig_id[p.splits["train"]])
    # every edge once, in new ids; mapped back it is the original edge set
    e = np.concatenate(edges, axis=1)
    src, dst = g.edges()
    assert sorted(zip(book["orig_id"][e[0]].tolist(), book["orig_id"][e[1]].tolist())) == \
        sorted(zip(src.tolist(), dst.tolist()))
    assert sorted(np.concatenate(train).tolist()) == sorted(g.splits["train"].tolist())
    # the 2-hop neighbourhood of every training node, walked through the partitions (each node's in-edges
    # read from its owner's file), is the one of the original graph
    rows = {}
    for p in parts:
        for i in range(p.num_inner):
            rows[p.start + i] = p.indices[p.indptr[i]:p.indptr[i + 1]]
    flat_ptr = np.zeros(g.num_nodes + 1, dtype=np.int64)
    np.cumsum([len(rows[v]) for v in range(g.num_nodes)], out=flat_ptr[1:])
    flat = np.concatenate([rows[v] for v in range(g.num_nodes)])
    seeds = g.splits["train"][:50]
    via_parts = _neighbourhood(book["new_id"][seeds], flat_ptr, flat, 2)
    direct = _neighbourhood(seeds, g.indptr, g.indices, 2)
    assert {int(book["orig_id"][v]) for v in via_parts} == direct


def test_random_cuts_more_and_folder_is_checked(tmp_path, capsys):
    g = load_planetoid(DATA / "cora.npz")
    rnd = assign(g, 2, "random", seed=1)
    assert abs(np.bincount(rnd).max() - g.num_nodes / 2) <= 1
    assert main(["graph", "partition", "planetoid", str(tmp_path / "m"), "--path", str(DATA / "cora.npz")]) == 0
    assert main(["graph", "partition", "planetoid", str(tmp_path / "r"), "--path", str(DATA / "cora.npz"),
                 "--method", "random"]) == 0
    out = capsys.readouterr().out
    assert "edge cut" in out and "halo" in out and "balance" in out
    m, r = read_meta(tmp_path / "m"), read_meta(tmp_path / "r")
    assert m["report"]["edge_cut"] < r["report"]["edge_cut"] / 4
    assert r["report"]["halo_share"] > 2 * m["report"]["halo_share"]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary folder left
    # written once
    assert main(["graph", "partition", "planetoid", str(tmp_path / "m"), "--path", str(DATA / "cora.npz")]) == 2
    assert "already exists" in capsys.readouterr().err
    with pytest.raises(GraphError, match="holds 2 partitions but there are 4 ranks"):
        check_matches(m, tmp_path / "m", 4, g)
    with pytest.raises(GraphError, match="partitions a graph of 2708 nodes"):
        check_matches(m, tmp_path / "m", 2, sbm(500))
    with pytest.raises(GraphError, match="not a partition folder"):
        read_meta(tmp_path)


def test_random_parts_are_not_the_generators_communities():
    """The random partition draws from a stream of its own: with the same seed it once drew the very shuffle
    the sbm generator places its planted blocks with, so "random" parts were the communities and cut as few
    edges as METIS (found on a 1M-node sbm).  Random parts cut about 1 - 1/k of the edges, on any graph."""
    g = sbm(4000, features=4, seed=0)
    src, dst = g.edges()
    for k in (2, 4):
        part = assign(g, k, "random", seed=0)
        assert abs((part[src] != part[dst]).mean() - (1 - 1 / k)) < 0.03


@pytest.mark.parametrize("name", ["citeseer", "rmat13"])
def test_metis_balances_edges_on_skewed_graphs(name):
    """CiteSeer (438 components, many isolated nodes) and R-MAT scale 13 (Graph500's skew: the largest
    in-degree 2196, 88x the mean, and a fifth of the nodes without in-edges), where METIS's own
    multi-constraint partition leaves the edges 1.3-1.5x (CiteSeer)
    and 1.4-2.6x (R-MAT) out of balance: after the swaps every constraint -- nodes, training nodes, edges --
    is within the requested 5 % at 2 and 4 partitions, and the partition still cuts fewer edges than random
    (balancing hubs costs cut edges; the bound is that METIS stays better than random)."""
    from podscale.graph.generate import rmat
    g = load_planetoid(DATA / "citeseer.npz") if name == "citeseer" else rmat(13, features=4, seed=0)
    w = constraint_weights(g)
    src, dst = g.edges()
    for k in (2, 4):
        part = assign(g, k, "metis", IMBALANCE)
        b = balance(part, w, k)
        cut = (part[src] != part[dst]).mean()
        print(f"{name} k={k}: balance (nodes, train, edges) {np.round(b, 3)}, edge cut {cut:.3f}")
        assert (b <= 1 + IMBALANCE + 1e-9).all(), b
        rnd = assign(g, k, "random")
        assert (part[src] != part[dst]).mean() < (rnd[src] != rnd[dst]).mean()
