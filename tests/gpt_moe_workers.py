"""Worker functions for the GPT-MoE task tests (a module of its own so spawned workers import it).

``run_jobs`` trains the GPT-MoE task through the trunk (``podscale.parallelize``: the engine, the
data-parallel strategy with its expert/dense split, AdamW, clipping) on several (dp, ep, ZeRO stage)
layouts in a row inside one process group, and reports per step what the single-process run must
reproduce.  The model is fp64 end to end (the GPT's fp32 cast of the loss swapped for an fp64 one), so the
few-ulp differences between layouts cannot flip a routing decision: routing statistics compare exactly.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.distributed._shard.sharded_tensor import ShardedTensor

import podscale
from podscale.config import parse_config
from podscale.models.gpt_moe import GPTMoE
from podscale.parallel.moe import MoELayer
from podscale.parallel.param_tags import tags
from podscale.parallel.tensor import unshard
from podscale.runtime.mesh import Mesh
from podscale.runtime.process import init_process
from podscale.tasks.gpt_moe import GPTMoETask
from podscale.train import checkpoint
from podscale.train.data import eval_batches, load_tokens, split_tokens

DATA = str(Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt")
MODES = {
    "top1": dict(top_k=1, capacity_factor=1.0, random_routing=False),
    "top2": dict(top_k=2, capacity_factor=1.25, random_routing=True),
    "dropless": dict(top_k=2, dropless=True, random_routing=False),
    # top-1 beside a shared expert (DeepSeekMoE; DeepSpeed-MoE's residual MoE): dense parameters in the MoE layer
    "shared": dict(top_k=1, capacity_factor=1.0, random_routing=False, shared_experts=1),
    # DeepSeek-V3's auxiliary-loss-free balancing: the selection biases move after every step and steer routing
    "bias": dict(top_k=2, capacity_factor=1.25, random_routing=False, aux_loss_coef=0.0, bias_balancing=True,
                 bias_update_rate=0.01),
    # DeepSeek-V3's gating: sigmoid affinities, the 8 experts in 2 groups (at ep = 2 a group is a rank's), a
    # token's two from its best group, gates scaled; with the balance biases and a small aux loss
    "v3": dict(top_k=2, capacity_factor=1.25, random_routing=False, aux_loss_coef=0.001, bias_balancing=True,
               bias_update_rate=0.01, router_score="sigmoid", router_groups=2, router_group_top_k=1,
               router_scale=2.5),
    # top-2 with the load-balancing loss's first-choice shares counted over the global batch (Qiu et al. 2025;
    # Megatron-core's global_aux_loss): all-reduced over the ranks that route other tokens, P_e each rank's own
    "global": dict(top_k=2, capacity_factor=1.25, random_routing=True, aux_loss_scope="global"),
    # the same shares summed over the micro-batches of the step so far (Qiu et al. 2025's buffer for gradient
    # accumulation): micro-batch m's f_e from micro-batches 1..m of every rank
    "global_step": dict(top_k=2, capacity_factor=1.25, random_routing=True, aux_loss_scope="global_step"),
}


class CrossEntropy64(nn.Module):
    """The GPT's loss without its cast to fp32, so an fp64 run stays fp64 end to end."""

    def forward(self, logits, targets):
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class GPTMoETask64(GPTMoETask):
    """The GPT-MoE task with the model built on the CPU in fp64 (each rank its own experts)."""

    def build_model_on(self, mesh) -> nn.Module:
        p = self.cfg.parallel
        model = GPTMoE(self.gpt, mesh, p.sequence_parallel, p.fold_tp_into_ep, p.expert_tensor_parallel).double()
        model.loss_fn = CrossEntropy64()
        return model


