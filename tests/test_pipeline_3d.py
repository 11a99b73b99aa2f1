"""3-D parallelism with ZeRO on dp matches one process on Tiny Shakespeare: (pp, dp) with ZeRO-2 and
ZeRO-3 under each schedule, (tp, dp) with sequence parallelism and ZeRO-2/3, and (pp, dp, tp) = (2, 2, 2)
with ZeRO-1 and ZeRO-3 on 8 ranks (the other 3-D layout, (2, 1, 2) interleaved, is in
test_pipeline_parallel.py); NVMe offload under tp/sp and pp; fp16 overflow skipped in step on every rank.

The layouts train 10 steps (test_pipeline_parallel.py's pipelines alone train 20) with the same tolerances:
every ZeRO stage, schedule and offload path here runs all of its code (gathers, reduce-scatters, swaps,
optimizer shards, clipping) at every step, so a wrong sum, shard or schedule shows from step 1 on; 10 steps
cover the warm-up (5 steps) and the cosine decay, and the loss falls by more than 0.5 by step 10 (5.53 to
4.93 with this module's 4 blocks), which ``compare`` asserts.  Each part alone still trains 20 steps against
the same reference (pipelines in test_pipeline_parallel.py, ZeRO stages and offload in test_zero.py and
test_zero_offload.py, tp/sp in test_tensor_parallel.py), where slow drift would show.  Halving the steps halves the module's time,
the longest of the suite; halving the blocks (8 to 4, see MODEL_3D) nearly halves it again.
"""
import pytest

import test_pipeline_parallel
from conftest import shakespeare
from podscale.runtime.launcher import launch
from test_pipeline_parallel import BF16_LOSS_TOL, GLOBAL_BATCH, MODEL, ZERO1, _check_all
from reference import reference_run
from tp_workers import make_config, train_layouts

STEPS = 10
# 4 blocks (test_pipeline_parallel.py's model has 8 so that pp=4 with 2 virtual stages has one block per
# chunk): pp=2 with 2 virtual stages still has one block per chunk, and every layout here is bound by the
# latency of its small collectives (ZeRO's per-block gathers and reduce-scatters, tp's per-layer all-reduces,
# 4 ranks on 2 cores), whose number follows the blocks: half the blocks, about half the time
MODEL_3D = dict(MODEL, n_layer=4)


def _cfg(nproc, micro, **parallel):
    d = test_pipeline_parallel._cfg(nproc, micro, **parallel)
    d["run"]["steps"] = STEPS
    d["model"] = dict(MODEL_3D)
    return d


def _zero(stage: int, **extra) -> dict:
    # threshold 1000: the blocks' matrices (>= 1024 elements) are gathered and freed, the embeddings form
    # the root unit, layer norms and biases stay whole
    return {"stage": stage, "reduce_bucket_mb": 0.01, "param_persistence_threshold": 1000, **extra}


@pytest.fixture(scope="module")
def reference():
    return reference_run(make_config(shakespeare(), STEPS, GLOBAL_BATCH, GLOBAL_BATCH, 1, model=MODEL_3D))


