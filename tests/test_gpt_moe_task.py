"""The GPT-MoE task through the trunk: config checks, expert parallelism with the data-parallel strategies'
expert/dense gradient split against one process, checkpoints that move between ep sizes, and
``podscale train`` end to end with routing metrics and ``podscale export``.

Tolerances: the runs are fp64 end to end (tests/gpt_moe_workers.py), so routing statistics (dropped
shares, per-expert loads: functions of the global integer counts) must be identical; reduced gradients,
gradient norms and parameters after 20 AdamW steps agree to 1e-9 relative (measured: ~1e-14 for gradients,
~1e-12 for parameters); the engine reports losses in fp32 (a sum of micro-batch losses), hence 1e-6; the
routing statistics' aux and z losses are fp32 means, 1e-6.
"""
import json
from pathlib import Path

import pytest
import torch

import gpt_moe_workers as W
from conftest import shakespeare
from podscale.cli import main
from podscale.config import ConfigError, parse_config
from podscale.runtime.launcher import launch
from podscale.runtime.mesh import Mesh

STEPS = 20
TRUST_STEPS = 4  # LAMB / LARS under ZeRO-1 at ep = 2
# the peak learning rate of the tp = 2 trust-ratio runs with split experts: the config's for LAMB; for LARS, whose
# trust coefficient (0.001) scales its steps a thousandfold down (You et al. 2017 train with global rates of
# several units), one at which its steps move the parameters by more than the runs' fp32 tolerance
SPLIT_TRUST_LR = {"lamb": 3e-3, "lars": 0.3}
CKPT_AT = 4  # the ep=2 run saves after this step; ep=1 continues one step and saves; ep=4 continues one more


def _moe_cfg(**over):
    data = {"model": {"kind": "gpt-moe", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32,
                      "experts": 4},
            "parallel": {"nproc": 2, "ep": 2}, "train": {"global_batch": 8, "micro_batch": 2}}
    for key, value in over.items():
        section, k = key.split("__")
        data.setdefault(section, {})[k] = value
    return data


@pytest.mark.parametrize("over,world,words", [
    (dict(model__experts=6, parallel__ep=4, parallel__nproc=4), 4, ["model.experts=6", "parallel.ep=4"]),
    (dict(model__top_k=5), 2, ["model.top_k=5", "model.experts=4"]),
    (dict(model__moe_every=3), 2, ["model.moe_every=3", "model.n_layer=2", "at most 2"]),
    (dict(model__capacity_factor=0.0), 2, ["model.capacity_factor=0.0", "> 0"]),
    (dict(model__eval_capacity_factor=-1.0), 2, ["model.eval_capacity_factor", "> 0"]),
    (dict(model__capacity_factor=float("inf")), 2, ["model.capacity_factor", "finite"]),
    (dict(model__eval_capacity_factor=float("nan")), 2, ["model.eval_capacity_factor", "finite"]),
    (dict(model__dropless=True, model__dropless_peak_load=0.5), 2, ["model.dropless_peak_load", "1"]),
    (dict(model__shared_experts=-1), 2, ["model.shared_experts", "0"]),
    (dict(model__bias_update_rate=0.0), 2, ["model.bias_update_rate", "0"]),
    (dict(parallel__ep=3, parallel__nproc=4, model__experts=6), 4, ["parallel.ep=3", "does not divide the 4"]),
    (dict(model__kind="gpt", model__experts=None, parallel__ep=2), 2, ["parallel.ep=2", "no experts",
                                                                        "parallel.ep = 1"]),
    (dict(parallel__tp=2, parallel__ep=1, train__micro_batch=1), 2, ["train.micro_batch=1", "parallel.tp=2"]),
    (dict(train__global_batch=6), 2, ["train.global_batch=6", "dp*ep*micro_batch"]),
    (dict(parallel__tp=2, parallel__ep=1, parallel__expert_tensor_parallel=True, parallel__expert_dispatch="rank"), 2,
     ["parallel.expert_dispatch = 'rank'", "expert_tensor_parallel = false"]),
    (dict(parallel__tp=2, parallel__ep=1, parallel__expert_tensor_parallel=True, parallel__expert_dispatch="node"), 2,
     ["parallel.expert_dispatch = 'node'", "expert_tensor_parallel = false"]),
    (dict(parallel__expert_dispatch="nodes"), 2, ["parallel.expert_dispatch", "'choice', 'rank' or 'node'"]),
])
def test_config_errors_are_one_line(over, world, words):
    data = _moe_cfg(**over)
    if data["model"].get("experts", 0) is None:
        data["model"] = {k: v for k, v in data["model"].items() if k != "experts"}
    with pytest.raises(ConfigError) as err:
        parse_config(data).check_layout(world)
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_the_drop_policy_reaches_every_moe_layer():
    from podscale.models.gpt_moe import GPTMoE
    from podscale.tasks.gpt_moe import gpt_moe_config
    model = GPTMoE(gpt_moe_config(parse_config(_moe_cfg(model__drop_policy="priority", model__moe_every=1))))
    assert [b.moe.drop_policy for b in model.blocks.values()] == ["priority", "priority"]
    assert GPTMoE(gpt_moe_config(parse_config(_moe_cfg()))).blocks["1"].moe.drop_policy == "position"


