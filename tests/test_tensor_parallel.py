"""Tensor (and sequence) parallelism matches one process with the same global batch, on Tiny Shakespeare.

One elastic launch per world size trains several layouts; each is compared step by step with a plain
single-process PyTorch loop: losses, gradient norms, every gradient after step 1 and every parameter after
the last step (tp shards reassembled).
"""
import pytest

import reference as single_process
from conftest import shakespeare
from podscale.runtime.launcher import launch
from reference import reference_run
import tp_workers
from tp_workers import layer_equivalence, make_config, train_layouts

STEPS = 20
GLOBAL_BATCH = 8
# fp32. tp changes the order of the sums inside the row-parallel matmuls and the cross-entropy, so only
# rounding differs (measured on this machine: losses within 1e-6, gradients within 3e-8, parameters within
# 1.5e-5 after 20 steps).  The bounds leave room for other BLAS builds.
LOSS_TOL = 2e-5
GRAD_TOL = 1e-5
PARAM_TOL = 1e-4
# tp_workers' model with 2 blocks (it has 4): each block is the same column- then row-parallel attention and
# MLP, so a second pair tests nothing new; the runs are bound by the latency of tp's per-layer collectives
# (4 a block and micro-batch), whose number follows the blocks
MODEL = dict(tp_workers.MODEL, n_layer=2)


def compare(label: str, ours: dict, ref: dict, results: dict, index: int, nproc: int) -> dict:
    return single_process.compare(label, ours, ref, results, index, nproc, LOSS_TOL, PARAM_TOL, GRAD_TOL)


@pytest.fixture(scope="module")
def reference():
    return reference_run(make_config(shakespeare(), STEPS, GLOBAL_BATCH, GLOBAL_BATCH, 1, model=MODEL))


def test_tp2_and_tp2_sequence_parallel(reference):
    path = shakespeare()
    layouts = [
        ("tp=2", make_config(path, STEPS, GLOBAL_BATCH, GLOBAL_BATCH, 2, model=MODEL, tp=2)),
        ("tp=2 sequence parallel, 2 micro-batches",
         make_config(path, STEPS, GLOBAL_BATCH, GLOBAL_BATCH // 2, 2, model=MODEL, tp=2, sequence_parallel=True)),
        ("tp=2 sequence parallel, full recomputation",
         make_config(path, STEPS, GLOBAL_BATCH, GLOBAL_BATCH, 2, model=MODEL, tp=2, sequence_parallel=True,
                     recompute="full")),
        ("tp=2 sequence parallel, ZeRO-1 strategy",
         dict(make_config(path, STEPS, GLOBAL_BATCH, GLOBAL_BATCH, 2, model=MODEL, tp=2, sequence_parallel=True),
              zero={"stage": 1, "reduce_bucket_mb": 0.05})),
        # each rank materialises only its shards, each equal to the slice of the single-process value
        ("tp=2 sequence parallel, model built on the meta device",
         dict(make_config(path, STEPS, GLOBAL_BATCH, GLOBAL_BATCH, 2, model=MODEL, tp=2, sequence_parallel=True),
              meta=True)),
    ]
    results = launch(train_layouts, ([d for _, d in layouts],), nproc=2)
    seen = {label: compare(label, results[0][i], reference, results, i, 2) for i, (label, _) in enumerate(layouts)}
    assert not any(results[r][-1]["meta_left"] for r in range(2))
    comm0 = results[0][0]["comm"]
    # g and f: 2 all-reduces forward and 2 backward per layer per micro-batch, plus embedding and loss
    assert comm0["tp/all_reduce"]["calls"] >= STEPS * 4 * MODEL["n_layer"]
    sp = results[0][1]["comm"]
    assert sp["tp/all_gather"]["calls"] > 0 and sp["tp/reduce_scatter"]["calls"] > 0
    print(seen)


def test_tp4_and_tp2_with_zero2_zero3(reference):
    path = shakespeare()
    layouts = [("tp=4", make_config(path, STEPS, GLOBAL_BATCH, GLOBAL_BATCH, 4, model=MODEL, tp=4))]
    for stage in (2, 3):  # tp=2 inside, ZeRO-2 / ZeRO-3 over dp=2 outside
        zero = {"stage": stage, "reduce_bucket_mb": 0.05, "param_persistence_threshold": 1000}
        layouts.append((f"tp=2 dp=2 ZeRO-{stage}",
                        dict(make_config(path, STEPS, GLOBAL_BATCH, GLOBAL_BATCH // 2, 4, model=MODEL, tp=2, dp=2),
                             zero=zero)))
    results = launch(train_layouts, ([d for _, d in layouts],), nproc=4)
    print({label: compare(label, results[0][i], reference, results, i, 4) for i, (label, _) in enumerate(layouts)})


def test_parallel_layers_match_full_layers():
    """Column- then row-parallel layers equal the full layers: outputs and every gradient, for f/g and the
    sequence-parallel g/ḡ, with and without the overlapped (fused) backward."""
    results = launch(layer_equivalence, (), nproc=2)
    for r in range(2):
        for label, diff in results[r].items():
            assert diff < 1e-6, f"rank {r} {label}: {diff}"
    print(results[0])


def test_sum_of_squares_is_the_fp64_sum_without_a_copy():
    """The gradient norm's sum of squares (tensor/pipeline strategies): the fp64 sum of squares of fp64,
    fp32 (contiguous, a linear layer's transposed weight gradient, lengths that are not a multiple of the
    row) and 16-bit gradients, to the precision of the gradient's own dtype."""
    import torch

    from podscale.parallel.tensor import NORM_ROW, sum_of_squares
    torch.manual_seed(0)
    cases = [(torch.randn(40, 30, dtype=torch.float64), 1e-14),
             (torch.randn(3 * NORM_ROW + 17) * 1e-3, 1e-6),
             (torch.randn(2 * NORM_ROW, 5).t(), 1e-6),          # transposed: read through its transpose
             (torch.randn(7, 11)[:, ::2], 1e-6),                 # non-contiguous, not a plain transpose
             (torch.randn(NORM_ROW - 1), 1e-6),
             (torch.randn(5, NORM_ROW + 3).half(), 1e-3)]
    for g, tol in cases:
        want = g.double().pow(2).sum()
        got = sum_of_squares(g)
        assert got.dtype == torch.float64
        assert abs(got - want) <= tol * want, (g.shape, g.dtype, float(got), float(want))
    assert float(sum_of_squares(torch.zeros(0))) == 0.0
