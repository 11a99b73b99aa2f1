"""The GPT-MoE task (``[model] kind = "gpt-moe"``): the byte-level GPT with a GShard mixture-of-experts
feed-forward in every ``moe_every``-th block (:class:`~podscale.models.gpt_moe.GPTMoE`; Lepikhin et al. 2020,
Fedus et al. 2021), experts sharded over the mesh's ``ep`` axis.

It is the GPT task (same corpus, loader, evaluation, sampling, throughput unit) with four differences:

* the model is built per rank (:meth:`GPTMoETask.build_model_on`): on an ep layout a rank builds only its
  experts, each named by its global expert id and initialised to its single-process value, so checkpoints
  and ``podscale export`` carry the same names at every ep size (export builds the one-process model);
* the loss is the cross-entropy plus every MoE layer's ``aux_loss_coef * aux + z_loss_coef * z`` (the model
  adds them); with ``model.aux_loss_scope = "global"`` the load-balancing loss counts its first-choice shares
  over the whole micro-batch of every data-, expert- and tensor-parallel rank (Qiu et al. 2025; Megatron-core's
  ``"global_aux_loss"``), so a layout that runs a step as one micro-batch has the loss one process has on
  the same global batch (with several micro-batches the counts are each micro-batch's, summed over the ranks,
  as Megatron-core takes them); with ``"global_step"`` they are also summed over the step's micro-batches so
  far (the paper's buffer for gradient accumulation: micro-batch m's shares from micro-batches 1..m), a sum the
  engine empties at every step's start (:class:`~podscale.parallel.model_protocols.StepState`), so a layout has
  the loss one process has running the same global micro-batches;
* :meth:`GPTMoETask.ep_sharded_parameters` names the experts, which the data-parallel strategies replicate
  and reduce over dp only (dense parameters over dp x ep);
* :meth:`GPTMoETask.step_metrics` reports per step and MoE layer the dropped share of the choices, the
  per-expert load (min, max, entropy over log E), the mean aux and z losses, summed over the data ranks,
  and the busiest ep rank's rows in one forward over the mean (``peak_rank_load``); a dropless run that
  exceeds the ``model.dropless_peak_load`` the planner priced says so when it finishes.

Pipelines (``pp``: GPipe, 1F1B and interleaved 1F1B): the GPT-MoE is cut into stages as the GPT is (each
stage, or virtual stage, a :class:`GPTMoE` holding some blocks); a stage's MoE losses join the backward
there (see :meth:`podscale.parallel.pipeline.schedule.PipelineParallel.forward_backward`) and the ep and tp
collectives run inside each chunk: the ep and tp peers of a stage share its pp coordinate, hence its
schedule, so they run the same micro-batches' forwards and backwards on the same chunks in the same order.
Tensor parallelism (``tp``, alone or inside each pipeline stage) shards the attention and the dense MLPs;
an MoE layer splits its samples over tp, and under sequence parallelism first turns the sequence shards it
receives into whole sequences of its share of the samples (see
:meth:`podscale.parallel.moe.MoELayer.forward`), so routing is the one-process routing in every layout.
With ``parallel.fold_tp_into_ep`` the experts are sharded over ep x tp instead of held by every tp rank
(MoE parallel folding), each rank's model built with its own; with ``parallel.expert_tensor_parallel`` each
expert's hidden width is split over tp (Megatron-core's expert tensor parallelism), each rank's model built
with its part of every expert of its ep rank.
``train.compile`` compiles the blocks around the MoE layers, which run eagerly between the compiled pieces
(see :mod:`podscale.train.compile`).
"""
from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from podscale.models.gpt_moe import GPTMoE, GPTMoEConfig, MoEMetrics
from podscale.parallel.moe import MoEStats, expert_parameters, token_axis_groups
from podscale.runtime import comm
from podscale.tasks.base import WeightConversion
from podscale.tasks.gpt import GPTTask
from podscale.train.checkpoint import ModelWeights, task_class_name, task_name