def test_good_config_has_dp_times_ep_data_ranks():
    cfg = parse_config(_moe_cfg(parallel__nproc=4))
    cfg.check_layout(4)
    assert (cfg.dp, cfg.data_ranks, cfg.grad_accum) == (2, 4, 1)


# ---------------------------------------------------------------------------------------------------
# expert parallelism against one process


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


def _same_routing(ours: list[dict], ref: list[dict], label: str, ep: int):
    assert len(ours) == len(ref), label
    for step, (m, r) in enumerate(zip(ours, ref)):
        assert m.keys() == r.keys(), label
        for k, v in r.items():
            if k.endswith("peak_rank_load"):
                # the busiest rank's rows over the mean, a property of the layout (exact figures: the
                # no-hang runs of tests/test_experts.py): at most every choice of its ep group
                assert 0 < m[k] <= ep, f"{label} step {step + 1} {k}: {m[k]}"
            elif k.endswith(("aux_loss", "z_loss")):
                assert m[k] == pytest.approx(v, rel=1e-6), f"{label} step {step + 1} {k}"
            else:  # functions of the global integer counts: exactly equal
                assert m[k] == v, f"{label} step {step + 1} {k}: {m[k]} vs {v}"


def _matches(ours: dict, ref: dict, label: str, norm_rel: float = 1e-9, param_rel: float | None = 1e-9,
             ep: int = 2):
    """Same routing statistics, losses, gradient norms, step-0 gradients and (unless ``param_rel`` is None)
    final parameters as the one-process run ``ref`` (``ep``: the layout's)."""
    _same_routing(ours["metrics"], ref["metrics"], label, ep)
    assert ours["losses"] == pytest.approx(ref["losses"], rel=1e-6), label
    assert ours["grad_norms"] == pytest.approx(ref["grad_norms"], rel=norm_rel), label
    if ours["grads"] is not None:
        for name, g in ours["grads"].items():
            assert _rel(g, ref["grads"][name]) <= 1e-9, f"{label} grad {name}"
    if "params" in ours and param_rel is not None:
        for name, p in ours["params"].items():
            assert _rel(p, ref["params"][name]) <= param_rel, f"{label} param {name}"


def _jobs(dp: int, ep: int, tmp: Path) -> list[dict]:
    return [dict(mode=m, dp=dp, ep=ep, steps=STEPS) for m in W.MODES]


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("moe_ckpt")


@pytest.fixture(scope="module")
def ep2(ckpt_root):
    """ep = 2 on 2 ranks: the three routing modes; top-2 saving a checkpoint after step CKPT_AT; ZeRO-1
    resuming that checkpoint for one step; LAMB and LARS under ZeRO-1; LAMB and LARS under ZeRO-1 at tp = 2
    with the experts' width split over tp."""
    first = str(ckpt_root / "ep2" / f"step_{CKPT_AT:08d}")
    jobs = _jobs(1, 2, ckpt_root) + [
        dict(mode="top2", dp=1, ep=2, steps=CKPT_AT + 2, save_at=CKPT_AT, save_root=str(ckpt_root / "ep2")),
        dict(mode="top2", dp=1, ep=2, steps=CKPT_AT + 1, stage=1, load=first)] + [
        dict(mode="top2", dp=1, ep=2, steps=TRUST_STEPS, stage=1, optimizer=o) for o in ("lamb", "lars")] + [
        dict(mode="top2", dp=1, ep=1, tp=2, steps=TRUST_STEPS, stage=1, optimizer=o, etp=True, lr=lr)
        for o, lr in SPLIT_TRUST_LR.items()]
    return launch(W.run_jobs, (jobs,), nproc=2)


