"""What a model may declare to the parallel layouts, beyond being a plain ``nn.Module``.

A plain module needs nothing here: it is built on a real device, and ZeRO-3 gathers the direct children
that hold parameters one at a time.  A model that does more says so by inheriting these abstract base
classes and implementing their methods; the layouts check ``isinstance`` against them, never probe for
attributes (the strategy seam, :mod:`podscale.parallel.strategy`, follows the same rule).

* :class:`MetaInitModel` — built on the meta device (``with torch.device("meta"): GPT(cfg)``), it gives any
  one parameter, or a shard of one, its single-process initial value on demand, so no rank ever holds the
  whole model: tensor and pipeline parallelism materialise only their shards and chunks, ZeRO-3 one unit at
  a time (ZeRO-Infinity's partitioned initialisation, Rajbhandari et al. 2021; PyTorch FSDP's
  ``param_init_fn``).  podscale's GPT and GPT-MoE and
  their pipeline chunks implement it.
* :class:`GatherUnits` — lists the modules ZeRO-3 gathers and releases together (DeepSpeed's and FSDP's
  wrapping policy: one transformer block per unit).  The GPT lists its blocks, a pipeline rank's chunks
  every block of every chunk.
* :class:`StepState` — a module (anywhere in the model) whose training forwards keep state over the
  micro-batches of one optimizer step, which the engine clears at the start of every step (the MoE layer's
  load-balancing counts accumulated over the step: :class:`~podscale.parallel.moe.gate.StepCounts`).  Such a
  module tells a forward recomputed in the backward (activation recomputation) by :func:`recomputing`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn as nn


class MetaInitModel(ABC):
    """A model that initialises its own parameters by name, so it can be built on the meta device."""

    @abstractmethod
    def init_parameter(self, name: str, t: torch.Tensor) -> None:
        """Fill ``t`` (any device, the parameter's shape) with the initial value of parameter ``name`` (its
        name in the single-process model): the same values every time, whichever rank or device asks."""

    @abstractmethod
    def materialize(self, device: torch.device | str = "cpu") -> nn.Module:
        """Give every parameter still on the meta device its initial value on ``device``, in place, keeping
        the parameters' tags (:mod:`podscale.parallel.param_tags`); returns the model."""


class GatherUnits(ABC):
    """A model that names ZeRO-3's gather units itself."""

    @abstractmethod
    def gather_units(self) -> list[nn.Module]:
        """The modules whose parameters ZeRO-3 gathers just before use and releases after, in forward
        order (parameters outside them form the root unit, gathered for the whole step)."""


class StepState(ABC):
    """A module whose training forwards keep state over the micro-batches of one optimizer step (gradient
    accumulation).  :class:`~podscale.train.engine.Engine` calls :meth:`start_step` on every such module of the
    model it trains (a pipeline rank: of its chunks) before the step's first forward, whoever calls
    ``Engine.step``, so the state never spans two steps."""

    @abstractmethod
    def start_step(self) -> None:
        """Clear what the forwards of the previous step kept: a new optimizer step begins."""


def recomputing() -> bool:
    """True while the autograd engine runs a backward pass: a forward then is activation recomputation
    (``torch.utils.checkpoint`` running a block again for its saved tensors), which must repeat the first
    forward, not count as another one."""
    return torch._C._current_graph_task_id() != -1
