"""Flat layout of parameters into units and of units into per-rank shards.

A *unit* is a group of parameters that live in one flat buffer and move together: a gradient bucket for
stages 1 and 2, a transformer block (the gather/release granularity) for stage 3.  Its ``numel``
elements are padded to a multiple of the data-parallel size ``N_d`` and rank ``r`` owns the contiguous
slice ``[r·s, (r+1)·s)`` with ``s = padded / N_d`` (ZeRO, Rajbhandari et al. 2020, section 5: "each data
parallel process only updates its partition").  Inside a unit, parameters with weight decay come first,
so a rank's slice is at most two optimizer segments (decay / no decay).

A slice of the flattened unit cuts parameters at arbitrary element offsets.  For checkpoints each piece
is described as a few rectangular boxes of the parameter's *natural* shape (:func:`flat_range_boxes`), so
torch.distributed.checkpoint can reshard between any data-parallel size, ZeRO stage or the replicated
layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from podscale.parallel.buckets import reverse_order_buckets
from podscale.parallel.model_protocols import GatherUnits


def flat_range_boxes(lo: int, hi: int, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The elements ``[lo, hi)`` of a row-major tensor of ``shape`` as (offsets, sizes) boxes.

    Row-major order means a flat range is: a partial leading row, whole rows, a partial trailing row;
    partial rows recurse into the inner dimensions.  Boxes are disjoint, ordered by flat offset, and each
    is contiguous in memory, so it is a view of the flat range.
    """
    if hi <= lo:
        return []
    if len(shape) == 0:
        return [((), ())]
    if len(shape) == 1:
        return [((lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    out = []
    r0, r1 = lo // inner, hi // inner
    if lo % inner:  # partial first row
        end = min(hi, (r0 + 1) * inner)
        for off, size in flat_range_boxes(lo - r0 * inner, end - r0 * inner, shape[1:]):
            out.append(((r0,) + off, (1,) + size))
        lo, r0 = end, r0 + 1
        if lo >= hi:
            return out
    if r1 > r0:  # whole rows
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:])))
    if hi % inner and hi > r1 * inner:  # partial last row
        for off, size in flat_range_boxes(0, hi - r1 * inner, shape[1:]):
            out.append(((r1,) + off, (1,) + size))
    return out