@pytest.fixture(scope="module")
def single(ep2, ckpt_root):
    """One process: the three modes, then the ep=2 checkpoint continued for one step and saved."""
    mesh = Mesh.build()
    out = {m: W.run_job(dict(mode=m, dp=1, ep=1, steps=STEPS), mesh) for m in W.MODES}
    for o in ("lamb", "lars"):
        out[o] = W.run_job(dict(mode="top2", dp=1, ep=1, steps=TRUST_STEPS, stage=1, optimizer=o), mesh)
    out["lars", SPLIT_TRUST_LR["lars"]] = W.run_job(dict(mode="top2", dp=1, ep=1, steps=TRUST_STEPS, stage=1,
                                                         optimizer="lars", lr=SPLIT_TRUST_LR["lars"]), mesh)
    out["resumed"] = W.run_job(dict(mode="top2", dp=1, ep=1, steps=CKPT_AT + 1, save_at=CKPT_AT + 1,
                                    save_root=str(ckpt_root / "ep1"),
                                    load=str(ckpt_root / "ep2" / f"step_{CKPT_AT:08d}")), mesh)
    return out


@pytest.fixture(scope="module")
def ep4(single, ckpt_root):
    """4 ranks: dp = 2 x ep = 2 with top-2, replicated and ZeRO-3 (the 4-rank layout, once), then ep = 4 under
    ZeRO-3 continuing the ep=1 checkpoint for one step."""
    jobs = [dict(mode="top2", dp=2, ep=2, steps=STEPS), dict(mode="top2", dp=2, ep=2, steps=STEPS, stage=3),
            dict(mode="top2", dp=1, ep=4, steps=CKPT_AT + 2, stage=3,
                 load=str(ckpt_root / "ep1" / f"step_{CKPT_AT + 1:08d}")),
            dict(mode="bias", dp=2, ep=2, steps=STEPS, stage=3)]
    return launch(W.run_jobs, (jobs,), nproc=4)


def test_ep2_matches_one_process_for_every_routing_mode(ep2, single):
    """top-1, top-2, dropless, a shared expert, DeepSeek-V3's balance biases (which the task steps after
    every step from the global demand: the same biases, so the same routing, as one process), and its gating
    (sigmoid scores, a token's experts from its best group: here one rank's experts)."""
    for i, mode in enumerate(W.MODES):
        for rank, res in ep2.items():
            _matches(res[i], single[mode], f"ep=2 {mode} rank {rank}")
            assert res[i]["biases"].keys() == single[mode]["biases"].keys()
            for name, b in res[i]["biases"].items():
                assert torch.equal(b, single[mode]["biases"][name]) and b.abs().sum() > 0, (mode, rank, name)
        assert bool(single[mode]["biases"]) == (mode in ("bias", "v3")), mode
        dropped = [m["blocks.0/dropped_share"] for m in single[mode]["metrics"]]
        assert (max(dropped) == 0) == (mode == "dropless"), (mode, dropped)  # capacity binds where it should
    # each rank holds its own half of the experts; together every expert once
    held = [set(k for k in res[0]["held"] if ".experts." in k) for res in ep2.values()]
    assert not held[0] & held[1]
    assert held[0] | held[1] == {k for k in single["top1"]["params"] if ".experts." in k}


