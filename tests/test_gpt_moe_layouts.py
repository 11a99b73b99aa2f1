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
* pp = 2 x ep = 2, interleaved 1F1B with two virtual stages per rank (four blocks), top-2; replicated;
* folded (``parallel.fold_tp_into_ep``: experts sharded over ep x tp, tokens exchanged over those ranks, no tp
  sum of expert gradients): tp = 2 x ep = 2, top-2, replicated, saving a checkpoint after step CKPT_AT that
  ep = 4 (no tp, no folding) resumes, its next steps' losses the one process's; pp = 2 x tp = 2 (ep = 1: the
  experts sharded over tp alone), 1F1B, top-2; tp = 2 x ep = 2 with sequence parallelism, top-1 with a shared
  expert, ZeRO-3;
* split (``parallel.expert_tensor_parallel``: each expert's hidden width over tp, the rows each tp rank
  received all-gathered over tp and the partial outputs reduce-scattered back; a shared expert split the same
  way, every tp rank's tokens through it): see :func:`etp_jobs` (with sequence parallelism, a shared expert and
  ZeRO-3; a shared expert, replicated; with balance biases; ZeRO-2; a pipeline; every token on one ep rank;
  checkpoints to and from ep = 4, one process, folded and split layouts).
* the load-balancing loss over the global batch (``model.aux_loss_scope = "global"``, Qiu et al. 2025): see
  :func:`global_jobs` (dp = 2 x ep = 2; dp = 2 x tp = 2; tp = 2 x ep = 2 with sequence parallelism), each
  against one process with the same scope, whose shares are its whole batch's;
* the same shares summed over the micro-batches of the step so far (``model.aux_loss_scope = "global_step"``,
  Qiu et al. 2025's buffer for gradient accumulation): see :func:`step_jobs` (two micro-batches a step on
  dp = 2 x ep = 2, pp = 2 x ep = 2 and dp = 2 x tp = 2, and with every block recomputed in the backward under
  GPipe and on dp = 2 x ep = 2), each against one process running the same two global micro-batches a step.