class Unit:
    """Parameters sharing one flat buffer; offsets are in elements of the unit's flat order."""

    def __init__(self, index: int, params: list[nn.Parameter], names: list[str], dp: int, dp_rank: int,
                 module: nn.Module | None = None, persistent: bool = True, axes: tuple[str, ...] = ("dp",)):
        """``dp``, ``dp_rank``: the size of the group the unit is sharded over and this rank's index in it;
        ``axes``: that group's mesh axes (``("dp", "ep")`` for dense parameters under expert parallelism,
        ``("dp",)`` for experts)."""
        decay = [i for i, p in enumerate(params) if p.dim() >= 2]
        no_decay = [i for i, p in enumerate(params) if p.dim() < 2]
        order = decay + no_decay
        self.index, self.module, self.persistent = index, module, persistent
        self.params = [params[i] for i in order]
        self.names = [names[i] for i in order]
        self.shapes = [tuple(p.shape) for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.params))]
        self.numel = sum(self.numels)
        self.n_decay = sum(self.numels[: len(decay)])
        self.dp, self.dp_rank, self.axes = dp, dp_rank, tuple(axes)
        self.padded = -(-self.numel // dp) * dp
        self.shard = self.padded // dp
        self.lo, self.hi = dp_rank * self.shard, (dp_rank + 1) * self.shard
        self.pos = {id(p): i for i, p in enumerate(self.params)}
        # runtime state of the strategy's gathers and reductions (the optimizer state of the shard is the
        # FlatState's, see podscale.parallel.zero.flat_state)
        self.full: torch.Tensor | None = None     # compute-dtype flat of `padded` elements
        self.gathered = False
        self.gather_handle = None
        self.grad_full: torch.Tensor | None = None  # stage 1: full gradient buffer (p.grad are views)
        self.staging: torch.Tensor | None = None    # stages 2/3: this micro-batch's gradients
        self.src_tmp: torch.Tensor | None = None    # the gather's source, kept until the gather is done
        self.ready: set[int] = set()
        self.goff = 0  # offset of this unit's shard in the rank's flat arrays (set by the FlatState)

    def segments(self) -> list[tuple[int, int, bool]]:
        """This rank's slice as (start, end, decay) ranges in shard-local offsets, padding excluded."""
        out = []
        for a, b, decay in ((0, self.n_decay, True), (self.n_decay, self.numel, False)):
            s, e = max(a, self.lo), min(b, self.hi)
            if e > s:
                out.append((s - self.lo, e - self.lo, decay))
        return out

    def shard_ranges(self) -> list[tuple[int, int, int]]:
        """Per parameter this rank holds a part of: (param index, start, end) of that part in the rank's
        shard (shard-local offsets, as :meth:`segments`)."""
        return [(i, self.offsets[i] + lo - self.lo, self.offsets[i] + hi - self.lo) for i, lo, hi in self.owned()]

    def owned(self, rank: int | None = None):
        """Per parameter: (param index, flat lo, flat hi) inside the parameter, for ``rank``'s slice."""
        r = self.dp_rank if rank is None else rank
        lo, hi = r * self.shard, (r + 1) * self.shard
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            s, e = max(lo, off), min(hi, off + n)
            if e > s:
                out.append((i, s - off, e - off))
        return out


@dataclass(frozen=True)
class ShardGroup:
    """The ranks a set of parameters is replicated over, hence sharded over by ZeRO: mesh ``axes``, their
    ``size`` and this rank's index ``rank`` among them.  Under expert parallelism dense parameters are
    replicated over dp x ep and the experts (each ep rank its own) over dp only."""

    axes: tuple[str, ...]
    size: int
    rank: int

    @classmethod
    def of(cls, mesh, axes: tuple[str, ...]) -> "ShardGroup":
        return cls(tuple(axes), mesh.size(*axes), mesh.local_rank(*axes))


def _split(named, sharded: set[int]):
    return [(n, p) for n, p in named if id(p) not in sharded], [(n, p) for n, p in named if id(p) in sharded]


def bucket_units(named: list[tuple[str, nn.Parameter]], cap_bytes: int, dp: int, dp_rank: int,
                 axes: tuple[str, ...] = ("dp",), sharded: set[int] = frozenset(),
                 sharded_group: ShardGroup | None = None) -> list[Unit]:
    """Stages 1 and 2: buckets of about ``cap_bytes`` in reverse registration order (backward's order);
    parameters in ``sharded`` (ids) go to buckets of their own over ``sharded_group``."""
    if sharded:
        dense, experts = _split(named, sharded)
        units = bucket_units(dense, cap_bytes, dp, dp_rank, axes) + \
            bucket_units(experts, cap_bytes, sharded_group.size, sharded_group.rank, sharded_group.axes)
        for i, u in enumerate(units):
            u.index = i
        return units
    groups = reverse_order_buckets(named, cap_bytes, lambda item: item[1].numel() * 4)  # (fp32 master bytes)
    return [Unit(i, [p for _, p in g], [n for n, _ in g], dp, dp_rank, axes=axes) for i, g in enumerate(groups)]


def wrap_modules(model: nn.Module) -> list[nn.Module]:
    """Stage 3's gather units: the model's own when it declares them (a
    :class:`~podscale.parallel.model_protocols.GatherUnits`: the GPT's blocks, a pipeline rank's blocks of
    every chunk), else the direct children that hold parameters."""
    if isinstance(model, GatherUnits):
        return list(model.gather_units())
    return [m for m in model.children() if any(True for _ in m.parameters())]


def layer_units(model: nn.Module, named: list[tuple[str, nn.Parameter]], threshold: int, dp: int,
                dp_rank: int, cap_bytes: int, axes: tuple[str, ...] = ("dp",), sharded: set[int] = frozenset(),
                sharded_group: ShardGroup | None = None) -> tuple[list[Unit], list[Unit], Unit | None]:
    """Stage 3: one unit per wrapped module (gathered just before use and released after), one root
    unit for the remaining large parameters (embeddings, tied head, final norm), and persistent units
    holding every parameter with fewer than ``threshold`` elements (always whole, as DeepSpeed's
    ``param_persistence_threshold``).  Returns (layer units in forward order, persistent units, root).

    Parameters in ``sharded`` (ids: experts) are sharded over ``sharded_group`` instead of (``dp``,
    ``axes``): a module holding both gets two consecutive units (dense, then its experts), gathered and
    released together by its hooks; their small parameters get persistent buckets of their own."""
    group = ShardGroup(tuple(axes), dp, dp_rank)

    def grp(p) -> ShardGroup:
        return sharded_group if id(p) in sharded else group
    name_of = {id(p): n for n, p in named}
    taken: set[int] = set()
    small: list[tuple[str, nn.Parameter]] = []
    layers: list[Unit] = []
    idx = 0
    for m in wrap_modules(model):
        big = []
        for p in m.parameters():
            if id(p) in taken or id(p) not in name_of:
                continue
            taken.add(id(p))
            (small if p.numel() < threshold else big).append((name_of[id(p)], p))
        for g in (group, sharded_group) if sharded else (group,):
            mine = [(n, p) for n, p in big if grp(p) == g]
            if mine:
                layers.append(Unit(idx, [p for _, p in mine], [n for n, _ in mine], g.size, g.rank, m,
                                   persistent=False, axes=g.axes))
                idx += 1
    rest = []
    for n, p in named:
        if id(p) not in taken:
            (small if p.numel() < threshold else rest).append((n, p))
    root = None
    if any(id(p) in sharded for _, p in rest):
        raise ValueError("ep-sharded parameters outside the model's blocks: ZeRO-3 gathers them per block")
    if rest:
        root = Unit(idx, [p for _, p in rest], [n for n, _ in rest], dp, dp_rank, model, persistent=False,
                    axes=axes)
        idx += 1
    persistent = []
    for u in bucket_units(small, cap_bytes, dp, dp_rank, axes, sharded, sharded_group) if small else []:
        u.index = idx
        idx += 1
        persistent.append(u)
    return layers, persistent, root
