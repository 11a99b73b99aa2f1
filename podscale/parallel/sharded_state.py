"""Checkpoint tensors of a tensor/pipeline-parallel model: each rank writes only what it holds, under the
single-process GPT's names and global shapes.

As Megatron-LM's distributed checkpointing and torchtitan (on ``torch.distributed.checkpoint``, DCP) do,
every parameter and Adam state is published as a ``ShardedTensor`` of the single-process shape whose local
shards are *views* of this rank's own memory, each with its global offsets: a tp shard is one box (``rows``,
``cols``, ``vocab`` with the padded rows clipped off) or three (``qkv``: this rank's rows of each of q, k
and v); ZeRO's flat dp slice of that shard is a few row-major boxes of it
(:func:`~podscale.parallel.zero.layout.flat_range_boxes`), mapped through the tp layout.  Saving therefore
moves no tensor between ranks and builds no full tensor (DCP's writer copies one piece at a time to
serialise it): DCP writes each rank's views to its own file and puts the global chunk metadata together (replicas — tp-replicated layer norms, dp replicas without ZeRO — are
written once; DCP's plan deduplication picks the least loaded holder).  Loading reads into the same views
exactly the stored chunks that overlap them, so a checkpoint written at one (pp, dp, tp, ZeRO stage) loads
at any other, into one process, and ``podscale export`` consolidates it into one plain file.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from podscale.parallel.zero.layout import flat_range_boxes
from podscale.parallel.zero.state import _flat_start

Shape = tuple[int, ...]


def _kind(layout) -> tuple[str | None, int | None]:
    return (layout, None) if layout is None or isinstance(layout, str) else tuple(layout)


def global_shape(layout, local: Shape, tp: int) -> Shape:
    """The single-process shape of a parameter whose tp shard has shape ``local``."""
    kind, vocab = _kind(layout)
    if kind is None or tp == 1 and kind != "vocab":
        return tuple(local)
    if kind == "cols":
        return (local[0], local[1] * tp) + tuple(local[2:])
    rows = vocab if kind == "vocab" else local[0] * tp
    return (rows,) + tuple(local[1:])


def to_global(layout, local: Shape, t: int, tp: int, off: Shape, size: Shape) -> list[tuple[Shape, Shape, Shape]]:
    """The box (``off``, ``size``) of tp rank ``t``'s shard (shape ``local``) in single-process coordinates:
    a list of (local offsets, sizes, global offsets).  Row layouts cut it at the q/k/v boundaries or clip the
    padded vocabulary rows; as every piece is a range of leading rows of the box, each is contiguous."""
    kind, vocab = _kind(layout)
    if kind is None:
        return [(off, size, off)]
    if kind == "cols":
        return [(off, size, (off[0], off[1] + t * local[1]) + tuple(off[2:]))]
    rows = local[0]
    if kind == "qkv":  # part j (q, k, v) of this rank: local rows [j·h, (j+1)·h) are global j·h·tp + t·h + ...
        h = rows // 3
        segments = [(j * h, (j + 1) * h, j * h * tp + t * h - j * h) for j in range(3)]
    else:  # rows, vocab: one block of rows; the padded vocabulary rows (>= vocab) exist only in memory
        end = rows if vocab is None else max(0, min(rows, vocab - t * rows))
        segments = [(0, end, t * rows)]
    out = []
    for lo, hi, delta in segments:
        a, b = max(lo, off[0]), min(hi, off[0] + size[0])
        if a < b:
            out.append(((a,) + tuple(off[1:]), (b - a,) + tuple(size[1:]), (a + delta,) + tuple(off[1:])))
    return out


class Holding:
    """Where the pieces of one parameter's tp shard live: ``boxes(d)`` are the boxes of the shard held by
    dp rank ``d`` (ZeRO: its slice of the unit; replicated: the whole shard on every dp rank) and
    ``view(off, size)`` this rank's memory for one of its own boxes."""

    def __init__(self, shape: Shape, dp: int, boxes, view):
        self.shape, self.dp, self.boxes, self.view = tuple(shape), dp, boxes, view


def replicated(t: torch.Tensor, dp: int) -> Holding:
    """A tensor every dp rank holds whole."""
    whole = ((0,) * t.dim(), tuple(t.shape))
    return Holding(t.shape, dp, lambda d: [whole],
                   lambda off, size: t[off[0]:off[0] + size[0]] if t.dim() else t)