def gpt_moe_config(cfg) -> GPTMoEConfig:
    """The :class:`GPTMoEConfig` of a config's ``[model]`` section (``kind = "gpt-moe"``)."""
    m = cfg.model
    return GPTMoEConfig(vocab_size=m.vocab_size, block_size=m.block_size, n_layer=m.n_layer, n_head=m.n_head,
                        n_embd=m.n_embd, dropout=m.dropout, bias=m.bias, experts=m.experts, top_k=m.top_k,
                        moe_every=m.moe_every, capacity_factor=m.capacity_factor,
                        eval_capacity_factor=m.eval_capacity_factor, dropless=m.dropless,
                        random_routing=m.random_routing, drop_policy=m.drop_policy, aux_loss_coef=m.aux_loss_coef,
                        aux_loss_scope=m.aux_loss_scope,
                        bias_balancing=m.bias_balancing, bias_update_rate=m.bias_update_rate,
                        z_loss_coef=m.z_loss_coef, expert_hidden=m.expert_hidden,
                        expert_recompute=m.expert_recompute, expert_kernel=m.expert_kernel,
                        shared_experts=m.shared_experts, router_score=m.router_score,
                        router_groups=m.router_groups, router_group_top_k=m.router_group_top_k,
                        router_scale=m.router_scale)


class Upcycling(WeightConversion):
    """Sparse upcycling (Komatsuzaki et al. 2023, "Sparse Upcycling: Training Mixture-of-Experts from Dense
    Checkpoints", section 2; Megatron-core's ``--moe-use-upcycling``): a GPT-MoE initialised from a dense
    GPT's checkpoint of the same trunk.  Every tensor the two models share by name (embeddings, attention,
    layer norms, the MLPs of the blocks that stay dense) is copied; every expert of an MoE block is a copy of
    that block's MLP (``w_fc = fc.weight^T``, ``w_proj = proj.weight^T``, the biases as they are); the routers
    (and their balance biases) keep their own initialisation.  With k > 1 the gates of a token sum to one,
    so before any training step the upcycled model computes the dense model's function wherever no choice is
    dropped (dropless: everywhere); with k = 1 each MLP output is scaled by its gate value (Switch's
    ``p_e``), as in the paper.  Experts must be as wide as the MLP (``expert_hidden = 4 n_embd``) and the
    model without shared experts.  Each rank reads only the tensors of its own layers, once each: a layer's
    experts are views of one transposed MLP."""

    #: an expert tensor's name -> the MoE block and the kind
    _EXPERT = re.compile(r"^(blocks\.\d+)\.moe\.experts\.\d+\.(w_fc|w_proj|b_fc|b_proj)$")
    #: expert kind -> (the dense MLP's tensor, transposed)
    _FROM = {"w_fc": ("mlp.fc.weight", True), "w_proj": ("mlp.proj.weight", True), "b_fc": ("mlp.fc.bias", False),
             "b_proj": ("mlp.proj.bias", False)}
    #: the trunk's hyper-parameters, which must be the dense model's
    TRUNK = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "bias")

    def __init__(self, source: ModelWeights, cfg: GPTMoEConfig):
        theirs, mine = source.model_config, asdict(cfg)
        for key in self.TRUNK:
            if theirs.get(key) != mine[key]:
                raise ValueError(f"train.init_from: the dense GPT in '{source.path}' has {key}={theirs.get(key)!r}, "
                                 f"this GPT-MoE model.{key}={mine[key]!r}: upcycling copies the trunk, "
                                 f"so set model.{key} = {theirs.get(key)!r}")
        if cfg.hidden != 4 * cfg.n_embd:
            raise ValueError(f"train.init_from: upcycling copies each MLP (width {4 * cfg.n_embd}) into the "
                             f"experts, which are model.expert_hidden={cfg.hidden} wide: set model.expert_hidden = "
                             f"{4 * cfg.n_embd} or remove it")
        if cfg.shared_experts:
            raise ValueError("train.init_from: upcycling a GPT-MoE with shared experts is not built: set "
                             "model.shared_experts = 0")
        self.source = source

    def _source_of(self, name: str) -> tuple[str, bool] | None:
        """(the dense tensor, transposed) that ``name`` starts from; None for a router's tensors."""
        m = self._EXPERT.match(name)
        if m:
            key, transposed = self._FROM[m.group(2)]
            return f"{m.group(1)}.{key}", transposed
        if name in self.source.shapes:
            return name, False
        if ".moe.router." in name:
            return None
        raise ValueError(f"train.init_from: the dense GPT in '{self.source.path}' has no tensor for {name}: "
                         "upcycle from a checkpoint of a GPT with this trunk")

    def tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        plan = {n: src for n in names if (src := self._source_of(n)) is not None}
        full = self.source.read(sorted({key for key, _ in plan.values()}))
        return {n: full[key].t() if transposed else full[key] for n, (key, transposed) in plan.items()}

    def describe(self) -> str:
        return f"upcycled from the dense GPT {self.source.path}"


