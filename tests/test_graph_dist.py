"""The distributed feature store and neighbour sampler on 2 gloo ranks over METIS partitions of a generated
graph (one launch): every row fetched by node id equals the graph's features, remote rows are counted and a
cache of remote rows serves the second fetch; the distributed sampler's neighbour choices follow the uniform
law of single-process sampling (chi-square tests at significance 0.001), blocks are consistent message-flow
graphs, and a rank without seeds samples beside one with seeds without hanging; node embeddings placed by the
partition book come back on their partitions' ranks from a table checkpoint."""
import numpy as np
import pytest
from scipy import stats

from graph_workers import store_and_sampler
from podscale.graph import sbm
from podscale.graph.partition import assign, load_book, write_partitions
from podscale.graph.sampler import sample_csc
from podscale.runtime.launcher import launch

ALPHA = 0.001
FANOUT, ROUNDS, CACHE = 4, 150, 64


def uniform_statistic(pairs, g, seeds, rounds, k):
    """Pearson statistic of neighbour-inclusion counts against uniform k-subsets, and its degrees of freedom.

    A uniform k-subset of d neighbours includes each with p = k/d and its indicator vector has covariance
    p(1-p) d/(d-1) (I - J/d), so over T rounds sum_u (n_u - Tp)^2 / (T p (1-p) d/(d-1)) ~ chi2(d - 1)."""
    key = pairs[1] * g.num_nodes + pairs[0]
    stat, df = 0.0, 0
    for v in seeds:
        nb = g.indices[g.indptr[v]:g.indptr[v + 1]]
        d = len(nb)
        n = np.searchsorted(np.sort(key), [nb * g.num_nodes + v], side="right")[0] - \
            np.searchsorted(np.sort(key), [nb * g.num_nodes + v], side="left")[0]
        p = k / d
        stat += float(((n - rounds * p) ** 2).sum() / (rounds * p * (1 - p) * d / (d - 1)))
        df += d - 1
    return stat, df


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    g = sbm(600, blocks=4, avg_degree=16, homophily=0.7, seed=5)
    part = assign(g, 2, "metis")
    path = tmp_path_factory.mktemp("parts") / "p"
    write_partitions(g, part, path)
    deg = g.in_degree()
    seeds = np.flatnonzero(deg > FANOUT)[:60]
    assert len(np.unique(part[seeds])) == 2  # seeds owned by both ranks
    res = launch(store_and_sampler, (str(path), seeds.tolist(), FANOUT, ROUNDS, CACHE), nproc=2)
    return g, part, seeds, res, load_book(path)


def test_feature_store_rows_and_cache(run):
    g, part, seeds, res, book = run
    for r in (0, 1):
        o = res[r]
        assert np.array_equal(o["rows"], g.features[book["orig_id"][o["ids"]]]) and o["same"]
        remote = g.num_nodes - o["inner"]
        assert o["rows1"] == remote and o["bytes1"] == remote * g.features.shape[1] * 4
        assert o["hits2"] == CACHE and o["bytes2"] == (remote - CACHE) * g.features.shape[1] * 4


def test_distributed_sampling_is_uniform_like_one_process(run):
    g, part, seeds, res, book = run
    dist_pairs = np.concatenate([res[0]["pairs"], res[1]["pairs"]], axis=1)
    t = 2 * ROUNDS
    stat, df = uniform_statistic(dist_pairs, g, seeds, t, FANOUT)
    assert stats.chi2.sf(stat, df) > ALPHA, (stat, df)
    # the single-process sampler, same seeds and rounds: the same law, and the two samples agree
    rng = np.random.default_rng(0)
    single = []
    for _ in range(t):
        c, nb = sample_csc(g.indptr, g.indices, seeds, FANOUT, rng)
        single.append(np.stack([np.repeat(seeds, c), nb]))
    single = np.concatenate(single, axis=1)
    s_stat, _ = uniform_statistic(single, g, seeds, t, FANOUT)
    assert stats.chi2.sf(s_stat, df) > ALPHA
    # two-sample: (n1 - n2) has twice the covariance of one sample around its mean
    key_d = np.sort(dist_pairs[1] * g.num_nodes + dist_pairs[0])
    key_s = np.sort(single[1] * g.num_nodes + single[0])
    two = 0.0
    for v in seeds:
        nb = g.indices[g.indptr[v]:g.indptr[v + 1]]
        d, p = len(nb), FANOUT / len(nb)
        q = nb * g.num_nodes + v
        n1 = np.searchsorted(key_d, q, side="right") - np.searchsorted(key_d, q, side="left")
        n2 = np.searchsorted(key_s, q, side="right") - np.searchsorted(key_s, q, side="left")
        two += float(((n1 - n2) ** 2).sum() / (2 * t * p * (1 - p) * d / (d - 1)))
    assert stats.chi2.sf(two, df) > ALPHA, (two, df)
    # the test can fail: always the first k neighbours is far from uniform
    first = np.concatenate([np.stack([np.full(FANOUT, v), g.indices[g.indptr[v]:g.indptr[v] + FANOUT]])
                            for v in seeds for _ in range(t)], axis=1)
    assert stats.chi2.sf(uniform_statistic(first, g, seeds, t, FANOUT)[0], df) < ALPHA
    assert res[0]["remote_sample_bytes"] > 0


def test_blocks_are_message_flow_graphs(run):
    g, part, seeds, res, book = run
    o = res[0]
    assert res[1]["block_shapes"][-1][1] == 0  # the rank without seeds took part in every hop
    src = o["block_src"]
    assert o["block_shapes"][-1][1] == 5
    for i, ((indptr, idx), ids) in enumerate(zip(o["block_edges"], src)):
        num_dst = len(indptr) - 1
        if i + 1 < len(src):
            assert np.array_equal(ids[:len(src[i + 1])], src[i + 1])  # a layer's sources feed the next's
        for j in range(num_dst):
            nb = ids[idx[indptr[j]:indptr[j + 1]]]
            true = set(g.indices[g.indptr[ids[j]]:g.indptr[ids[j] + 1]].tolist())
            assert set(nb.tolist()) <= true and len(set(nb.tolist())) == len(nb)
            assert len(nb) == min(len(true), (3, 2)[i])


def test_node_embeddings_resume_on_their_partitions(run):
    """A checkpoint's rows go back to the rank owning their node's partition (the table's key owner), not
    to the hash placement: every rank holds exactly its own nodes' rows, equal to the saved ones."""
    g, part, seeds, res, book = run
    for r in (0, 1):
        o = res[r]
        own = np.arange(o["emb_start"], o["emb_start"] + o["emb_inner"])
        assert np.array_equal(o["emb_keys_before"], own) and np.array_equal(o["emb_keys_after"], own)
        assert np.array_equal(o["emb_rows_after"], o["emb_rows_before"])
