"""Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B) alone and composed with tensor, sequence and ZeRO
data parallelism matches one process on Tiny Shakespeare; the schedules' measured activation memory and
bubble follow Narayanan et al. 2021.

Each world size is one elastic launch training several layouts, compared step by step with a plain
single-process PyTorch loop (losses, gradient norms, every gradient after step 1, every parameter after
the last step).
"""
import pytest
import torch

from conftest import shakespeare
from podscale.parallel.pipeline.schedule import schedule_actions, simulate
from podscale.runtime.launcher import launch
from test_tensor_parallel import compare, reference_run
from tp_workers import make_config, train_layouts

STEPS = 20
GLOBAL_BATCH = 8
# 8 blocks so that pp=4 with 2 virtual stages has one block per chunk (and pp=2 with 2 virtual stages two)
MODEL = {"n_layer": 8, "n_head": 4, "n_embd": 32, "block_size": 32}
# the same model with 4 blocks for the layouts that need no more (pp=2: 2 blocks a stage; pp=2 interleaved
# with 2 virtual stages under tp: one block a chunk): these runs are bound by the latency of their small
# collectives and point-to-point messages (4 ranks on 2 cores), whose number follows the blocks
MODEL4 = dict(MODEL, n_layer=4)
ZERO1 = {"stage": 1, "reduce_bucket_mb": 0.05}
BF16_LOSS_TOL = 2e-2


def _cfg(nproc, micro, model=MODEL, **parallel):
    d = make_config(shakespeare(), STEPS, GLOBAL_BATCH, micro, nproc, model=model, **parallel)
    zero = parallel.pop("zero", None)
    if zero:
        d["parallel"].pop("zero")
        d["zero"] = zero
    return d


@pytest.fixture(scope="module")
def reference():
    """The single-process run of a layout's config: the same model (8 or 4 blocks), steps and data."""
    return lambda d: reference_run(make_config(shakespeare(), d["run"]["steps"], GLOBAL_BATCH, GLOBAL_BATCH, 1,
                                               model=d["model"]))


def _check_all(layouts, results, reference, nproc):
    """``reference``: the single-process run, or a function of a layout's config returning it."""
    seen = {}
    for i, (label, d) in enumerate(layouts):
        ref = reference(d) if callable(reference) else reference
        seen[label] = compare(label, results[0][i], ref, results, i, nproc)
        # the last stage's copy of the tied embedding took exactly the first stage's steps
        params = results[0][i]["params"]
        assert torch.equal(params["lm_head.weight"], params["wte.weight"]), label
    print(seen)
    return seen


def test_pp2_each_schedule(reference):
    # 4 micro-batches of 2 sequences per step
    # 4 blocks (2 a stage), but 8 for the interleaved schedule: 4 chunks of 2 blocks
    layouts = [(f"pp=2 {s} v={v}", _cfg(2, 2, MODEL if s == "interleaved" else MODEL4, pp=2, schedule=s,
                                        virtual_stages=v))
               for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))]
    layouts += [(f"pp=2 1f1b recompute={r}", _cfg(2, 2, MODEL4, pp=2, recompute=r)) for r in ("selective", "full")]
    layouts.append(("pp=2 gpipe, stages balanced by measured time",
                    _cfg(2, 2, MODEL4, pp=2, pipeline_balance="time", schedule="gpipe")))
    # built on the meta device: each stage materialises only its own layers, to the single-process values
    layouts.append(("pp=2 1f1b, model built on the meta device", {**_cfg(2, 2, MODEL4, pp=2), "meta": True}))
    results = launch(train_layouts, ([d for _, d in layouts],), nproc=2)
    _check_all(layouts, results, reference, 2)
    assert not any(results[r][-1]["meta_left"] for r in range(2))
    for i in range(3):
        assert results[0][i]["comm"]["pp/send"]["calls"] > 0
    # recomputation: fewer bytes saved for backward (measured by the executor), on every stage
    saved = {i: [results[r][i]["pipeline"]["peak_activation_bytes"] for r in range(2)] for i in (1, 3, 4)}
    print("saved activation bytes 1f1b / selective / full:", saved)
    for r in range(2):
        assert saved[4][r] < saved[3][r] <= saved[1][r]
    # interleaved: 4 chunks of 2 blocks, rank 0 holds chunks 0 and 2
    assert [c["layers"] for c in results[0][2]["pipeline"]["chunks"]] == [[0, 1], [4, 5]]