def config(mode: str, dp: int, ep: int, stage: int = 0, steps: int = 20, pp: int = 1, tp: int = 1,
           micro_batch: int | None = None, schedule: str = "1f1b", optimizer: str = "adamw",
           sequence_parallel: bool = False, virtual_stages: int = 1, n_layer: int = 2, compile: str | None = None,
           fold: bool = False, etp: bool = False, model: dict | None = None, lr: float = 3e-3,
           recompute: str = "none", dispatch: str = "choice"):
    """The test model on a (pp, dp, ep, tp) layout; ``micro_batch`` default: one micro-batch per step;
    ``compile``: a torch.compile backend for ``train.compile`` (None: eager); ``fold``:
    ``parallel.fold_tp_into_ep``; ``etp``: ``parallel.expert_tensor_parallel``; ``model``: more keys of the
    model section; ``lr``: the peak learning rate; ``recompute``: ``parallel.recompute``; ``dispatch``:
    ``parallel.expert_dispatch``."""
    return parse_config({
        "run": {"name": "moe", "steps": steps, "seed": 7},
        "model": {"kind": "gpt-moe", "n_layer": n_layer, "n_head": 2, "n_embd": 32, "block_size": 32, "experts": 8,
                  "moe_every": 1, "expert_hidden": 48, "aux_loss_coef": 0.01, "z_loss_coef": 0.001,
                  **MODES[mode], **(model or {})},
        "data": {"path": DATA},
        "parallel": {"nproc": pp * dp * ep * tp, "dp": dp, "ep": ep, "pp": pp, "tp": tp, "schedule": schedule,
                     "sequence_parallel": sequence_parallel, "virtual_stages": virtual_stages,
                     "fold_tp_into_ep": fold, "expert_tensor_parallel": etp, "recompute": recompute,
                     "expert_dispatch": dispatch},
        # (decay_steps fixed: a run resumed with fewer steps keeps the same learning-rate schedule)
        "train": {"global_batch": 8, "micro_batch": micro_batch or 8 // (dp * ep), "lr": lr, "warmup_steps": 2,
                  "decay_steps": 20, "grad_clip": 1.0, "compile": compile is not None,
                  "compile_backend": compile or "inductor"},
        "zero": {"stage": stage, "param_persistence_threshold": 100, "optimizer": optimizer},
    })