Tolerances: the replicated runs are fp64 end to end, so routing statistics (functions of the global integer
counts) are identical, reduced gradients at step 0 and parameters after the steps agree to 1e-9 relative
(measured ~1e-15 and ~1e-12), gradient norms 1e-9; losses and the routing statistics' aux and z losses are
reported in fp32, 1e-6.  ZeRO computes in fp32: the same routing, losses 1e-6, gradient norms 2e-5
(its parameters are not compared with the fp64 run: AdamW turns fp32 rounding of near-zero gradients into
1e-4 relative differences of small biases).
The pipeline's evaluation loss (every stage's aux losses included) matches one process to 1e-6, and so do
the tp layouts' next-token logits of one sequence (sampling: one sample for two tp ranks; sequence-parallel,
folded, and folded with sequence parallelism under ZeRO-3, 2e-5 there).
"""
import pytest
import torch

import gpt_moe_workers as W
from podscale.config import ConfigError, parse_config
from podscale.runtime.launcher import launch
from podscale.runtime.mesh import Mesh
from test_gpt_moe_task import _matches, _rel, _same_routing

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
CKPT_AT = 4


def fold_jobs(root) -> list[dict]:
    """The folded layouts (indices 7-9; the first with DeepSeek-V3's balance biases, mode "bias"), the ep = 4
    run resuming the first one's checkpoint (10), dp = 2 x tp = 2 folded under ZeRO-2 (11: each expert's Adam
    state and fp32 masters split over dp, on its tp rank alone) saving a checkpoint that ep = 4 resumes (12),
    and pp = 2 x ep = 2 with balance biases (13: each stage's layers' biases) saving a checkpoint that ep = 4
    resumes (14)."""
    return [dict(mode="bias", tp=2, dp=1, ep=2, fold=True, steps=STEPS, micro_batch=4, eval=True, sample=True,
                 save_at=CKPT_AT, save_root=str(root / "replicated")),
            dict(mode="top2", pp=2, tp=2, dp=1, ep=1, fold=True, steps=STEPS, micro_batch=4, eval=True),
            dict(mode="shared", tp=2, dp=1, ep=2, sp=True, fold=True, stage=3, steps=STEPS, micro_batch=4,
                 sample=True),
            dict(mode="bias", dp=1, ep=4, steps=STEPS, load=str(root / "replicated" / f"step_{CKPT_AT:08d}")),
            dict(mode="top2", tp=2, dp=2, ep=1, fold=True, stage=2, steps=STEPS, micro_batch=2, save_at=CKPT_AT,
                 save_root=str(root / "zero2")),
            dict(mode="top2", dp=1, ep=4, steps=STEPS, load=str(root / "zero2" / f"step_{CKPT_AT:08d}")),
            dict(mode="bias", pp=2, dp=1, ep=2, steps=STEPS, micro_batch=2, save_at=CKPT_AT,
                 save_root=str(root / "pipeline")),
            dict(mode="bias", dp=1, ep=4, steps=STEPS, load=str(root / "pipeline" / f"step_{CKPT_AT:08d}"))]


def etp_jobs(root) -> list[dict]:
    """Expert tensor parallelism (``parallel.expert_tensor_parallel``: each expert's hidden width split over tp;
    indices from 15): tp = 2 x ep = 2 with sequence parallelism, top-1 beside a shared expert, ZeRO-3 (15);
    tp = 2 x ep = 2 with balance biases, replicated, saving a checkpoint (16) that ep = 4 resumes (17), as do
    dp = 2 x tp = 2 split again under ZeRO-1 (19) and one process (the ``resumed`` fixture); dp = 2 x tp = 2
    (ep = 1) under ZeRO-2 (18); tp = 2 x ep = 2 split, resuming the folded checkpoint of job 7 (20);
    pp = 2 x tp = 2 (ep = 1), 1F1B, top-2 (21); tp = 2 x ep = 2, dropless, every router zeroed so that all
    tokens choose ep rank 0's experts (22: the other ep rank's tp pair gathers no rows); tp = 2 x ep = 2
    folded, resuming the split checkpoint of job 16 (23); tp = 2 x ep = 2, top-1 beside a shared expert whose
    width is split over tp too, replicated (fp64: gradients and parameters compared), saving a checkpoint (24)
    that ep = 4 resumes (25)."""
    return [dict(mode="shared", tp=2, dp=1, ep=2, sp=True, etp=True, stage=3, steps=STEPS, micro_batch=4,
                 sample=True),
            dict(mode="bias", tp=2, dp=1, ep=2, etp=True, steps=STEPS, micro_batch=4, eval=True, sample=True,
                 save_at=CKPT_AT, save_root=str(root / "etp")),
            dict(mode="bias", dp=1, ep=4, steps=STEPS, load=str(root / "etp" / f"step_{CKPT_AT:08d}")),
            dict(mode="top2", tp=2, dp=2, ep=1, etp=True, stage=2, steps=STEPS, micro_batch=2),
            dict(mode="bias", tp=2, dp=2, ep=1, etp=True, stage=1, steps=STEPS, micro_batch=2,
                 load=str(root / "etp" / f"step_{CKPT_AT:08d}")),
            dict(mode="bias", tp=2, dp=1, ep=2, etp=True, steps=STEPS, micro_batch=4,
                 load=str(root / "replicated" / f"step_{CKPT_AT:08d}")),
            dict(mode="top2", pp=2, tp=2, dp=1, ep=1, etp=True, steps=STEPS, micro_batch=4, eval=True),
            dict(mode="dropless", tp=2, dp=1, ep=2, etp=True, steps=STEPS, micro_batch=4, collapse=True),
            dict(mode="bias", tp=2, dp=1, ep=2, fold=True, steps=STEPS, micro_batch=4,
                 load=str(root / "etp" / f"step_{CKPT_AT:08d}")),
            dict(mode="shared", tp=2, dp=1, ep=2, etp=True, steps=STEPS, micro_batch=4, eval=True, sample=True,
                 save_at=CKPT_AT, save_root=str(root / "etp_shared")),
            dict(mode="shared", dp=1, ep=4, steps=STEPS, load=str(root / "etp_shared" / f"step_{CKPT_AT:08d}"))]


def global_jobs() -> list[dict]:
    """The load-balancing loss with its first-choice shares counted over the global batch (mode "global":
    top-2, random routing, ``model.aux_loss_scope = "global"``; indices from 26): dp = 2 x ep = 2 (26), dp = 2 x
    tp = 2 (27: each tp rank routes its half of the samples, so the counts are summed over tp too; sampling one
    sequence, which every rank routes whole), tp = 2 x ep = 2 with sequence parallelism (28).  One micro-batch
    per step, so each step's global batch is one process's batch and its shares the one process's."""
    return [dict(mode="global", dp=2, ep=2, steps=STEPS, eval=True),
            dict(mode="global", tp=2, dp=2, ep=1, steps=STEPS, micro_batch=4, eval=True, sample=True),
            dict(mode="global", tp=2, dp=1, ep=2, sp=True, steps=STEPS, micro_batch=4, eval=True)]