def test_pp_dp_zero23_and_tp_sp_zero23(reference, tmp_path):
    # (pp, dp) = (2, 2), 4 micro-batches of 1 per step: the gradients accumulate over the micro-batches and
    # each chunk's last backward reduce-scatters them; the tied embedding is summed over its two stages first
    layouts = [(f"(2,2,1) {s} v={v} ZeRO-{z}", _cfg(4, 1, pp=2, dp=2, schedule=s, virtual_stages=v, zero=_zero(z)))
               for s, v in (("1f1b", 1), ("interleaved", 2)) for z in (2, 3)]
    layouts.append(("(2,2,1) gpipe ZeRO-3, blocks stay gathered for the step",
                    _cfg(4, 1, pp=2, dp=2, schedule="gpipe", zero=_zero(3, reshard_after_forward=False))))
    # recomputation inside the re-gathered blocks, and the offloaded optimizer / parameters
    layouts.append(("(2,2,1) 1f1b ZeRO-2 full recompute, optimizer on CPU",
                    _cfg(4, 1, pp=2, dp=2, recompute="full", zero=_zero(2, offload_optimizer="cpu"))))
    layouts.append(("(2,2,1) 1f1b ZeRO-3 full recompute, parameters on CPU",
                    _cfg(4, 1, pp=2, dp=2, recompute="full", zero=_zero(3, offload_param="cpu"))))
    # (tp, dp) = (2, 2) with sequence parallelism, 2 micro-batches: the layer norms' partial gradients are
    # summed over tp before each reduce-scatter, inside backward
    layouts += [(f"(1,2,2) sp ZeRO-{z}", _cfg(4, 2, tp=2, dp=2, sequence_parallel=True, zero=_zero(z)))
                for z in (1, 2, 3)]
    layouts.append(("(1,2,2) sp ZeRO-3, blocks stay gathered until reduced",
                    _cfg(4, 2, tp=2, dp=2, sequence_parallel=True, zero=_zero(3, reshard_after_forward=False))))
    # ZeRO-Infinity under tensor + sequence parallelism: the clipping norm from per-parameter norms of the
    # shards on disk (read back after the second micro-batch accumulates), tp-split ones summed over tp
    nvme = {"offload_optimizer": "nvme", "nvme_path": str(tmp_path), "nvme_block_mb": 0.05}
    layouts.append(("(1,2,2) sp ZeRO-2, optimizer on NVMe", _cfg(4, 2, tp=2, dp=2, sequence_parallel=True,
                                                                 zero=_zero(2, **nvme))))
    layouts.append(("(1,2,2) ZeRO-3, optimizer and parameters on NVMe",
                    _cfg(4, 2, tp=2, dp=2, zero=_zero(3, offload_param="nvme", **nvme))))
    # ... and under pipelines: each stage's once-per-step reduce-scatter goes to its swap file
    layouts.append(("(2,2,1) 1f1b ZeRO-3, optimizer and parameters on NVMe",
                    _cfg(4, 1, pp=2, dp=2, zero=_zero(3, offload_param="nvme", **nvme))))
    layouts.append(("(2,2,1) interleaved v=2 ZeRO-2, optimizer on NVMe",
                    _cfg(4, 1, pp=2, dp=2, schedule="interleaved", virtual_stages=2, zero=_zero(2, **nvme))))
    # bf16: ZeRO-3's 16-bit compute copies travel through the pipeline (loss curve only)
    bf16 = _cfg(4, 1, pp=2, dp=2, schedule="interleaved", virtual_stages=2, zero=_zero(3))
    bf16["train"]["precision"] = "bf16"
    results = launch(train_layouts, ([d for _, d in layouts] + [bf16],), nproc=4)
    _check_all(layouts, results, reference, 4)
    worst = max(abs(a - b) for a, b in zip(results[0][len(layouts)]["losses"], reference["losses"]))
    assert worst < BF16_LOSS_TOL, f"bf16 (2,2,1) interleaved ZeRO-3: losses differ from fp32 by {worst}"
    # with the pipeline each unit is reduce-scattered once per step, whatever the number of micro-batches
    # (4 here); without it ZeRO-2/3 reduce-scatter every micro-batch (2 here), ZeRO-1 the last one
    for i, (label, _) in enumerate(layouts):
        once = label.startswith("(2,2,1)") or "ZeRO-1" in label
        for r in range(4):
            units, blocks = results[r][i]["zero_units"]
            calls = results[r][i]["comm"]["dp/reduce_scatter"]["calls"]
            assert calls == STEPS * units * (1 if once else 2), (label, r, calls, units)
    # ZeRO-3 gathers each block before its forward and its backward of every micro-batch (2 m per step),
    # or, with reshard_after_forward = false, once per step
    gathers = {label: results[0][i]["comm"]["dp/all_gather"]["calls"] for i, (label, _) in enumerate(layouts)}
    print(gathers)
    blocks = results[0][1]["zero_units"][1]
    assert blocks == MODEL_3D["n_layer"] // 2  # each of the 2 stages gathers its own blocks
    assert gathers["(2,2,1) 1f1b v=1 ZeRO-3"] - gathers["(2,2,1) gpipe ZeRO-3, blocks stay gathered for the step"] \
        == STEPS * blocks * (2 * 4 - 1)
    # without a pipeline: 2 gathers per block and micro-batch, or 1 (every block, 2 micro-batches)
    assert gathers["(1,2,2) sp ZeRO-3"] - gathers["(1,2,2) sp ZeRO-3, blocks stay gathered until reduced"] \
        == STEPS * MODEL_3D["n_layer"] * 2


def test_3d_222_zero1_zero3(reference):
    layouts = [("(pp,dp,tp)=(2,2,2) 1f1b ZeRO-1", _cfg(8, 2, pp=2, dp=2, tp=2, zero=ZERO1)),
               ("(pp,dp,tp)=(2,2,2) interleaved sp ZeRO-3",
                _cfg(8, 2, pp=2, dp=2, tp=2, schedule="interleaved", virtual_stages=2, sequence_parallel=True,
                     zero=_zero(3)))]
    results = launch(train_layouts, ([d for _, d in layouts],), nproc=8)
    _check_all(layouts, results, reference, 8)
    c = results[0][0]["comm"]
    # every axis carried traffic, and the metrics show each
    assert c["tp/all_reduce"]["calls"] > 0 and c["pp/send"]["calls"] > 0 and c["dp/reduce_scatter"]["calls"] > 0


def test_fp16_overflow_skips_on_every_rank_with_pipelines_and_tp():
    """fp16 with an absurd initial loss scale under (pp, dp) with ZeRO-2/3 and (tp, dp) sequence-parallel
    ZeRO-3: the overflow, seen by whichever stage or tp rank holds the inf, is agreed by all four ranks, so
    they skip the same steps; the scale halves until it fits and training then proceeds."""
    layouts = [_cfg(4, 1, pp=2, dp=2, zero=_zero(2)), _cfg(4, 1, pp=2, dp=2, zero=_zero(3)),
               _cfg(4, 2, tp=2, dp=2, sequence_parallel=True, zero=_zero(3))]
    for d in layouts:
        d["run"]["steps"] = 14
        d["train"].update(precision="fp16", loss_scale_init=2.0 ** 24)
    results = launch(train_layouts, (layouts,), nproc=4)
    for i in range(len(layouts)):
        skips = [results[r][i]["skipped"] for r in range(4)]
        assert all(s == skips[0] for s in skips), (i, skips)
        n = sum(skips[0])
        assert 0 < n < 14 and skips[0] == [True] * n + [False] * (14 - n), (i, skips[0])
        losses = results[0][i]["losses"]
        assert losses[-1] < losses[n] - 0.1, (i, losses)
