"""``--layout auto``: the fastest layout of a training config that fits the devices in use.

Like GShard's automatic sharding and DeepSpeed's autotuning, but by prediction rather than by trial:
every layout the planner can enumerate for the config's GPT, world size and global batch
(:func:`podscale.plan.search.candidate_layouts`: tp x pp x dp x ep (a GPT-MoE's experts, whether tp is
folded into ep or splits each expert's width, and its expert dispatch), ZeRO stage, optimizer offload,
micro-batch, recompute, sequence parallelism, schedule) is
predicted on the system (the calibrated ``local`` one by
default), the ones that do not fit are dropped, and the fastest that the trainer's own config validator
accepts is returned as config overrides. Nothing is measured here; the choice is as good as the
calibration (BENCHMARKS.md, "--layout auto").
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .cost import predict
from .hardware import System, as_system
from .layout import Layout, LayoutError
from .models import GPT
from .search import candidate_layouts

if TYPE_CHECKING:
    from podscale.config import Config


@dataclass
class AutoChoice:
    layout: Layout
    prediction: object                       # Prediction of the chosen layout
    overrides: list                          # "section.key=value" strings that make the config use it
    ranked: list = field(default_factory=list)   # (Prediction, overrides) of the runnable layouts, best first
    evaluated: int = 0

    def describe(self) -> str:
        p = self.prediction
        mem = p.memory_per_device_bytes / 2**30
        return (f"layout auto: {self.layout.short()} on {p.devices} x {p.system}: predicted step "
                f"{p.step_time_s:.4g} s, {mem:.2f} GiB per device ({self.evaluated} layouts predicted; "
                f"{len(self.ranked)} runnable)")


def gpt_of(cfg: Config) -> GPT:
    """The planner's description of a training config's model."""
    kind = cfg.model.kind
    if kind not in ("gpt", "gpt-moe"):
        raise ValueError(f"--layout auto plans GPT and GPT-MoE models only (model.kind = {kind!r}): set the "
                         "layout by hand")
    m = cfg.model
    moe = {}
    if kind == "gpt-moe":  # GShard MoE feed-forward every moe_every blocks; experts sharded over ep
        if m.expert_hidden not in (None, 4 * m.n_embd):
            raise ValueError(f"--layout auto plans experts of the dense MLP's width (model.expert_hidden = "
                             f"{4 * m.n_embd}); got {m.expert_hidden}: set the layout by hand")
        moe = dict(experts=m.experts, top_k=m.top_k, moe_every=m.moe_every, capacity_factor=m.capacity_factor,
                   dropless=m.dropless, dropless_peak_load=m.dropless_peak_load,
                   expert_recompute=m.expert_recompute, shared_experts=m.shared_experts,
                   aux_loss_scope=m.aux_loss_scope, drop_policy=m.drop_policy)
    return GPT(layers=m.n_layer, hidden=m.n_embd, heads=m.n_head, seq=m.block_size, vocab=m.vocab_size,
               name=cfg.run.name, **moe)


def layout_overrides(lay: Layout) -> list:
    """Config overrides that make ``podscale train`` run ``lay`` (every key of the layout set, so a config's
    own setting cannot contradict the chosen layout)."""
    return [f"parallel.expert_dispatch='{lay.expert_dispatch}'",
            f"parallel.tp={lay.tp}", f"parallel.pp={lay.pp}", f"parallel.dp={lay.dp}", f"parallel.ep={lay.ep}",
            f"parallel.sequence_parallel={'true' if lay.sequence_parallel else 'false'}",
            f"parallel.fold_tp_into_ep={'true' if lay.fold_tp_into_ep else 'false'}",
            f"parallel.expert_tensor_parallel={'true' if lay.expert_tensor_parallel else 'false'}",
            f"parallel.schedule='{lay.schedule}'", f"parallel.virtual_stages={lay.interleave}",
            f"parallel.recompute='{lay.recompute}'", f"train.micro_batch={lay.microbatch}",
            f"zero.stage={lay.zero_stage}", f"zero.offload_optimizer='{lay.offload_optimizer}'",
            f"zero.offload_param='{lay.offload_param}'"]


def _runnable(cfg, world_size: int, overrides: list) -> bool:
    from podscale.config import ConfigError, apply_override, parse_config
    data = copy.deepcopy(cfg.model_dump(mode="json"))
    try:
        for item in overrides:
            apply_override(data, item)
        parse_config(data).check_layout(world_size)
    except (ConfigError, ValueError):
        return False
    return True


def as_trained(lay: Layout) -> Layout:
    """``lay`` as podscale's trainer runs it: its GPT calls torch's SDPA (a fused attention kernel), its
    column-parallel layers overlap the input gradient's all-reduce with the weight gradient
    (parallel/tensor.py, ColumnParallelLinear), and autograd accumulates gradients (no fused accumulation)."""
    return dataclasses.replace(lay, fused_attention=True, tp_overlap=lay.tp > 1, grad_accumulation_fusion=False)


def ranked_layouts(cfg, world_size: int, system: System | str = "local") -> tuple[int, Iterator]:
    """Every layout of ``cfg`` on ``world_size`` devices of ``system`` that fits in device memory and that the
    trainer accepts, fastest predicted first: (the number of layouts predicted, an iterator of
    (Prediction, config overrides, Layout)).  Layouts are predicted up front and checked against the
    trainer's config validator lazily, in rank order (the check parses a config: most callers stop early)."""
    system = as_system(system)
    system.check_devices(world_size)
    model = gpt_of(cfg)
    batch = cfg.train.global_batch
    mbs = tuple(d for d in range(1, batch + 1) if batch % d == 0 and d <= 64)
    preds, evaluated = [], 0
    for lay in candidate_layouts(system, world_size, model, batch, microbatches=mbs):
        lay = as_trained(lay)
        try:
            pred = predict(system, world_size, model, lay, batch)
        except LayoutError:
            continue
        evaluated += 1
        if pred.fits:
            preds.append((pred.step_time_s, len(preds), pred, lay))
    preds.sort(key=lambda x: (x[0], x[1]))

    def runnable():
        for _, _, pred, lay in preds:
            over = layout_overrides(lay)
            if _runnable(cfg, world_size, over):
                yield pred, over, lay
    return evaluated, runnable()


def choose_layout(cfg, world_size: int, system: System | str = "local", keep: int = 0) -> AutoChoice:
    """The fastest predicted layout of ``cfg`` on ``world_size`` devices of ``system`` that fits in device
    memory and that the trainer accepts; ``keep`` > 0 also returns that many runners-up in ``ranked``."""
    system = as_system(system)
    evaluated, layouts = ranked_layouts(cfg, world_size, system)
    ranked = list(itertools.islice(layouts, max(keep, 0) + 1))
    if not ranked:
        raise ValueError(f"--layout auto found no layout of this model that fits {world_size} devices of "
                         f"{system.name} ({evaluated} predicted): use more processes or a smaller model")
    best_pred, best_over, best_lay = ranked[0]
    return AutoChoice(layout=best_lay, prediction=best_pred, overrides=best_over,
                      ranked=[(p, o) for p, o, _ in ranked], evaluated=evaluated)