class BalanceBiasesAdded(WeightConversion):
    """A GPT-MoE's checkpoint trained without ``model.bias_balancing``, into the same model with it (DeepSeek-V3's
    auxiliary-loss-free balancing switched on for fine-tuning): every tensor is the checkpoint's, and the routers'
    selection biases, which the checkpoint lacks, start at zero as in a fresh model, so the first step routes as
    the checkpoint's model does. Every other tensor must be there with this model's shape (one line naming the
    first that is not, before any is read)."""

    #: the tensors bias balancing adds to a GPT-MoE (:class:`~podscale.parallel.moe.gate.Router`'s buffer)
    _ADDED = re.compile(r"^blocks\.\d+\.moe\.router\.selection_bias$")

    def __init__(self, source: ModelWeights, task: "GPTMoETask"):
        shapes = {n: tuple(t.shape) for n, t in task.build_model().state_dict().items()}
        source.require_same_model(task_name(task), {n: s for n, s in shapes.items()
                                                    if not (self._ADDED.match(n) and n not in source.shapes)})
        self.source = source

    def tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        return self.source.read([n for n in names if n in self.source.shapes])

    def describe(self) -> str:
        return (f"the weights of {self.source.path}, the routers' balance biases from zero (it was trained without "
                "model.bias_balancing)")


def _moe_modules(model: nn.Module) -> list[GPTMoE]:
    """The GPTMoE ``model`` is, or under a pipeline the chunks of this rank (each a GPTMoE)."""
    return [m for m in model.modules() if isinstance(m, GPTMoE)]


def _gpt_moe(module: nn.Module) -> GPTMoE:
    if not isinstance(module, GPTMoE):
        raise TypeError(f"the GPT-MoE task trains a GPTMoE, got {type(module).__name__}")
    return module


