"""What the parallel wrappers record about a parameter, declared in one place.

Megatron-LM marks parameters with attributes (``tensor_model_parallel``, ``sequence_parallel``, ...) that the
gradient reductions, the global norm and the checkpoints read later (Shoeybi et al. 2019; Korthikanti et al.
2022, 4.2.2).  podscale keeps the same idea but gives the marks one declared home: a frozen
:class:`ParamTags` per parameter, written by :func:`tag` and read by :func:`tags`.  No other module sets or
probes attributes of a parameter for this.

The tags live in the parameter's ``__dict__`` (under one private key of this module), as Megatron's
attributes do, so :meth:`~podscale.models.gpt.GPT.materialize`, which gives a meta-device parameter memory
and copies its attributes, keeps them.  (``copy.deepcopy`` of a parameter keeps no attribute, so no tag:
tag after copying.)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

_KEY = "_podscale_param_tags"


@dataclass(frozen=True)
class ParamTags:
    """The marks of one parameter (all off by default: a plain replicated parameter).

    * ``tensor_parallel``: this rank holds a shard over tp (column/row-parallel weights, the vocab-parallel
      embedding); the global gradient norm sums its squares over tp.
    * ``sequence_parallel``: used on this rank's part of the sequence (layer norms, row-parallel biases, the
      position embedding under sequence parallelism) or of the samples (a mixture-of-experts layer's router
      and experts under tp): its gradient is summed over tp.
    * ``expert_parallel``: a mixture-of-experts expert; each ep rank holds others, so the norm sums over ep.
      With ``tensor_parallel`` too (and no ``tp_layout``): an expert folded over ep x tp, whole on one tp rank
      (MoE parallel folding), so the norm sums over ep and tp and a checkpoint names that tp rank's holders.
      With ``tensor_parallel`` and a ``tp_layout``: this tp rank's part of an expert whose hidden width is split
      over tp (expert tensor parallelism), whole-gradient there, so the norm sums over ep and tp and a
      checkpoint stores the single-process tensor from the tp parts, as for any tp shard.
    * ``pipeline_duplicate``: the last pipeline stage's copy of the tied embedding; the first stage's copy is
      the one counted in the norm and saved in checkpoints.
    * ``tp_layout``: how the single-process tensor is split over tp (``"rows"``, ``"cols"``, ``"qkv"`` or
      ``("vocab", vocab_size)``; see :func:`podscale.parallel.tensor.shard`), None when it is not split.
    """

    tensor_parallel: bool = False
    sequence_parallel: bool = False
    expert_parallel: bool = False
    pipeline_duplicate: bool = False
    tp_layout: str | tuple[str, int] | None = None


_NONE = ParamTags()


def tags(p: torch.Tensor) -> ParamTags:
    """The tags of ``p`` (:class:`ParamTags` with every mark off when it was never tagged)."""
    return p.__dict__.get(_KEY, _NONE)


def tag(p: torch.Tensor, **marks) -> torch.Tensor:
    """Set ``marks`` (fields of :class:`ParamTags`) on ``p``, keeping its other tags; returns ``p``."""
    p.__dict__[_KEY] = dataclasses.replace(tags(p), **marks)
    return p