def step_jobs() -> list[dict]:
    """The load-balancing loss with its first-choice shares summed over the step's micro-batches so far (mode
    "global_step"; indices from 29), two micro-batches a step, each of them one global micro-batch of 4
    sequences (the loader gives micro-step k the same samples on every layout): dp = 2 x ep = 2 (29);
    pp = 2 x ep = 2, 1F1B (30: each stage's layers add their micro-batches' counts in the order their forwards
    run); dp = 2 x tp = 2 (31: each tp rank routes half of a micro-batch's samples); pp = 2 x ep = 2 under GPipe
    with every block recomputed in the backward (32: both forwards run before the recomputations, which must
    take their first forwards' sums); dp = 2 x ep = 2 with every block recomputed (33)."""
    return [dict(mode="global_step", dp=2, ep=2, steps=STEPS, micro_batch=1, eval=True),
            dict(mode="global_step", pp=2, dp=1, ep=2, steps=STEPS, micro_batch=2, schedule="1f1b", eval=True),
            dict(mode="global_step", tp=2, dp=2, ep=1, steps=STEPS, micro_batch=2, eval=True, sample=True),
            dict(mode="global_step", pp=2, dp=1, ep=2, steps=STEPS, micro_batch=2, schedule="gpipe",
                 recompute="full"),
            dict(mode="global_step", dp=2, ep=2, steps=STEPS, micro_batch=1, recompute="full")]


def dispatch_jobs() -> list[dict]:
    """The per-rank dispatch (``parallel.expert_dispatch = "rank"``: a token sent once to each rank holding any of
    its choices, combined there; indices from 34): tp = 2 x ep = 2 folded with sequence parallelism under ZeRO-3
    (34: the exchange over the ep x tp group of 4), pp = 2 x ep = 2 under GPipe with every block recomputed in
    the backward (35: each recomputed forward enters the dispatch's four all-to-alls again)."""
    return [dict(mode="top2", tp=2, dp=1, ep=2, sp=True, fold=True, stage=3, steps=STEPS, micro_batch=4,
                 dispatch="rank"),
            dict(mode="top2", pp=2, dp=1, ep=2, steps=STEPS, micro_batch=2, schedule="gpipe", recompute="full",
                 dispatch="rank")]


def _all_jobs(root) -> list[dict]:
    return JOBS + fold_jobs(root) + etp_jobs(root) + global_jobs() + step_jobs() + dispatch_jobs()


def _cfg(**parallel):
    train = {"global_batch": 8, "micro_batch": parallel.pop("micro_batch", 2)}
    model = {"expert_hidden": parallel.pop("expert_hidden")} if "expert_hidden" in parallel else {}
    return parse_config({"model": {"kind": "gpt-moe", "n_layer": 4, "n_head": 2, "n_embd": 32, "block_size": 32,
                                   "experts": 4, **model},
                         "parallel": parallel, "train": train})