class GPTMoETask(GPTTask):
    """The GPT-MoE: batches, loss and sampling are the GPT's; experts are sharded over ``ep``."""

    supports_tensor_parallel = True
    supports_pipeline = True
    supports_expert_parallel = True
    supports_compile = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.gpt = gpt_moe_config(cfg)
        #: the largest peak_rank_load of each MoE layer so far in this run
        self.peak_load: dict[str, float] = {}

    def build_model(self) -> nn.Module:
        """The single-process model (every expert), on the meta device (materialised by the strategy)."""
        with torch.device("meta"):
            return GPTMoE(self.gpt)

    def build_model_on(self, mesh) -> nn.Module:
        """This rank's model: the dense part and the experts of its ep coordinate (and tp coordinate, with
        ``parallel.fold_tp_into_ep``; its tp rank's part of each, with ``parallel.expert_tensor_parallel``)
        (meta device); its MoE layers told whether tensor parallelism will hand them sequence shards."""
        p = self.cfg.parallel
        with torch.device("meta"):
            return GPTMoE(self.gpt, mesh, p.sequence_parallel, p.fold_tp_into_ep, p.expert_tensor_parallel,
                          p.expert_dispatch)

    def model_config(self) -> dict:
        return asdict(self.gpt)

    def convert_weights(self, source: ModelWeights) -> WeightConversion | None:
        """A dense GPT's checkpoint is upcycled (:class:`Upcycling`); a GPT-MoE's trained without bias balancing
        starts this model's balance biases at zero (:class:`BalanceBiasesAdded`); any other is this model's own."""
        if source.task == task_class_name(GPTTask):
            return Upcycling(source, self.gpt)
        if self.gpt.bias_balancing and not source.model_config.get("bias_balancing", False):
            return BalanceBiasesAdded(source, self)
        return None

    def describe(self, model: nn.Module) -> str:
        m, g = _gpt_moe(model), self.gpt
        shared = f" + {g.shared_experts} shared" if g.shared_experts else ""
        p = self.cfg.parallel
        where = ", sharded over ep x tp" if p.fold_tp_into_ep else \
            ", each split over tp (expert tensor parallelism)" if p.expert_tensor_parallel else ""
        if p.expert_dispatch != "choice" and p.ep > 1:
            where += f", tokens sent once a {p.expert_dispatch}"
        return (f"{g.experts} experts x {sum(g.is_moe(i) for i in range(g.n_layer))} MoE layers (top-{g.top_k}"
                f"{shared}{where}), {m.active_params_per_token() / 1e6:.2f}M active params per token, global "
                f"batch {self.cfg.train.global_batch} x {g.block_size} tokens")

    def ep_sharded_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        return expert_parameters(model)

    def after_step(self, model: nn.Module, mesh) -> None:
        """With ``model.bias_balancing``: DeepSeek-V3's bias step of every MoE layer this rank holds, from the
        step's demand per expert summed over the data ranks (:meth:`GPTMoE.update_balance_bias`)."""
        if self.gpt.bias_balancing:
            for m in _moe_modules(model):
                m.update_balance_bias(mesh, token_axis_groups(mesh))

    def step_metrics(self, model: nn.Module, mesh) -> dict[str, float]:
        """Routing statistics of the step's training forwards, summed over dp x ep (and tp, whose ranks
        route different samples), every MoE layer's on every rank (collective).  ``model``: the GPTMoE or,
        under a pipeline, this rank's chunks (each a GPTMoE holding some layers); the other stages'
        layers arrive by a sum over pp of a fixed (layer, figure) table, zero where a stage lacks a layer."""
        metrics = MoEMetrics()
        for m in _moe_modules(model):
            metrics.take(m.moe_metrics)
        summaries = metrics.pop(mesh, token_axis_groups(mesh))
        if mesh.size("pp") > 1:
            names = [f"blocks.{i}" for i in range(self.gpt.n_layer) if self.gpt.is_moe(i)]
            table = torch.zeros(len(names), len(MoEStats.SUMMARY_KEYS), dtype=torch.float64, device=mesh.device)
            for name, summary in summaries.items():
                table[names.index(name)] = torch.tensor([summary[k] for k in MoEStats.SUMMARY_KEYS],
                                                        dtype=torch.float64)
            comm.all_reduce(table, mesh, "pp")
            summaries = {name: dict(zip(MoEStats.SUMMARY_KEYS, row.tolist())) for name, row in zip(names, table)}
        out = {}
        for layer, summary in summaries.items():
            for k, v in summary.items():
                out[f"{layer}/{k}"] = v
            self.peak_load[layer] = max(self.peak_load.get(layer, 0.0), summary["peak_rank_load"])
        return out

    def finish(self, engine, rank: int, run_dir: Path, say: Callable[[str], None]) -> dict[str, Any]:
        """The GPT's sample, and for a dropless model whose busiest ep rank ran more rows than the planner
        priced (``model.dropless_peak_load``) a line saying so, with the figure to plan with."""
        out = super().finish(engine, rank, run_dir, say)
        planned = self.cfg.model.dropless_peak_load
        if self.gpt.dropless and self.peak_load:
            layer, peak = max(self.peak_load.items(), key=lambda kv: kv[1])
            out["peak_rank_load"] = peak
            if peak > planned:
                say(f"podscale: {layer}: the busiest ep rank ran {peak:.3g}x the mean rows in one forward, more "
                    f"than model.dropless_peak_load = {planned:g}, which the planner prices expert memory and time "
                    f"at: set it to {peak:.3g} and plan again (podscale train --layout auto), or bound the load "
                    "with a capacity (model.dropless = false)")
        return out

    def flops_per_sample(self) -> float:
        """6 x active parameters per token (the k chosen experts, not all E) plus the attention and the
        output head (PaLM, App. B), times the sequence length."""
        g = self.gpt
        with torch.device("meta"):
            active = GPTMoE(g).active_params_per_token()
        per_token = 6 * active + 6 * g.vocab_size * g.n_embd + 12 * g.n_layer * g.n_embd * g.block_size
        return per_token * g.block_size