def zero_slice(u, i: int, buf: torch.Tensor) -> Holding:
    """Parameter ``i`` of ZeRO unit ``u``: dp rank ``d`` holds the elements ``u.owned(d)`` gives; ``buf`` is
    this rank's flat slice (``u.shard`` elements starting at element ``u.lo`` of the unit)."""
    shape = u.shapes[i]

    def boxes(d):
        return [b for pi, lo, hi in u.owned(d) if pi == i for b in flat_range_boxes(lo, hi, shape)]

    def view(off, size):
        start = u.offsets[i] + _flat_start(off, shape) - u.lo
        return buf[start:start + math.prod(size)].view(size)
    return Holding(shape, u.dp, boxes, view)


def publish(holding: Holding, layout, mesh) -> torch.Tensor:
    """The single-process tensor of which this rank holds ``holding``, as a ``ShardedTensor`` of views (or
    the plain view when this rank's one piece is the whole tensor, e.g. a replicated layer norm).

    Every (dp, tp) rank of this pipeline stage describes the same global pieces; a piece several ranks hold
    is listed under this rank when it is one of them (so loading fills every replica) and under its first
    holder otherwise, which keeps each rank's global metadata a partition of the tensor."""
    tp, my_t, my_d = mesh.size("tp"), mesh.local_rank("tp"), mesh.local_rank("dp")
    gshape = global_shape(layout, holding.shape, tp)
    t_range = range(tp) if layout is not None else range(1)  # tp-replicated: the same boxes on every t
    pieces: dict[tuple[Shape, Shape], list] = {}  # (global offsets, sizes) -> [holders, my view]
    for t in t_range:
        for d in range(holding.dp):
            for off, size in holding.boxes(d):
                for loff, lsize, goff in to_global(layout, holding.shape, t, tp, off, size):
                    entry = pieces.setdefault((goff, lsize), [[], None])
                    ranks = [mesh.rank_of(dp=d, tp=x) for x in ([t] if layout is not None else range(tp))]
                    entry[0].extend(r for r in ranks if r not in entry[0])
                    if d == my_d and (t == my_t or layout is None):
                        entry[1] = holding.view(loff, lsize)
    mine = [v for _, v in pieces.values() if v is not None]
    if len(pieces) == 1 and len(next(iter(pieces.values()))[0]) == holding.dp * tp:
        return mine[0]  # every rank of the stage holds it whole: a plain tensor, written once by DCP
    dev = mine[0].device if mine else mesh.device
    dtype = mine[0].dtype if mine else torch.float32
    metas, local = [], []
    for (goff, size), (holders, view) in pieces.items():
        owner = mesh.rank if view is not None else holders[0]
        md = ShardMetadata(list(goff), list(size), f"rank:{owner}/{dev}")
        metas.append(md)
        if view is not None:
            local.append(Shard(view, md))
    props = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format,
                             pin_memory=bool(mine) and mine[0].is_pinned())
    meta = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size(gshape), tensor_properties=props)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("a sharded checkpoint tensor needs torch.distributed to be initialised")
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)