@pytest.mark.parametrize("parallel,words", [
    (dict(nproc=2, tp=2, micro_batch=1), ["train.micro_batch=1", "parallel.tp=2"]),
    (dict(nproc=4, pp=2, tp=2, sequence_parallel=True, micro_batch=1), ["train.micro_batch=1", "parallel.tp=2"]),
    (dict(nproc=2, pp=2, pipeline_balance="time"), ["pipeline_balance='time'", "pipeline_layers"]),
    (dict(nproc=2, fold_tp_into_ep=True), ["parallel.fold_tp_into_ep", "parallel.tp"]),
    (dict(nproc=8, tp=2, ep=4, fold_tp_into_ep=True), ["model.experts=4", "parallel.ep*parallel.tp=8",
                                                       "fold_tp_into_ep = false"]),
    (dict(nproc=2, expert_tensor_parallel=True), ["parallel.expert_tensor_parallel", "parallel.tp > 1",
                                                  "expert_tensor_parallel = false"]),
    (dict(nproc=4, tp=2, micro_batch=2, expert_tensor_parallel=True, fold_tp_into_ep=True),
     ["parallel.expert_tensor_parallel", "parallel.fold_tp_into_ep", "set one of them to false"]),
    (dict(nproc=2, tp=2, expert_tensor_parallel=True, expert_hidden=45),
     ["model.expert_hidden=45", "parallel.tp=2", "expert_tensor_parallel = false"]),
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
                                      dict(nproc=4, pp=2, ep=2, schedule="interleaved", virtual_stages=2),
                                      dict(nproc=4, tp=2, ep=2, micro_batch=4, fold_tp_into_ep=True),
                                      dict(nproc=4, tp=2, ep=2, micro_batch=4, expert_tensor_parallel=True),
                                      dict(nproc=8, pp=2, tp=2, ep=2, micro_batch=2, sequence_parallel=True,
                                           expert_tensor_parallel=True)])
def test_pipeline_and_tensor_parallel_moe_layouts_are_accepted(parallel):
    _cfg(**parallel).check_layout(parallel["nproc"])


def test_folding_a_model_without_experts_is_a_one_line_error():
    cfg = parse_config({"model": {"kind": "gpt", "n_head": 2, "n_embd": 32}, "parallel": {"nproc": 2, "tp": 2,
                                                                                       "fold_tp_into_ep": True}})
    with pytest.raises(ConfigError, match=r"^parallel.fold_tp_into_ep shards .*model.kind='gpt' has none: set "
                                          r"fold_tp_into_ep = false$"):
        cfg.check_layout(2)


def test_splitting_experts_of_a_model_without_experts_is_a_one_line_error():
    cfg = parse_config({"model": {"kind": "gpt", "n_head": 2, "n_embd": 32},
                        "parallel": {"nproc": 2, "tp": 2, "expert_tensor_parallel": True}})
    with pytest.raises(ConfigError, match=r"^parallel.expert_tensor_parallel splits .*model.kind='gpt' has none: "
                                          r"set expert_tensor_parallel = false$"):
        cfg.check_layout(2)


@pytest.mark.parametrize("kwargs,words", [
    (dict(folded_tp=2, width_tp=2, hidden=64), ["parallel.expert_tensor_parallel", "parallel.fold_tp_into_ep"]),
    (dict(width_tp=4, hidden=42), ["model.expert_hidden=42", "parallel.tp=4", "expert_tensor_parallel = false"]),
])
def test_the_layer_refuses_an_expert_width_split_it_cannot_make(kwargs, words):
    """The layer's own check (the GPT-MoE and a bare MoELayer call it) gives the config's one-line errors."""
    from podscale.parallel.moe import check_moe_args
    with pytest.raises(ValueError) as err:
        check_moe_args(8, 2, 1.25, 2.0, 2, **kwargs)
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("fold")


@pytest.fixture(scope="module")
def runs(root):
    return launch(W.run_jobs, (_all_jobs(root),), nproc=4)


@pytest.fixture(scope="module")
def single():
    mesh = Mesh.build()
    out = {(m, n): W.run_job(dict(mode=m, dp=1, ep=1, steps=STEPS, eval=True, sample=True, n_layer=n), mesh)
           for m, n in (("top2", 2), ("dropless", 2), ("top1", 2), ("shared", 2), ("top2", 4), ("bias", 2),
                        ("global", 2))}
    out["collapsed"] = W.run_job(dict(mode="dropless", dp=1, ep=1, steps=STEPS, collapse=True), mesh)
    # two micro-batches of 4 sequences a step (gradient accumulation), as the step_jobs layouts' global ones;
    # the micro-batch scope on the same split, which the step scope must differ from
    out[("global_step", 2)] = W.run_job(dict(mode="global_step", dp=1, ep=1, steps=STEPS, micro_batch=4, eval=True,
                                             sample=True), mesh)
    out["global_m2"] = W.run_job(dict(mode="global", dp=1, ep=1, steps=STEPS, micro_batch=4), mesh)
    return out


