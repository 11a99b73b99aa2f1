"""The Criteo-like generator and DLRM over sharded tables (one process; the sharding itself is tested in
test_table.py)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from podscale.models.dlrm import DLRM, DLRMDense, dot_interaction
from podscale.runtime.mesh import Mesh
from podscale.table import RowWiseAdagrad, ShardedEmbeddingBags, TableSpec
from podscale.table.data import CriteoLike, make_batch, slice_batch, zipf_ranks


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve by the rank-sum (Mann-Whitney) statistic."""
    order = torch.argsort(scores)
    ranks = torch.empty(len(scores))
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float32)
    pos = labels > 0.5
    n1, n0 = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def test_generator_is_deterministic_zipf_and_sliceable():
    cfg = CriteoLike(cardinalities=(10 ** 9, 1000, 7), min_ids=1, max_ids=3, seed=5)
    d1, s1, y1 = make_batch(cfg, 3, 512)
    d2, s2, y2 = make_batch(cfg, 3, 512)
    assert torch.equal(d1, d2) and torch.equal(y1, y2)
    assert all(torch.equal(s1[k][0], s2[k][0]) for k in s1)
    assert d1.shape == (512, 13) and set(s1) == {"C1", "C2", "C3"}
    assert 0.1 < y1.mean().item() < 0.45  # about Criteo's click rate
    assert (s1["C1"][0] >= 0).all()
    assert len(torch.unique(s1["C3"][0])) <= 7
    # Zipf(1.05) over 1000 ranks: rank 0 is the most frequent, ~1/H_1000^1.05 of draws
    r = zipf_ranks(np.random.default_rng(0), 200_000, 1000, 1.05)
    freq = np.bincount(r, minlength=1000) / len(r)
    assert freq[0] == freq.max() and 0.1 < freq[0] < 0.2 and freq[0] > 5 * freq[9]
    # two halves of a batch are the batch
    _, a, ya = slice_batch(d1, s1, y1, 0, 200)
    _, b, yb = slice_batch(d1, s1, y1, 200, 512)
    assert torch.equal(torch.cat([a["C2"][0], b["C2"][0]]), s1["C2"][0])
    assert torch.equal(torch.cat([ya, yb]), y1)


def test_dot_interaction_is_the_lower_triangle():
    x = [torch.randn(2, 4) for _ in range(3)]
    z = dot_interaction(x)
    assert z.shape == (2, 3)
    assert torch.allclose(z[:, 0], (x[1] * x[0]).sum(1)) and torch.allclose(z[:, 2], (x[2] * x[1]).sum(1))


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: intra-op threads only contend on a shared machine
    yield
    torch.set_num_threads(n)


def test_dlrm_learns_the_teacher(one_thread):
    cfg = CriteoLike(cardinalities=(2000, 500, 50, 5000), seed=1, min_ids=1, max_ids=2, teacher_scale=3.0)
    mesh = Mesh.build()
    torch.manual_seed(0)
    tables = ShardedEmbeddingBags([TableSpec(n, 8, "mean") for n in cfg.names], mesh, RowWiseAdagrad(0.1))
    model = DLRM(tables, DLRMDense(cfg.num_dense, cfg.num_sparse, 8), list(cfg.names))
    opt = torch.optim.Adagrad(model.dense.parameters(), lr=0.05)
    for step in range(120):
        dense, sparse, y = make_batch(cfg, step, 256)
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        dense, sparse, y = make_batch(cfg, 10_000, 4096)  # unseen samples
        score = model(dense, sparse)
    assert auc(score, y) > 0.7, auc(score, y)