def test_lamb_and_lars_trust_ratios_under_ep2_match_one_process(ep2, single):
    """ZeRO-1 at ep = 2: a dense tensor's trust-ratio norms are summed over dp x ep (its shards), an expert's
    over dp only (each ep rank holds other experts).  Against ZeRO-1 on one process (whose per-tensor
    ratios tests/test_zero_lamb.py checks): same routing, losses 1e-6, gradient norms 2e-5 and parameters
    after 4 steps 2.5e-5 relative (fp32 compute; measured 6.5e-6 for LAMB, while summing the dense norms
    over dp only, as before, left them 9.2e-5 apart)."""
    for i, o in enumerate(("lamb", "lars")):
        for rank, res in ep2.items():
            _matches(res[len(W.MODES) + 2 + i], single[o], f"ep=2 ZeRO-1 {o} rank {rank}", norm_rel=2e-5,
                     param_rel=2.5e-5)


@pytest.mark.parametrize("i,optimizer", [(0, "lamb"), (1, "lars")])
def test_lamb_and_lars_trust_ratios_under_tp2_with_split_experts_match_one_process(ep2, single, i, optimizer):
    """ZeRO-1 LAMB and LARS at tp = 2 with the experts' width split over tp: a trust ratio is a whole tensor's, so the
    squared norms of a tensor split over tp (attention, the split experts' parts) are summed over tp too,
    while a tensor each tp rank holds whole (layer norms, routers, ``b_proj``) counts once (without the tp sum
    the routing parts from one process's by step 3; LARS runs at :data:`SPLIT_TRUST_LR`, a rate at which its
    ratios without the tp sum move the run off one process's).  Parameters within 2.5e-5 of one process's, except the
    attention's key bias: its true gradient is zero (a softmax does not see a shift shared by every key), so
    it holds only fp32 rounding noise, different under tp, which the optimizer's trust-ratio-scaled step turns
    into updates of ~1e-7: it is checked to stay that small."""
    ref = single[optimizer] if optimizer == "lamb" else single[optimizer, SPLIT_TRUST_LR[optimizer]]
    n = ref["params"]["blocks.0.attn.qkv.bias"].numel() // 3
    for rank, res in ep2.items():
        label = f"tp=2 split ZeRO-1 {optimizer} rank {rank}"
        ours = res[len(W.MODES) + 4 + i]
        _matches(ours, ref, label, norm_rel=2e-5, param_rel=None, ep=1)
        for name, p in ours["params"].items():
            q = ref["params"][name]
            if name.endswith("attn.qkv.bias"):
                for part in (slice(0, n), slice(2 * n, 3 * n)):           # the query and value biases
                    assert _rel(p[part], q[part]) <= 2.5e-5, f"{label} param {name}"
                assert max(float(p[n:2 * n].abs().max()), float(q[n:2 * n].abs().max())) < 1e-5, (label, name)
            else:
                assert _rel(p, q) <= 2.5e-5, f"{label} param {name}"


def test_dp2_ep2_matches_one_process_replicated_and_zero3(ep4, single):
    """ZeRO-3 (dense parameters sharded over dp x ep = 4 ranks, experts over dp = 2; top-2, and top-2 with
    balance biases) computes in fp32: the same routing as the fp64 run, losses within 1e-6 and gradient norms within 2e-5 (measured: 1e-7 and
    6e-6, the fp32 forward's own distance from fp64)."""
    for rank, res in ep4.items():
        _matches(res[0], single["top2"], f"dp=2 ep=2 rank {rank}")
        _matches(res[1], single["top2"], f"ZeRO-3 dp=2 ep=2 rank {rank}", norm_rel=2e-5)
        # with balance biases: the fp32 run routes as the fp64 one, so its biases step identically
        _matches(res[3], single["bias"], f"ZeRO-3 dp=2 ep=2 biases rank {rank}", norm_rel=2e-5)
        for name, b in res[3]["biases"].items():
            assert torch.equal(b.double(), single["bias"]["biases"][name].double()), (rank, name)
        assert res[3]["biases"].keys() == single["bias"]["biases"].keys()