@pytest.fixture(scope="module")
def resumed(runs, root):
    """One process resuming the split experts' checkpoint of job 16 (every expert whole from its tp halves)."""
    return W.run_job(dict(mode="bias", dp=1, ep=1, steps=STEPS, load=str(root / "etp" / f"step_{CKPT_AT:08d}")),
                     Mesh.build())


@pytest.mark.parametrize("i,label", [(0, "pp=2 ep=2 1f1b top2"), (1, "pp=2 ep=2 gpipe dropless ZeRO-1"),
                                     (2, "tp=2 ep=2 top2"), (3, "tp=2 ep=2 top1 ZeRO-3"),
                                     (4, "pp=2 tp=2 1f1b top2"), (5, "tp=2 sp ep=2 top1 + shared expert"),
                                     (6, "pp=2 ep=2 interleaved v=2 top2"),
                                     (7, "tp=2 ep=2 folded top2 with balance biases"),
                                     (8, "pp=2 tp=2 folded 1f1b top2"),
                                     (9, "tp=2 sp ep=2 folded top1 + shared expert ZeRO-3"),
                                     (13, "pp=2 ep=2 1f1b top2 with balance biases"),
                                     (15, "tp=2 sp ep=2 split experts top1 + shared expert ZeRO-3"),
                                     (16, "tp=2 ep=2 split experts top2 with balance biases"),
                                     (18, "dp=2 tp=2 split experts top2 ZeRO-2"),
                                     (21, "pp=2 tp=2 split experts 1f1b top2"),
                                     (22, "tp=2 ep=2 split experts dropless, every token to ep rank 0"),
                                     (24, "tp=2 ep=2 split experts top1 + split shared expert"),
                                     (26, "dp=2 ep=2 top2 global aux loss"),
                                     (27, "dp=2 tp=2 top2 global aux loss"),
                                     (28, "tp=2 sp ep=2 top2 global aux loss"),
                                     (29, "dp=2 ep=2 top2 step-global aux loss, 2 micro-batches"),
                                     (30, "pp=2 ep=2 1f1b top2 step-global aux loss, 2 micro-batches"),
                                     (31, "dp=2 tp=2 top2 step-global aux loss, 2 micro-batches"),
                                     (32, "pp=2 ep=2 gpipe recompute top2 step-global aux loss"),
                                     (33, "dp=2 ep=2 recompute top2 step-global aux loss"),
                                     (34, "tp=2 sp ep=2 folded top2 ZeRO-3, per-rank dispatch"),
                                     (35, "pp=2 ep=2 gpipe recompute top2, per-rank dispatch")])