def run_job(job: dict, mesh: Mesh) -> dict:
    """One layout: ``job`` = mode, dp, ep, stage, steps; optionally ``load`` (a checkpoint folder to start
    from), ``save_at`` (a step after which to save under ``save_root``) and ``collapse`` (every router's
    weights zeroed before the first step: every token's scores tie, so all of them choose the same experts,
    those of ep rank 0, and every other rank's experts get no rows; replicated only), ``recompute``
    (``parallel.recompute``)."""
    cfg = config(job["mode"], job["dp"], job["ep"], job.get("stage", 0), job["steps"], job.get("pp", 1),
                 job.get("tp", 1), job.get("micro_batch"), job.get("schedule", "1f1b"), job.get("optimizer", "adamw"),
                 job.get("sp", False), job.get("virtual_stages", 1), job.get("n_layer", 2), job.get("compile"),
                 job.get("fold", False), job.get("etp", False), job.get("model"), job.get("lr", 3e-3),
                 job.get("recompute", "none"), job.get("dispatch", "choice"))
    task = GPTMoETask64(cfg)
    graphs = counters["stats"]["unique_graphs"]
    torch.manual_seed(cfg.run.seed)
    model = task.build_model_on(mesh)
    engine = podscale.parallelize(model, mesh, cfg, task)
    data_rank, data_ranks = mesh.local_rank(*mesh.data_axes), mesh.size(*mesh.data_axes)
    loader = task.train_data(data_rank, data_ranks)
    if job.get("collapse"):
        with torch.no_grad():
            for n, p in _named(engine, mesh):
                if ".moe.router." in n:
                    p.zero_()
    state = engine.model_state()
    out = {"losses": [], "grad_norms": [], "metrics": [], "grads": None, "held": sorted(state), "step_tokens": [],
           # the ranks a sharded checkpoint tensor's metadata names as holding its pieces
           "placements": {n: sorted({md.placement.rank() for md in t.metadata().shards_metadata})
                          for n, t in state.items() if isinstance(t, ShardedTensor)}}
    try:
        start = 0
        if job.get("load"):
            template = {"model": engine.model_state(), "optim": engine.optim_template()}
            meta, _ = checkpoint.load(Path(job["load"]), template, mesh.rank)
            engine.load_model_state(template["model"])
            engine.load_optim_state(template["optim"])
            engine.step_count = start = int(meta["step"])
            loader.load_state_dict(meta["loader"])
        elif job.get("stage", 0) == 0:
            # the gradients of the first batch, reduced (the data-parallel strategy's buckets), at step 0
            s = engine.strategy
            s.forward_backward(loader.next_step(), None, engine.loss_fn)
            s.finish_grad_sync()
            out["grads"] = _full(_named(engine, mesh), mesh, lambda p: p.grad)
            s.zero_grad()
            task.step_metrics(engine.model, mesh)   # (cleared: no balance-bias step for this pass)
            loader.consumed = 0
        for step in range(start, job["steps"]):
            res = engine.step(loader.next_step())
            task.after_step(engine.model, mesh)
            out["losses"].append(res.loss)
            out["grad_norms"].append(res.grad_norm)
            out["metrics"].append(task.step_metrics(engine.model, mesh))
            # the tokens each of this rank's MoE layers counted into its step sum ("global_step"; none otherwise)
            out["step_tokens"].append([int(m.step_counts.total[-1]) for m in engine.model.modules()
                                       if isinstance(m, MoELayer) and m.step_counts.total is not None])
            if job.get("save_at") == res.step:
                meta = {"step": res.step, "loader": loader.state_dict(), "task": "gpt-moe"}
                checkpoint.save(Path(job["save_root"]), res.step,
                                {"model": engine.model_state(), "optim": engine.optim_state()}, meta, {},
                                mesh.rank, keep=5)
        if job.get("eval"):
            # the same 8 validation sequences on every layout, each data rank its share as one batch
            val = split_tokens(load_tokens(DATA), cfg.data.val_fraction)[1]
            out["eval"] = engine.evaluate(eval_batches(val, cfg.model.block_size, 8, 1, data_rank, data_ranks))
        if job.get("sample"):
            # next-token logits of one sequence (sampling): fewer samples than tp ranks, so a tensor-
            # parallel MoE layer routes the whole sequence on every tp rank
            val = split_tokens(load_tokens(DATA), cfg.data.val_fraction)[1]
            out["next"] = engine.strategy.next_logits(val[None, :cfg.model.block_size].long()).double()
        out["compiled_graphs"] = counters["stats"]["unique_graphs"] - graphs  # (Dynamo traced; 0 when eager)
        # (a pipeline's strategy names its chunks' buffers by single-process name)
        buffers = engine.strategy.named_buffers() if mesh.size("pp") > 1 else engine.model.named_buffers()
        out["biases"] = {n: b.clone() for n, b in buffers if n.endswith("selection_bias")}
        if job.get("stage", 0) <= 1:  # (ZeRO-1's compute parameters are whole on every rank)
            out["params"] = _full(_named(engine, mesh), mesh, lambda p: p.detach())
            # the shared expert's tensors as this rank holds them (its tp part when its width is split)
            out["shared_held"] = {n: p.detach().clone() for n, p in _named(engine, mesh) if ".moe.shared." in n}
    finally:
        engine.close()
    return out


def _named(engine, mesh):
    """Parameters by single-process name (a pipeline's strategy names its chunks' parameters so)."""
    return engine.strategy.named_parameters() if mesh.size("pp") > 1 else engine.model.named_parameters()


def _full(named, mesh, value) -> dict[str, torch.Tensor]:
    """``value(p)`` of every parameter by its single-process name, tensor-parallel shards gathered
    (collective over tp); a pipeline's last-stage copy of the tied embedding is left out."""
    out = {}
    for n, p in named:
        if tags(p).pipeline_duplicate:
            continue
        v = value(p)
        layout = tags(p).tp_layout
        out[n] = (unshard(v, layout, mesh) if layout is not None and mesh.size("tp") > 1 else v).clone()
    return out


def run_jobs(jobs: list[dict]) -> list[dict]:
    """Every job on this process group (the meshes of each (pp, dp, ep, tp) shape built once)."""
    info = init_process(timeout_s=300)
    torch.set_num_threads(1)
    meshes: dict[tuple[int, ...], Mesh] = {}
    out = []
    for job in jobs:
        key = (job.get("pp", 1), job["dp"], job["ep"], job.get("tp", 1))
        if key not in meshes:
            meshes[key] = Mesh.build(info.device, pp=key[0], dp=key[1], ep=key[2], tp=key[3])
        out.append(run_job(job, meshes[key]))
    return out