def test_pp4_each_schedule_memory_and_212_interleaved(reference):
    # pp=4 with 8 micro-batches of 1 (m = 2p), then (pp, dp, tp) = (2, 1, 2), interleaved, sequence parallel
    layouts = [(f"pp=4 {s} v={v}", _cfg(4, 1, pp=4, schedule=s, virtual_stages=v))
               for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))]
    # (the 8 blocks are for pp=4 interleaved; the layouts with pp=2 below train the 4-block model)
    layouts.append(("(pp,dp,tp)=(2,1,2) interleaved v=2 sp",
                    _cfg(4, 2, MODEL4, pp=2, tp=2, schedule="interleaved", virtual_stages=2, sequence_parallel=True)))
    # bf16: autocast (tp, sp, pp) and ZeRO-1's 16-bit compute copies (pp, dp); loss curves only
    bf16 = [("bf16 (2,1,2) sp", _cfg(4, 2, MODEL4, pp=2, tp=2, sequence_parallel=True)),
            ("bf16 (2,2,1) ZeRO-1", _cfg(4, 2, MODEL4, pp=2, dp=2, zero=ZERO1))]
    for _, d in bf16:
        d["train"]["precision"] = "bf16"
    results = launch(train_layouts, ([d for _, d in layouts + bf16],), nproc=4)
    _check_all(layouts, results, reference, 4)
    for i, (label, d) in enumerate(bf16, start=len(layouts)):
        got = results[0][i]["losses"]
        worst = max(abs(a - b) for a, b in zip(got, reference(d)["losses"]))
        # bf16 rounds to 8 mantissa bits (measured: within 2e-3 of the fp32 curve over 20 steps)
        assert worst < BF16_LOSS_TOL, f"{label}: losses differ from fp32 by {worst}"
    # Activation memory measured by the executor (bytes saved for backward, parameters excluded):
    # GPipe holds all m micro-batches on every stage, 1F1B at most p - i on stage i (so at most p).
    p, m = 4, 8
    gpipe = [results[r][0]["pipeline"] for r in range(p)]
    ofob = [results[r][1]["pipeline"] for r in range(p)]
    for r in range(p):
        assert gpipe[r]["peak_in_flight"] == m
        assert ofob[r]["peak_in_flight"] == p - r
        per_mb = gpipe[r]["peak_activation_bytes"] / m
        assert per_mb > 0
        assert ofob[r]["peak_activation_bytes"] == pytest.approx((p - r) * per_mb, rel=1e-6)
    print({"gpipe_bytes": [g["peak_activation_bytes"] for g in gpipe],
           "1f1b_bytes": [o["peak_activation_bytes"] for o in ofob]})


def test_schedules_simulated():
    """On an ideal machine (F = 1, B = 2) the schedules' bubble is exactly the paper's formula and 1F1B
    keeps at most p - i micro-batches in flight on stage i."""
    for p, m, v in ((2, 4, 1), (4, 8, 1), (4, 16, 1), (2, 4, 2), (4, 8, 2), (4, 16, 4)):
        for s in (("gpipe", "1f1b") if v == 1 else ("interleaved",)):
            r = simulate(schedule_actions(s, p, m, v), v)
            assert r["bubble"] == pytest.approx((p - 1) / (v * m)), (s, p, m, v)
            if s == "gpipe":
                assert r["peak_in_flight"] == [m] * p
            if s == "1f1b":
                assert r["peak_in_flight"] == [p - i for i in range(p)]