def test_checkpoint_moves_from_ep2_to_ep1_to_ep4_with_optimizer_state(ep2, single, ep4):
    """The ep=2 run went on for two steps after saving; the ep=1 run resumed from its checkpoint and the
    ep=4 run (ZeRO-3: a stage change too) from ep=1's; ZeRO-1 at ep=2 resumed the ep=2 checkpoint: each
    continued step has the loss the ep=2 run had (optimizer state included: AdamW's moments decide the
    update; the checkpoint holds every expert under its global id)."""
    ep2_losses = ep2[0][len(W.MODES)]["losses"]  # steps 1 .. CKPT_AT + 2
    resumed = single["resumed"]["losses"]              # step CKPT_AT + 1
    assert resumed == pytest.approx([ep2_losses[CKPT_AT]], rel=1e-6)
    for rank, res in ep2.items():
        assert res[len(W.MODES) + 1]["losses"] == pytest.approx([ep2_losses[CKPT_AT]], rel=1e-6), rank
    for rank, res in ep4.items():
        assert res[2]["losses"] == pytest.approx([ep2_losses[CKPT_AT + 1]], rel=1e-6), rank


# ---------------------------------------------------------------------------------------------------
# podscale train end to end


def _train_toml(tmp_path: Path, name: str, steps: int, model: str, parallel: str) -> str:
    """A `podscale train` config of the 2-block GPT-MoE (4 experts, one MoE block) on Tiny Shakespeare,
    global batch 4 in micro-batches of 2; ``model`` and ``parallel``: more TOML lines of those sections."""
    return f"""
[run]
name = "{name}"
out_dir = "{tmp_path / 'runs'}"
steps = {steps}
log_every = 1
sample_tokens = 0
[model]
kind = "gpt-moe"
n_layer = 2
n_head = 2
n_embd = 32
block_size = 32
experts = 4
moe_every = 2
{model}
[data]
path = "{shakespeare()}"
[parallel]
nproc = 2
{parallel}
[train]
global_batch = 4
micro_batch = 2
"""


def test_podscale_train_logs_and_plots_routing_metrics_and_exports_one_process_model(tmp_path, capfd):
    cfg = tmp_path / "moe.toml"
    cfg.write_text(_train_toml(tmp_path, "moe", 3, "dropless = true\ndropless_peak_load = 1.0", "ep = 2"))
    capfd.readouterr()
    assert main(["train", str(cfg)]) == 0
    said = capfd.readouterr().out   # the workers write to this process's descriptors
    run = tmp_path / "runs" / "moe"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        t = row["task"]
        assert set(t) == {f"blocks.1/{k}" for k in ("dropped_share", "load_min", "load_max", "load_entropy",
                                                    "aux_loss", "z_loss", "peak_rank_load")}
        assert 0 <= t["blocks.1/load_min"] <= 0.25 <= t["blocks.1/load_max"] <= 1
        assert 0 < t["blocks.1/load_entropy"] <= 1 and t["blocks.1/dropped_share"] == 0
        # the busiest rank's rows over its even share: above 0, at most every choice on one of 2 ranks (random
        # routing skips some second choices, so it may sit under 1)
        assert 0 < t["blocks.1/peak_rank_load"] <= 2
    # above the dropless_peak_load the planner was told: said once at the end, with the figure to plan with
    peak = max(row["task"]["blocks.1/peak_rank_load"] for row in rows)
    warned = [line for line in said.splitlines() if "model.dropless_peak_load = 1," in line]
    assert len(warned) == (peak > 1.0), said
    if peak > 1.0:
        assert f"set it to {peak:.3g} " in warned[0] and warned[0].startswith("podscale: blocks.1: ")
    assert main(["report", str(run)]) == 0
    assert (run / "task.png").stat().st_size > 0  # the routing series, plotted over the steps
    out = tmp_path / "model.pt"
    assert main(["export", str(run), str(out)]) == 0
    blob = torch.load(out, weights_only=True)
    from podscale.models.gpt_moe import GPTMoE, GPTMoEConfig
    model = GPTMoE(GPTMoEConfig(**blob["model_config"]))
    model.load_state_dict(blob["model"])  # every expert of both ranks, under its global id
    assert blob["task"] == "podscale.tasks.gpt_moe:GPTMoETask"


