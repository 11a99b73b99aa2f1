"""The GPT-MoE under pipelines, tensor and sequence parallelism, against one process.

One 4-rank process group runs seven layouts of the GPT-MoE task through the trunk (tests/gpt_moe_workers.py;
two blocks, both MoE, so each pipeline stage has an MoE layer whose aux and z losses only reach the
gradients through that stage's backward; four blocks for the interleaved schedule):

* pp = 2 x ep = 2, 1F1B, two micro-batches per step, top-2 with random routing; replicated data parallelism;
* pp = 2 x ep = 2, GPipe, dropless, ZeRO-1;
* tp = 2 x ep = 2 (attention and the loss tensor-parallel, the MoE layers splitting the samples over tp),
  top-2; replicated;
* tp = 2 x ep = 2, top-1 with capacity, ZeRO-3;
* pp = 2 x tp = 2 (ep = 1: one data rank), 1F1B, top-2 with random routing; replicated;
* tp = 2 x ep = 2 with sequence parallelism (each MoE layer turns its sequence shards into whole sequences
  of its share of the samples and back), top-1 with capacity beside a shared expert (dense parameters that
  every tp rank holds whole and whose partial gradients are summed over tp, as the router's); replicated;
* pp = 2 x ep = 2, interleaved 1F1B with two virtual stages per rank (four blocks), top-2; replicated.

Tolerances: the replicated runs are fp64 end to end, so routing statistics (functions of the global integer
counts) are identical, reduced gradients at step 0 and parameters after the steps agree to 1e-9 relative
(measured ~1e-15 and ~1e-12), gradient norms 1e-9; losses and the routing statistics' aux and z losses are
reported in fp32, 1e-6.  ZeRO computes in fp32: the same routing, losses 1e-6, gradient norms 2e-5
(its parameters are not compared with the fp64 run: AdamW turns fp32 rounding of near-zero gradients into
1e-4 relative differences of small biases).
The pipeline's evaluation loss (every stage's aux losses included) matches one process to 1e-6, and so do
the sequence-parallel layout's next-token logits of one sequence (sampling: one sample for two tp ranks).
"""
import pytest
import torch

import gpt_moe_workers as W
from podscale.config import ConfigError, parse_config
from podscale.runtime.launcher import launch
from podscale.runtime.mesh import Mesh
from test_gpt_moe_task import _matches

STEPS = 8
JOBS = [
    dict(mode="top2", pp=2, dp=1, ep=2, steps=STEPS, micro_batch=2, schedule="1f1b", eval=True),
    dict(mode="dropless", pp=2, dp=1, ep=2, steps=STEPS, micro_batch=2, schedule="gpipe", stage=1),
    dict(mode="top2", tp=2, dp=1, ep=2, steps=STEPS, micro_batch=4, eval=True),
    dict(mode="top1", tp=2, dp=1, ep=2, steps=STEPS, micro_batch=4, stage=3),
    dict(mode="top2", pp=2, tp=2, dp=1, ep=1, steps=STEPS, micro_batch=4, eval=True),
    dict(mode="shared", tp=2, dp=1, ep=2, sp=True, steps=STEPS, micro_batch=4, eval=True, sample=True),
    dict(mode="top2", pp=2, dp=1, ep=2, steps=STEPS, micro_batch=2, schedule="interleaved", virtual_stages=2,
         n_layer=4, eval=True),
]


def _cfg(**parallel):
    train = {"global_batch": 8, "micro_batch": parallel.pop("micro_batch", 2)}
    return parse_config({"model": {"kind": "gpt-moe", "n_layer": 4, "n_head": 2, "n_embd": 32, "block_size": 32,
                                   "experts": 4},
                         "parallel": parallel, "train": train})


@pytest.mark.parametrize("parallel,words", [
    (dict(nproc=2, tp=2, micro_batch=1), ["train.micro_batch=1", "parallel.tp=2"]),
    (dict(nproc=4, pp=2, tp=2, sequence_parallel=True, micro_batch=1), ["train.micro_batch=1", "parallel.tp=2"]),
    (dict(nproc=2, pp=2, pipeline_balance="time"), ["pipeline_balance='time'", "pipeline_layers"]),
])
def test_unsupported_moe_layouts_are_one_line_errors(parallel, words):
    with pytest.raises(ConfigError) as err:
        _cfg(**parallel).check_layout(parallel["nproc"])
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("parallel", [dict(nproc=4, pp=2, ep=2), dict(nproc=4, tp=2, ep=2, micro_batch=4),
                                      dict(nproc=2, tp=2), dict(nproc=4, pp=2, tp=2),
                                      dict(nproc=4, tp=2, ep=2, sequence_parallel=True, micro_batch=4),
                                      dict(nproc=4, pp=2, tp=2, sequence_parallel=True),
                                      dict(nproc=4, pp=2, ep=2, schedule="interleaved", virtual_stages=2)])
def test_pipeline_and_tensor_parallel_moe_layouts_are_accepted(parallel):
    _cfg(**parallel).check_layout(parallel["nproc"])


@pytest.fixture(scope="module")
def runs():
    return launch(W.run_jobs, (JOBS,), nproc=4)


@pytest.fixture(scope="module")
def single():
    mesh = Mesh.build()
    return {(m, n): W.run_job(dict(mode=m, dp=1, ep=1, steps=STEPS, eval=True, sample=True, n_layer=n), mesh)
            for m, n in (("top2", 2), ("dropless", 2), ("top1", 2), ("shared", 2), ("top2", 4))}


@pytest.mark.parametrize("i,label", [(0, "pp=2 ep=2 1f1b top2"), (1, "pp=2 ep=2 gpipe dropless ZeRO-1"),
                                     (2, "tp=2 ep=2 top2"), (3, "tp=2 ep=2 top1 ZeRO-3"),
                                     (4, "pp=2 tp=2 1f1b top2"), (5, "tp=2 sp ep=2 top1 + shared expert"),
                                     (6, "pp=2 ep=2 interleaved v=2 top2")])
def test_moe_layout_matches_one_process(runs, single, i, label):
    job = JOBS[i]
    ref = single[(job["mode"], job.get("n_layer", 2))]
    for rank, res in runs.items():
        ours = res[i]
        zero = job.get("stage", 0) > 0
        _matches(ours, ref, f"{label} rank {rank}", norm_rel=2e-5 if zero else 1e-9, ep=job["ep"],
                 param_rel=None if zero else 1e-9)
        if job.get("stage", 0) == 0:
            # a pipeline rank holds one stage's parameters, a tp rank its shards (gathered): every one compared
            assert ours["grads"] and set(ours["grads"]) <= set(ref["grads"]), label
            assert any(".moe.experts." in n for n in ours["grads"]), label
            assert any(".moe.router." in n for n in ours["grads"]), label
            assert any(".moe.shared." in n for n in ours["grads"]) == (job["mode"] == "shared"), label
        if job.get("eval"):
            assert ours["eval"] == pytest.approx(ref["eval"], rel=1e-6), label
        if job.get("sample"):  # one sequence's next-token logits (the sequence-parallel MoE's inference path)
            torch.testing.assert_close(ours["next"], ref["next"], rtol=1e-6, atol=1e-6, msg=label)
    # routing metrics of every MoE layer on every rank (a pipeline rank holds some of them)
    layers = {f"blocks.{b}/dropped_share" for b in range(job.get("n_layer", 2))}
    assert layers <= set(runs[0][i]["metrics"][-1]), label
    dropped = [m["blocks.1/dropped_share"] for m in ref["metrics"]]
    assert (max(dropped) == 0) == (job["mode"] == "dropless"), dropped