def test_moe_layout_matches_one_process(runs, single, i, label, tmp_path):
    job = _all_jobs(tmp_path)[i]
    ref = single["collapsed" if job.get("collapse") else (job["mode"], job.get("n_layer", 2))]
    for rank, res in runs.items():
        ours = res[i]
        zero = job.get("stage", 0) > 0
        _matches(ours, ref, f"{label} rank {rank}", norm_rel=2e-5 if zero else 1e-9,
                 ep=job["ep"] * (job.get("tp", 1) if job.get("fold") else 1), param_rel=None if zero else 1e-9)
        if job.get("stage", 0) == 0:
            # a pipeline rank holds one stage's parameters, a tp rank its shards (gathered, the split experts'
            # too): every one compared
            assert ours["grads"] and set(ours["grads"]) <= set(ref["grads"]), label
            assert any(".moe.experts." in n for n in ours["grads"]), label
            assert any(".moe.router." in n for n in ours["grads"]), label
            assert any(".moe.shared." in n for n in ours["grads"]) == (job["mode"] == "shared"), label
        if job.get("eval"):
            assert ours["eval"] == pytest.approx(ref["eval"], rel=1e-6), label
        for name, b in ours["biases"].items():  # every step's sign steps, from the same global demand
            assert torch.equal(b, ref["biases"][name]) and b.abs().sum() > 0, (label, name)
        assert bool(ours["biases"]) == (job["mode"] == "bias"), label
        if job.get("sample"):  # one sequence's next-token logits (the tp MoE layer's one-sample inference path)
            tol = 2e-5 if zero else 1e-6   # (ZeRO computes in fp32)
            torch.testing.assert_close(ours["next"], ref["next"], rtol=tol, atol=tol, msg=label)
    # routing metrics of every MoE layer on every rank (a pipeline rank holds some of them)
    layers = {f"blocks.{b}/dropped_share" for b in range(job.get("n_layer", 2))}
    assert layers <= set(runs[0][i]["metrics"][-1]), label
    dropped = [m["blocks.1/dropped_share"] for m in ref["metrics"]]
    assert (max(dropped) == 0) == (job["mode"] == "dropless"), dropped


def _experts_held(res: dict, block: int) -> set[int]:
    return {int(n.split(".")[4]) for n in res["held"] if n.startswith(f"blocks.{block}.moe.experts.")}