@pytest.mark.parametrize("key", ["fold_tp_into_ep", "expert_tensor_parallel"])
def test_podscale_train_resumes_and_exports_experts_folded_or_split_over_tp(tmp_path, capfd, key):
    """``parallel.fold_tp_into_ep`` on tp = 2 (ep = 1): each tp rank holds half the experts; with
    ``parallel.expert_tensor_parallel`` half of each expert's width.  Yet the run resumes its own checkpoint
    (the trainer compares it with the one-process model's names and shapes, not the rank's) and exports
    every expert whole.  With DeepSeek-V3's balance biases (``model.bias_balancing``): the model is built on
    the meta device as the trainer builds it, its biases (buffers) materialised and moved after every step,
    saved, resumed and exported."""
    cfg = tmp_path / "fold.toml"
    model = "bias_balancing = true\nbias_update_rate = 0.01\naux_loss_coef = 0.0"
    parallel = f"tp = 2\n{key} = true"
    cfg.write_text(_train_toml(tmp_path, "fold", 2, model, parallel))
    assert main(["train", str(cfg)]) == 0
    cfg.write_text(_train_toml(tmp_path, "fold", 3, model, parallel))
    capfd.readouterr()
    assert main(["train", str(cfg), "--resume"]) == 0
    said = capfd.readouterr().out
    assert "resumed from step_00000002" in said and "no earlier checkpoint is usable" not in said, said
    # the run's description says where the experts live
    assert {"fold_tp_into_ep": "(top-2, sharded over ep x tp)",
            "expert_tensor_parallel": "(top-2, each split over tp (expert tensor parallelism))"}[key] in said, said
    out = tmp_path / "model.pt"
    assert main(["export", str(tmp_path / "runs" / "fold"), str(out)]) == 0
    names = torch.load(out, weights_only=True)["model"]
    assert {n for n in names if n.startswith("blocks.1.moe.experts.") and n.endswith("w_fc")} == \
        {f"blocks.1.moe.experts.{e}.w_fc" for e in range(4)}
    for e in range(4):   # whole experts (d = 32, hidden 4 x 32), whichever way the ranks held them
        shapes = [tuple(names[f"blocks.1.moe.experts.{e}.{leaf}"].shape) for leaf in ("w_fc", "b_fc", "w_proj",
                                                                                       "b_proj")]
        assert shapes == [(32, 128), (128,), (128, 32), (32,)], (e, shapes)
    bias = names["blocks.1.moe.router.selection_bias"]   # three sign steps of 0.01 each
    assert bias.abs().max() > 0 and torch.allclose(bias / 0.01, (bias / 0.01).round())


def test_podscale_train_with_the_rank_dispatch_trains_as_the_choice_dispatch(tmp_path, capfd):
    """``parallel.expert_dispatch = "rank"`` at ep = 2, top-2 with capacity: the trainer builds the MoE layers
    with the per-rank dispatch (its description says so) and the losses are the per-choice dispatch's (the same
    routing; a token's outputs summed in the same order).  The dispatch is no part of a checkpoint: each run
    resumes under the other dispatch, and their next steps' losses agree."""
    model = "top_k = 2\nrandom_routing = false"
    losses = {}
    for dispatch in ("choice", "rank"):
        cfg = tmp_path / f"{dispatch}.toml"
        cfg.write_text(_train_toml(tmp_path, dispatch, 3, model, f"ep = 2\nexpert_dispatch = '{dispatch}'"))
        capfd.readouterr()
        assert main(["train", str(cfg)]) == 0
        said = capfd.readouterr().out
        assert ("(top-2, tokens sent once a rank)" in said) == (dispatch == "rank"), said
        rows = (tmp_path / "runs" / dispatch / "metrics.jsonl").read_text().splitlines()
        losses[dispatch] = [json.loads(line)["loss"] for line in rows]
    assert len(losses["rank"]) == 3 and losses["rank"] == pytest.approx(losses["choice"], rel=1e-6)
    for run, other in (("choice", "rank"), ("rank", "choice")):
        cfg = tmp_path / f"{run}.toml"
        cfg.write_text(_train_toml(tmp_path, run, 4, model, f"ep = 2\nexpert_dispatch = '{other}'"))
        capfd.readouterr()
        assert main(["train", str(cfg), "--resume"]) == 0
        assert "resumed from step_00000003" in capfd.readouterr().out
        rows = (tmp_path / "runs" / run / "metrics.jsonl").read_text().splitlines()
        losses[run] = [json.loads(line)["loss"] for line in rows]
    assert len(losses["rank"]) == 4 and losses["rank"][-1] == pytest.approx(losses["choice"][-1], rel=1e-6)