def local_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors this rank holds of ``t`` (a ShardedTensor's local shards, or ``t`` itself)."""
    return [s.tensor for s in t.local_shards()] if isinstance(t, ShardedTensor) else [t]


@torch.no_grad()
def copy_parts(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src``'s local parts into ``dst``'s (same layout); nothing for parts that are the same memory."""
    for d, s in zip(local_parts(dst), local_parts(src)):
        if d.data_ptr() != s.data_ptr():
            d.copy_(s.reshape(d.shape))


class ShardedCheckpointState:
    """The checkpoint interface of a model-parallel strategy (``model_state`` / ``optim_state`` /
    ``optim_template`` / ``load_model_state`` / ``load_optim_state``, see :mod:`podscale.train.engine`):
    every tensor under the single-process GPT's name and shape, as views of what this rank holds (see the
    module docstring).  The last pipeline stage's copy of the tied embedding is saved by the first stage
    (its model weight under ``lm_head.weight``, its Adam state under ``wte.weight``) and loaded by both.

    Mixed into a strategy that has ``self.inner`` (replicated or ZeRO over dp), ``self.mesh`` and
    ``self.named_parameters(remove_duplicate)``.
    """

    _STATE = ("exp_avg", "exp_avg_sq")

    def _zero_units(self):
        units = getattr(self.inner, "units", None)
        return units if units and hasattr(units[0], "owned") else None

    def _holding(self, p, key: str) -> Holding:
        units = self._zero_units()
        if units is None:
            t = p.detach() if key == "param" else self.inner.optimizer.state.get(p, {}).get(key)
            return replicated(torch.zeros_like(p) if t is None else t, self.mesh.size("dp"))
        # id(parameter) -> (unit, index); read from __dict__, as a missing attribute would be looked up on
        # the wrapped strategy
        index = self.__dict__.get("_ckpt_index")
        if index is None:
            index = self._ckpt_index = {id(q): (u, i) for u in units for i, q in enumerate(u.params)}
        u, i = index[id(p)]
        kind = "master" if key == "param" else key
        getter = self.inner._getter(kind) if hasattr(self.inner, "_getter") else (lambda v: getattr(v, kind))
        return zero_slice(u, i, getter(u))

    def _entries(self, key: str, names) -> dict[str, torch.Tensor]:
        done: dict[int, torch.Tensor] = {}
        out = {}
        for name, p in names:
            if id(p) not in done:
                done[id(p)] = publish(self._holding(p, key), getattr(p, "tp_layout", None), self.mesh)
            out[name] = done[id(p)]
        return out

    def _optim_names(self, duplicates: bool) -> list[tuple[str, torch.Tensor]]:
        return [("wte.weight" if getattr(p, "pipeline_duplicate", False) else n, p)
                for n, p in self.named_parameters(True)
                if duplicates or not getattr(p, "pipeline_duplicate", False)]

    def _step(self) -> torch.Tensor:
        if self._zero_units() is not None:
            return self.inner._step_value().to(torch.float32)
        for s in self.inner.optimizer.state.values():
            return s["step"].detach().to("cpu", torch.float32).clone()
        return torch.zeros((), dtype=torch.float32)

    def _fresh_reads(self) -> None:
        if hasattr(self.inner, "_wait_params"):
            self.inner._wait_params()
        if hasattr(self.inner, "_ck"):  # ZeRO-Infinity: read the arrays from the swap file anew
            self.inner._ck = {}

    def model_state(self) -> dict[str, torch.Tensor]:
        self._fresh_reads()
        return self._entries("param", self.named_parameters(False))

    def _optim(self, duplicates: bool) -> dict[str, torch.Tensor]:
        self._fresh_reads()
        names = self._optim_names(duplicates)
        out = {}
        for key in self._STATE:
            out.update({f"{n}.{key}": t for n, t in self._entries(key, names).items()})
        step = self._step()
        for n, _ in names:
            out[f"{n}.step"] = step.clone()
        return out

    def optim_state(self) -> dict[str, torch.Tensor]:
        return self._optim(duplicates=False)

    def optim_template(self) -> dict[str, torch.Tensor]:
        return self._optim(duplicates=True)

    @torch.no_grad()
    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` (this strategy's template, filled by DCP) into the parameters or ZeRO masters;
        nothing is copied where the template already is their memory."""
        ours = self._entries("param", self.named_parameters(False))
        for name, dst in ours.items():
            if name in state:
                copy_parts(dst, state[name])
        if self._zero_units() is not None:  # publish the masters to the parameters ZeRO computes with
            if hasattr(self.inner, "_writeback"):
                self.inner._writeback("master")
            self.inner._publish()
            self.inner._wait_params()

    @torch.no_grad()
    def load_optim_state(self, flat: dict[str, torch.Tensor]) -> None:
        names = self._optim_names(duplicates=True)
        steps = [flat[f"{n}.step"] for n, _ in names if f"{n}.step" in flat]
        zero = self._zero_units() is not None
        if not zero:  # a fresh torch optimizer has no state yet: give it the tensors to load into
            for _, p in names:
                st = self.inner.optimizer.state.setdefault(p, {})
                for key in self._STATE:
                    st.setdefault(key, torch.zeros_like(p))
        for key in self._STATE:
            ours = self._entries(key, names)
            for name, dst in ours.items():
                if f"{name}.{key}" in flat:
                    copy_parts(dst, flat[f"{name}.{key}"])
            if zero and hasattr(self.inner, "_writeback"):
                self.inner._writeback(key)
        if not steps:
            return
        if zero:
            self.inner.load_optim_state({"step.step": steps[0]})
        else:
            for _, p in names:
                self.inner.optimizer.state[p]["step"] = steps[0].detach().to(p.device, torch.float32).clone()