def test_folded_experts_are_sharded_over_ep_and_tp(runs):
    """Folded, rank (e, t) of the ep x tp group holds the experts [(e * tp + t) * E/(ep tp), ...): each
    expert on one rank (two per rank here); unfolded, both tp ranks of an ep rank hold its four."""
    for rank, res in runs.items():  # ranks are (ep, tp) = (rank // 2, rank % 2) on the tp = 2 x ep = 2 mesh
        for block in (0, 1):
            assert _experts_held(res[7], block) == {2 * rank, 2 * rank + 1}, rank
            assert _experts_held(res[2], block) == set(range(4 * (rank // 2), 4 * (rank // 2) + 4)), rank
    # pp = 2 x tp = 2, ep = 1: each stage's block's experts sharded over its two tp ranks
    assert [_experts_held(runs[r][8], r // 2) for r in range(4)] == [{0, 1, 2, 3}, {4, 5, 6, 7}] * 2


def test_folded_checkpoints_resume_at_another_layout(runs, single):
    """tp = 2 x ep = 2 folded (replicated) and dp = 2 x tp = 2 folded (ZeRO-2, fp32) save after step CKPT_AT
    (model and Adam state, each expert from its holders); ep = 4 without tp loads each, and its next steps'
    losses are the one process's (ZeRO-2's fp32 run within 1e-6, as its own losses are)."""
    ref, biased = single[("top2", 2)]["losses"], single[("bias", 2)]["losses"]
    for rank, res in runs.items():
        assert res[11]["losses"] == pytest.approx(ref, rel=1e-6), rank
        assert res[10]["losses"] == pytest.approx(biased[CKPT_AT:], rel=1e-6), rank
        assert res[12]["losses"] == pytest.approx(ref[CKPT_AT:], rel=1e-6), rank


def test_balance_biases_travel_in_checkpoints(runs, single):
    """The routers' balance biases (buffers, not parameters) are in the model state of every layout: saved
    by tp = 2 x ep = 2 folded (job 7) and by pp = 2 x ep = 2 (each stage its layers', job 13), loaded by ep = 4
    (jobs 10 and 14), whose next steps then route and train as the one process does."""
    biased = single[("bias", 2)]
    for rank, res in runs.items():
        for i in (10, 14):
            assert res[i]["losses"] == pytest.approx(biased["losses"][CKPT_AT:], rel=1e-6), (i, rank)
            _same_routing(res[i]["metrics"], biased["metrics"][CKPT_AT:], f"job {i} rank {rank}", 4)
            for name, b in res[i]["biases"].items():
                assert torch.equal(b, biased["biases"][name]), (i, rank, name)


def test_folded_expert_checkpoint_pieces_name_their_holders(runs):
    """Under ZeRO-2 on dp = 2 x tp = 2 folded (ranks (dp, tp) = (rank // 2, rank % 2)) an expert's
    checkpoint tensor lies in the dp slices of the one tp rank that holds it: its metadata names only ranks
    of that tp coordinate (the dp ranks whose slices hold its pieces), and the experts of a tp rank, all
    together, are spread over both of its dp ranks."""
    for rank, res in runs.items():
        experts = {n: r for n, r in res[11]["placements"].items() if ".moe.experts." in n}
        t = rank % 2
        assert experts and all(int(n.split(".")[4]) // 4 == t for n in experts), rank  # 0-3 on tp 0, 4-7 on 1
        for name, ranks in experts.items():
            assert all(r % 2 == t for r in ranks), (rank, name, ranks)
        assert set().union(*experts.values()) == {t, 2 + t}, rank


def test_split_experts_are_held_in_part_by_both_tp_ranks(runs):
    """With each expert's width split over tp (job 16: tp = 2 x ep = 2, ranks (ep, tp) = (rank // 2, rank % 2))
    both tp ranks of an ep rank hold its four experts, each a tp shard in the checkpoint: ``w_fc``, ``b_fc``
    and ``w_proj`` ShardedTensors whose pieces lie on those two ranks, ``b_proj`` whole on both (a plain
    tensor)."""
    for rank, res in runs.items():
        pair = {2 * (rank // 2), 2 * (rank // 2) + 1}
        for block in (0, 1):
            assert _experts_held(res[16], block) == set(range(4 * (rank // 2), 4 * (rank // 2) + 4)), rank
        placed = res[16]["placements"]
        for e in range(4 * (rank // 2), 4 * (rank // 2) + 4):
            for leaf in ("w_fc", "b_fc", "w_proj"):
                assert placed[f"blocks.1.moe.experts.{e}.{leaf}"] == sorted(pair), (rank, e, leaf)
            assert f"blocks.1.moe.experts.{e}.b_proj" not in placed, (rank, e)


def test_split_experts_checkpoints_resume_at_other_layouts(runs, single, resumed):
    """The split experts' checkpoint of job 16 (tp = 2 x ep = 2, replicated, after step CKPT_AT) resumed by
    ep = 4 (17), by dp = 2 x tp = 2 split again under ZeRO-1 (19), by tp = 2 x ep = 2 folded (23) and by one
    process: their next steps' losses and routing are the one process's, and so are the balance biases they
    step; and the other way, the split layout resumes the folded checkpoint of job 7 (20).  The split shared
    expert's checkpoint (job 24) holds its one-process tensors: ep = 4 resumes it (25) and trains on as one
    process does, to the parameter."""
    biased, shared = single[("bias", 2)], single[("shared", 2)]
    for rank, res in list(runs.items()) + [("one process", {0: resumed})]:
        for i in (17, 19, 20, 23) if rank != "one process" else (0,):
            ours = res[i]
            assert ours["losses"] == pytest.approx(biased["losses"][CKPT_AT:], rel=1e-6), (i, rank)
            _same_routing(ours["metrics"], biased["metrics"][CKPT_AT:], f"job {i} rank {rank}", 4)
            assert ours["biases"].keys() == biased["biases"].keys(), (i, rank)
            for name, b in ours["biases"].items():
                assert torch.equal(b.double(), biased["biases"][name].double()), (i, rank, name)
        if rank != "one process":
            ours = res[25]
            assert ours["losses"] == pytest.approx(shared["losses"][CKPT_AT:], rel=1e-6), rank
            _same_routing(ours["metrics"], shared["metrics"][CKPT_AT:], f"job 25 rank {rank}", 4)
            assert any(".moe.shared." in n for n in ours["params"]), rank
            for name, p in ours["params"].items():
                assert _rel(p, shared["params"][name]) <= 1e-9, (rank, name)


def test_the_split_shared_expert_is_held_in_part_by_both_tp_ranks(runs, single):
    """With expert tensor parallelism the shared expert's width is split over tp as the routed experts' is
    (job 24: tp = 2 x ep = 2, ranks (ep, tp) = (rank // 2, rank % 2)): after the steps, tp rank t holds the
    columns of ``w_fc`` and entries of ``b_fc`` [t h/2, (t+1) h/2) of the one-process tensors and the same rows
    of ``w_proj`` (h/2 wide each), and ``b_proj`` whole; its checkpoint tensors are tp shards whose pieces lie
    on the two tp ranks of the rank's ep coordinate, ``b_proj`` a plain tensor."""
    ref = single[("shared", 2)]["params"]
    h = W.config("shared", 1, 1).model.expert_hidden
    for rank, res in runs.items():
        t, pair = rank % 2, sorted({2 * (rank // 2), 2 * (rank // 2) + 1})
        held = res[24]["shared_held"]
        for block in (0, 1):
            name = f"blocks.{block}.moe.shared."
            assert held[name + "w_fc"].shape[1] == held[name + "b_fc"].shape[0] == held[name + "w_proj"].shape[0] \
                == h // 2, rank
            for leaf, dim in (("w_fc", 1), ("b_fc", 0), ("w_proj", 0)):
                part = ref[name + leaf].chunk(2, dim=dim)[t]
                assert _rel(held[name + leaf], part) <= 1e-9, (rank, block, leaf)
                assert res[24]["placements"][name + leaf] == pair, (rank, block, leaf)
            assert _rel(held[name + "b_proj"], ref[name + "b_proj"]) <= 1e-9, (rank, block)
            assert name + "b_proj" not in res[24]["placements"], (rank, block)


def test_split_experts_with_every_token_on_one_ep_rank(runs, single):
    """Job 22: every router zeroed, so at the first step every token's choices tie and go to the same two
    experts, both on ep rank 0: the other ep rank's tp pair gathers and runs no rows, yet every rank enters
    every collective and the run matches one process (test_moe_layout_matches_one_process)."""
    first = single["collapsed"]["metrics"][0]
    assert first["blocks.0/load_min"] == 0 and first["blocks.0/load_max"] == 0.5, first
    for rank, res in runs.items():
        assert res[22]["metrics"][0]["blocks.0/peak_rank_load"] == 2.0, rank


def test_the_global_aux_loss_is_not_the_group_loss(single):
    """The one-process references of the global-scope layouts: the same model, data and routing settings as
    mode "top2" but the shares counted over the batch, not per sequence, so the aux losses differ from the first
    step (and with them the training), which is what lets the layouts' comparison tell a rank's own shares
    from the global batch's."""
    glob, group = single[("global", 2)], single[("top2", 2)]
    aux = [(g["blocks.0/aux_loss"], p["blocks.0/aux_loss"]) for g, p in zip(glob["metrics"], group["metrics"])]
    assert all(abs(a - b) > 1e-4 * abs(b) for a, b in aux), aux


def test_the_step_aux_loss_is_not_the_micro_batch_one(single):
    """The one-process reference of the step-scope layouts, two micro-batches a step: each step's first
    micro-batch counts its own shares, as the micro-batch scope does, and its second one those of both, which
    the micro-batch scope does not (so the step's mean aux loss differs from the first step on, and with it the
    training): what lets the layouts' comparison tell a sum over the step from each micro-batch's own."""
    step, micro = single[("global_step", 2)], single["global_m2"]
    aux = [(s["blocks.0/aux_loss"], m["blocks.0/aux_loss"]) for s, m in zip(step["metrics"], micro["metrics"])]
    assert all(abs(a - b) > 1e-4 * abs(b) for a, b in aux), aux


def test_the_step_sum_starts_again_at_every_step(runs, single):
    """After every step each MoE layer's sum holds the step's tokens alone, 8 sequences x 32 (on every rank:
    the counts are summed over the ranks that route other tokens), not those of the steps before: the engine
    empties it when a step starts, whoever calls ``Engine.step``.  (Layouts and one process would agree
    without the reset too, each summing over all steps; this is the check that they do not.)"""
    for res in [single[("global_step", 2)]] + [runs[r][i] for r in runs for i in range(29, 34)]:
        assert res["step_tokens"] and all(t and set(t) == {8 * 32} for t in res["step_tokens"]), res["step_tokens"]
    assert runs[0][26]["step_tokens"] == [[]] * STEPS   # the micro-batch scope keeps no sum