def _first_loss(run: Path) -> float:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]


def test_init_from_fine_tunes_at_another_layout_and_upcycles_a_dense_gpt(tmp_path, capfd):
    """``train.init_from``: a dense GPT trained 2 steps at dp = 2 starts a run of the same model at tp = 2
    (DCP reads the model tensors into the other layout; optimizer, data and step afresh), whose first loss is
    the trained weights' loss on the first batch.  A GPT-MoE of the same trunk at ep = 2, top-2 and dropless
    (every token's gates sum to one, nothing dropped), without aux and z losses, upcycled from the same
    checkpoint, computes the same function before its first step: the same first loss (fp32, the experts'
    GELU evaluated differently: 1e-5); again at tp = 2 with expert tensor parallelism.  A mismatched trunk is one line before any worker
    starts."""
    dense = _train_toml(tmp_path, "dense", 2, "", "").replace("gpt-moe", "gpt").replace(
        "experts = 4\nmoe_every = 2\n", "") + "warmup_steps = 0\nlr = 0.01\n"
    cfg = tmp_path / "dense.toml"
    cfg.write_text(dense)
    assert main(["train", str(cfg)]) == 0
    source = tmp_path / "runs" / "dense"
    cfg.write_text(dense.replace('name = "dense"', 'name = "tuned"').replace("steps = 2", "steps = 1")
                   .replace("nproc = 2\n", f"nproc = 2\ntp = 2\n[train]\ninit_from = '{source}'\n", 1)
                   .replace("[train]\nglobal_batch", "global_batch"))
    capfd.readouterr()
    assert main(["train", str(cfg)]) == 0
    assert f"initialised with the weights of {source / 'checkpoints' / 'step_00000002'}" in capfd.readouterr().out
    tuned = _first_loss(tmp_path / "runs" / "tuned")
    assert tuned < _first_loss(source) - 0.1        # two steps of training went into it, not a fresh start
    moe = tmp_path / "moe.toml"
    model = ("top_k = 2\ndropless = true\nrandom_routing = false\naux_loss_coef = 0.0\nz_loss_coef = 0.0\n"
             "router_score = 'sigmoid'")
    text = _train_toml(tmp_path, "upcycled", 1, model, f"ep = 2\n[train]\ninit_from = '{source}'").replace(
        "[train]\nglobal_batch", "global_batch")
    moe.write_text(text)
    capfd.readouterr()
    assert main(["train", str(moe)]) == 0
    assert "initialised with weights upcycled from the dense GPT" in capfd.readouterr().out
    assert _first_loss(tmp_path / "runs" / "upcycled") == pytest.approx(tuned, rel=1e-5)
    # at tp = 2 with the experts' width split too, each rank's share of a tensor is cut out of the whole one
    # (sharded checkpoint tensors: attention and expert parts)
    moe.write_text(text.replace('name = "upcycled"', 'name = "upcycled-tp"').replace(
        "ep = 2", "tp = 2\nexpert_tensor_parallel = true"))
    assert main(["train", str(moe)]) == 0
    assert _first_loss(tmp_path / "runs" / "upcycled-tp") == pytest.approx(tuned, rel=1e-5)
    # another trunk: one line, no worker started, no run directory made
    moe.write_text(text.replace('name = "upcycled"', 'name = "wide"').replace("n_embd = 32", "n_embd = 64"))
    capfd.readouterr()
    assert main(["train", str(moe)]) == 2
    err = capfd.readouterr().err.strip()
    assert err.startswith("podscale: error: train.init_from: the dense GPT in") and "n_embd=32" in err, err
    assert "\n" not in err and not (tmp_path / "runs" / "wide").exists()
    # the same model with other shapes (a GPT-MoE checkpoint of 4 experts for one of 8): one line too
    moe.write_text(text.replace('name = "upcycled"', 'name = "eight"').replace("experts = 4", "experts = 8")
                   .replace(str(source), str(tmp_path / "runs" / "upcycled")))
    capfd.readouterr()
    assert main(["train", str(moe)]) == 2
    err = capfd.readouterr().err.strip()
    assert err.startswith("podscale: error: train.init_from: ") and "has no blocks.1.moe.experts.4.b_fc" in err, err
    assert "\n" not in err and not (tmp_path / "runs" / "eight").exists()


