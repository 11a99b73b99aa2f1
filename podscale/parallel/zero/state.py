"""Checkpoint tensors of a ZeRO strategy, keyed by parameter name with the parameter's global shape.

Each rank's flat slice cuts parameters at arbitrary element offsets; the piece of a parameter a rank holds
is described as the row-major boxes of :func:`~podscale.parallel.zero.layout.flat_range_boxes` and
published as a ``ShardedTensor`` whose local shards are *views* of the rank's flat buffers.  DCP
(``torch.distributed.checkpoint``) saves each box once and, on load, reads whatever overlap the current
layout needs — so a checkpoint written at one (dp, stage) loads at any other, and into the replicated
:class:`~podscale.parallel.data.DataParallel` (plain tensors of the same names), and back.  Loading
writes straight into the views, i.e. into the strategy's buffers.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from podscale.parallel.zero.layout import Unit, flat_range_boxes


def _flat_start(off: tuple[int, ...], shape: tuple[int, ...]) -> int:
    s, stride = 0, 1
    for o, n in zip(reversed(off), reversed(shape)):
        s += o * stride
        stride *= n
    return s


def _global_rank(strategy, r: int) -> int:
    return strategy.mesh.group_ranks("dp")[r] if strategy.dp > 1 else 0


def _entry(strategy, u: Unit, i: int, buf: torch.Tensor) -> torch.Tensor:
    """Parameter ``i`` of unit ``u`` from ``buf`` (this rank's slice of some per-element flat)."""
    shape, off = u.shapes[i], u.offsets[i]
    if strategy.dp == 1:
        return buf[off:off + u.numels[i]].view(shape)
    dev = buf.device
    metas, local = [], []
    for r in range(strategy.dp):
        for pi, plo, phi in u.owned(r):
            if pi != i:
                continue
            for boff, bsize in flat_range_boxes(plo, phi, shape):
                md = ShardMetadata(list(boff), list(bsize), f"rank:{_global_rank(strategy, r)}/{dev}")
                metas.append(md)
                if r == strategy.dp_rank:
                    start = off + _flat_start(boff, shape) - u.lo
                    local.append(Shard(buf[start:start + math.prod(bsize)].view(bsize), md))
    props = TensorProperties(dtype=buf.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size(shape), tensor_properties=props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)


def sharded_entries(strategy, get: Callable[[Unit], torch.Tensor], tied: bool = True) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` for every parameter (under each tied name when ``tied``) from ``get(unit)``."""
    out = {}
    for u in strategy.units:
        buf = get(u)
        for i, p in enumerate(u.params):
            t = _entry(strategy, u, i, buf)
            for n in (strategy.aliases.get(id(p), [u.names[i]]) if tied else [u.names[i]]):
                out[n] = t
    return out


def _locals(t: torch.Tensor) -> list[torch.Tensor]:
    return [s.tensor for s in t.local_shards()] if isinstance(t, ShardedTensor) else [t]


@torch.no_grad()
def copy_in(strategy, state: dict, get: Callable[[Unit], torch.Tensor], tied: bool = True) -> None:
    """Copy ``state`` (as produced by :func:`sharded_entries`, then filled by DCP) into the buffers;
    a no-op for entries that already are views of them."""
    ours = sharded_entries(strategy, get, tied)
    for name, dst in ours.items():
        src = state.get(name)
        if src is None:
            continue
        for d, s in zip(_locals(dst), _locals(src)):
            if d.data_ptr() != s.data_ptr():
                d.copy_(s.reshape(d.shape))