def test_init_from_switches_bias_balancing_on_with_the_biases_from_zero(tmp_path, capfd):
    """``train.init_from`` a GPT-MoE trained without ``model.bias_balancing`` into the same model with it: the
    checkpoint lacks the routers' selection biases, which start at zero, so the first step routes as the
    checkpoint's model does: its first loss is that of the same init_from without bias balancing.  Another
    model's checkpoint is still one line before any worker starts."""
    cfg = tmp_path / "moe.toml"
    text = _train_toml(tmp_path, "source", 2, "", "ep = 2") + "warmup_steps = 0\nlr = 0.01\n"
    cfg.write_text(text)
    assert main(["train", str(cfg)]) == 0
    source = tmp_path / "runs" / "source"
    firsts = {}
    for name, model in (("same", ""), ("balanced", "bias_balancing = true")):
        cfg.write_text(_train_toml(tmp_path, name, 1, model, f"ep = 2\n[train]\ninit_from = '{source}'").replace(
            "[train]\nglobal_batch", "global_batch"))
        capfd.readouterr()
        assert main(["train", str(cfg)]) == 0
        out = capfd.readouterr().out
        assert ("balance biases from zero" in out) == (name == "balanced"), out
        firsts[name] = _first_loss(tmp_path / "runs" / name)
    assert firsts["balanced"] == pytest.approx(firsts["same"], rel=1e-6)
    assert firsts["same"] < _first_loss(source) - 0.05      # the trained weights, not a fresh start
    cfg.write_text(_train_toml(tmp_path, "eight", 1, "bias_balancing = true", f"ep = 2\n[train]\ninit_from = "
                               f"'{source}'").replace("[train]\nglobal_batch", "global_batch")
                   .replace("experts = 4", "experts = 8"))
    capfd.readouterr()
    assert main(["train", str(cfg)]) == 2
    err = capfd.readouterr().err.strip()
    assert err.startswith("podscale: error: train.init_from: ") and "blocks.1.moe.experts.4" in err, err
    assert "\n" not in err and not (tmp_path / "runs" / "eight").exists()


def test_layout_auto_plans_the_gpt_moe_with_expert_parallel_layouts():
    """``--layout auto`` describes the GPT-MoE to the planner (experts, top_k, moe_every, capacity) and
    searches ep too; every layout it returns is one the trainer accepts."""
    from podscale.plan.auto import choose_layout, gpt_of
    cfg = parse_config(_moe_cfg(model__top_k=2, model__moe_every=2, model__capacity_factor=1.5,
                                parallel__ep=1))
    model = gpt_of(cfg)
    assert (model.experts, model.top_k, model.moe_every, model.capacity_factor) == (4, 2, 2, 1.5)
    assert not model.dropless
    drop = gpt_of(parse_config(_moe_cfg(model__dropless=True, model__dropless_peak_load=1.7, parallel__ep=1)))
    assert (drop.dropless, drop.dropless_peak_load, drop.expert_load(2), drop.expert_load(4)) == (True, 1.7, 1.7, 1.7)
    # every layout the search ranks (on this tiny model they differ by microseconds: a top few would test the
    # ranking, not the search)
    choice = choose_layout(cfg, 2, "dgx-a100-80g", keep=1000)
    eps = {o for _, over in choice.ranked for o in over if o.startswith("parallel.ep=")}
    assert eps == {"parallel.ep=1", "parallel.ep=2"}, eps
    # the GPT-MoE runs under pipelines, tensor and sequence parallelism (tests/test_gpt_moe_layouts.py): the
    # search returns them, and only layouts the config accepts
    assert any("parallel.pp=2" in over for _, over in choice.ranked)
    assert any("parallel.sequence_parallel=true" in over for _, over in choice.ranked)
    from podscale.config import apply_override
    for _, over in choice.ranked:
        data = cfg.model_dump(mode="json")
        for item in over:
            apply_override(data, item)
        parse_config(data).check_layout(2)
