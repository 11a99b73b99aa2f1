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

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from podscale.parallel.param_tags import tags
from podscale.storage import lazy


Shape = tuple[int, ...]
NamedParams = Iterable[tuple[str, torch.Tensor]]

#: the checkpointed arrays: the model's weights (fp32 masters under ZeRO) and Adam's two moments
PARAM, STATE_KEYS = "param", ("exp_avg", "exp_avg_sq")


def flat_start(off: Shape, shape: Shape) -> int:
    """The row-major flat index of element ``off`` of a tensor of ``shape``."""
    s, stride = 0, 1
    for o, n in zip(reversed(off), reversed(shape)):
        s += o * stride
        stride *= n
    return s


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
    ``view(off, size)`` this rank's memory for one of its own boxes.  ``own``: the views are the
    strategy's state itself (what is written into them is loaded), not a stand-in for state that does
    not exist yet."""

    def __init__(self, shape: Shape, dp: int, boxes, view, own: bool = True, axes: tuple[str, ...] = ("dp",)):
        # ``axes``: the mesh axes of the ``dp`` holders (ZeRO under expert parallelism shards dense
        # parameters over dp x ep, experts over dp; holder ``d`` is the d-th rank of that group)
        self.shape, self.dp, self.boxes, self.view, self.own = tuple(shape), dp, boxes, view, own
        self.axes = tuple(axes)


def replicated(t: torch.Tensor, dp: int, own: bool = True) -> Holding:
    """A tensor every dp rank holds whole."""
    whole = ((0,) * t.dim(), tuple(t.shape))
    return Holding(t.shape, dp, lambda d: [whole],
                   lambda off, size: t[off[0]:off[0] + size[0]] if t.dim() else t, own)


def publish(holding: Holding, layout, mesh, tp_own: bool = False) -> torch.Tensor:
    """The single-process tensor of which this rank holds ``holding``, as a ``ShardedTensor`` of views (or
    the plain view when this rank's one piece is the whole tensor, e.g. a replicated layer norm).

    Every (dp, tp) rank of this pipeline stage describes the same global pieces; a piece several ranks hold
    is listed under this rank when it is one of them (so loading fills every replica) and under its first
    holder otherwise, which keeps each rank's global metadata a partition of the tensor.  ``tp_own``: a
    tensor only this tp rank holds (unsplit, ``layout`` None: an expert folded over ep x tp, named by its
    global id), so its holders are the ranks of this tp coordinate."""
    tp, my_t, my_d = mesh.size("tp"), mesh.local_rank("tp"), mesh.local_rank(*holding.axes)
    # the tp ranks that hold an unsplit tensor: all of them, or this one
    whole_on = [my_t] if tp_own else list(range(tp))
    axes = [a for a in ("pp", "dp", "ep", "tp") if a in holding.axes]

    def coords(d: int) -> dict[str, int]:  # holder d's coordinates on the holding's axes (row-major)
        out = {}
        for a in reversed(axes):
            d, out[a] = divmod(d, mesh.sizes[a])
        return out
    gshape = global_shape(layout, holding.shape, tp)
    t_range = range(tp) if layout is not None else range(1)  # tp-replicated: the same boxes on every t
    pieces: dict[tuple[Shape, Shape], list] = {}  # (global offsets, sizes) -> [holders, my view]
    for t in t_range:
        for d in range(holding.dp):
            for off, size in holding.boxes(d):
                for loff, lsize, goff in to_global(layout, holding.shape, t, tp, off, size):
                    entry = pieces.setdefault((goff, lsize), [[], None])
                    ranks = [mesh.rank_of(**coords(d), tp=x) for x in ([t] if layout is not None else whole_on)]
                    entry[0].extend(r for r in ranks if r not in entry[0])
                    if d == my_d and (t == my_t or layout is None):
                        entry[1] = holding.view(loff, lsize)
    mine = [v for _, v in pieces.values() if v is not None]
    if len(pieces) == 1 and len(next(iter(pieces.values()))[0]) == holding.dp * (tp if layout is not None
                                                                                else len(whole_on)):
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


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of ``module``'s buffers that its ``state_dict`` holds (a mixture-of-experts router's
    balance bias; not the non-persistent ones), which every rank holding the module keeps whole and equal: a
    checkpoint stores them beside the parameters as plain tensors, and DCP loads them in place."""
    params = {id(p) for p in module.parameters()}
    return [(n, t) for n, t in module.state_dict(keep_vars=True).items() if id(t) not in params]


def local_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors this rank holds of ``t`` (a ShardedTensor's local shards, or ``t`` itself)."""
    return [s.tensor for s in t.local_shards()] if isinstance(t, ShardedTensor) else [t]


@torch.no_grad()
def copy_buffers(buffers: Iterable[tuple[str, torch.Tensor]], state: dict[str, torch.Tensor]) -> None:
    """Copy ``state``'s tensors into the named ``buffers`` (nothing where DCP loaded the buffer itself)."""
    for n, b in buffers:
        if n in state and state[n] is not b:
            b.copy_(state[n])


@torch.no_grad()
def copy_parts(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src``'s local parts into ``dst``'s (same layout); nothing for parts that are the same memory."""
    for d, s in zip(local_parts(dst), local_parts(src)):
        if d.data_ptr() != s.data_ptr():
            d.copy_(s.reshape(d.shape))


@torch.no_grad()
def fill_from_full(state: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> None:
    """Write each whole single-process tensor of ``full`` into this rank's part of the entry of ``state`` (a
    strategy's ``model_state()``: plain tensors held whole, or ``ShardedTensor``s of views with their global
    offsets) of the same name; entries ``full`` lacks are left as they are.  What DCP's load does from a
    file, from tensors in memory: ``train.init_from``'s converted weights."""
    for name, src in full.items():
        dst = state[name]
        with lazy.resident([dst], changed=True):  # (state on NVMe: one tensor at a time)
            if isinstance(dst, ShardedTensor):
                for shard in dst.local_shards():
                    md = shard.metadata
                    box = tuple(slice(o, o + n) for o, n in zip(md.shard_offsets, md.shard_sizes))
                    shard.tensor.copy_(src[box].reshape(shard.tensor.shape))
            else:
                dst.copy_(src)


class CheckpointSource(ABC):
    """What one data-parallel strategy holds of each parameter and of its Adam state, for
    :class:`CheckpointPublisher`.  Implemented by the replicated strategy's :class:`ReplicatedSource` and by
    ZeRO's (:class:`podscale.parallel.zero.state.ZeroSource`); a strategy hands out its own through
    :meth:`~podscale.parallel.strategy.DataParallelStrategy.checkpoint_source`."""

    @abstractmethod
    def open(self, kinds: tuple[str, ...]) -> None:
        """Before pieces of ``kinds`` are published (ZeRO: complete a deferred step, settle parameters)."""

    @abstractmethod
    def holds(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is one of the parameters this source holds state for."""

    @abstractmethod
    def holding(self, p: torch.Tensor, kind: str) -> Holding:
        """Where this rank's pieces of ``p``'s ``kind`` (:data:`PARAM` or one of :data:`STATE_KEYS`) live."""

    @abstractmethod
    def prepare_load(self, kinds: tuple[str, ...]) -> None:
        """Before a checkpoint is read into the holdings of ``kinds`` (a fresh optimizer makes its state)."""

    @abstractmethod
    def commit(self, kinds: tuple[str, ...]) -> None:
        """After the holdings of ``kinds`` were filled: make the values the strategy's (ZeRO: write them to
        the state, publish new masters to the parameters)."""

    @abstractmethod
    def step_count(self) -> torch.Tensor:
        """The optimizer's step count as a 0-dim fp32 tensor."""

    @abstractmethod
    def set_step_count(self, t: torch.Tensor) -> None: ...


class ReplicatedSource(CheckpointSource):
    """A replicated data-parallel strategy (torch AdamW over whole tensors): every dp rank holds it all."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, dp: int):
        self.module, self.optimizer, self.dp = module, optimizer, dp

    def open(self, kinds):
        pass

    def holds(self, p):
        return True

    def holding(self, p, kind):
        t = p.detach() if kind == PARAM else self.optimizer.state.get(p, {}).get(kind)
        # (a fresh optimizer has no state yet: zeros stand in, copied into its state at the load)
        return replicated(torch.zeros_like(p) if t is None else t, self.dp, own=t is not None)

    def prepare_load(self, kinds):
        # a fresh torch optimizer has no state yet: give it the tensors to load into
        for p in (q for g in self.optimizer.param_groups for q in g["params"]):
            st = self.optimizer.state.setdefault(p, {})
            for key in kinds:
                if key != PARAM:
                    st.setdefault(key, torch.zeros_like(p))

    def commit(self, kinds):
        pass

    def step_count(self):
        for s in self.optimizer.state.values():
            return s["step"].detach().to("cpu", torch.float32).clone()
        return torch.zeros((), dtype=torch.float32)

    def set_step_count(self, t):
        for p in (q for g in self.optimizer.param_groups for q in g["params"]):
            self.optimizer.state.setdefault(p, {})["step"] = t.detach().to(p.device, torch.float32).clone()


class CheckpointPublisher:
    """The one checkpoint publisher of podscale's sharded layouts (ZeRO alone, ZeRO or the replicated
    strategy under tensor/pipeline parallelism): every tensor under the single-process model's name and
    shape, as views of what this rank holds (see the module docstring), from a :class:`CheckpointSource`.

    ``model_names()`` lists (name, parameter) under every name the model state carries (tied names too);
    ``optim_names(duplicates)`` those of the optimizer state (``duplicates``: also the copies a template
    loads into, e.g. the last pipeline stage's tied embedding).  Tensors handed out by :meth:`model_state`
    / :meth:`optim_state` that are the state's own memory (:attr:`Holding.own`) are remembered: loading
    them back copies nothing, as DCP already filled them (for ZeRO-Infinity's state that is what keeps a
    load streaming: no second pass over the swap file).
    """

    def __init__(self, mesh, source: CheckpointSource, model_names: Callable[[], NamedParams],
                 optim_names: Callable[[bool], NamedParams]):
        self.mesh, self.source = mesh, source
        self.model_names, self.optim_names = model_names, optim_names
        self._handed: dict[str, torch.Tensor] = {}

    def _entries(self, kind: str, names, suffix: str | None = None) -> dict[str, torch.Tensor]:
        """``{name: tensor}``; with ``suffix``, the tensors that are the state's own memory are remembered
        under ``name + suffix`` as handed out."""
        done: dict[int, tuple[torch.Tensor, bool]] = {}
        out = {}
        for name, p in names:
            if not self.source.holds(p):
                continue
            if id(p) not in done:
                h = self.source.holding(p, kind)
                t = tags(p)
                # (a tp-sharded parameter without a tp layout: an expert folded over ep x tp)
                tp_own = t.tensor_parallel and t.tp_layout is None
                done[id(p)] = (publish(h, t.tp_layout, self.mesh, tp_own), h.own)
            out[name], own = done[id(p)]
            if suffix is not None:
                if own:
                    self._handed[name + suffix] = out[name]
                else:
                    self._handed.pop(name + suffix, None)
        return out

    def model_state(self) -> dict[str, torch.Tensor]:
        self.source.open((PARAM,))
        return self._entries(PARAM, self.model_names(), suffix="")

    def _optim(self, duplicates: bool) -> dict[str, torch.Tensor]:
        self.source.open(STATE_KEYS)
        names = [(n, p) for n, p in self.optim_names(duplicates) if self.source.holds(p)]
        out = {}
        for key in STATE_KEYS:
            out.update({f"{n}.{key}": t for n, t in self._entries(key, names, suffix=f".{key}").items()})
        step = self.source.step_count()
        for n, _ in names:
            out[f"{n}.step"] = step.clone()
        return out

    def optim_state(self) -> dict[str, torch.Tensor]:
        return self._optim(duplicates=False)

    def optim_template(self) -> dict[str, torch.Tensor]:
        return self._optim(duplicates=True)

    @torch.no_grad()
    def _copy_in(self, kind: str, names, state: dict, suffix: str) -> None:
        ours = None
        for name, p in names:
            src = state.get(name + suffix)
            if src is None or src is self._handed.get(name + suffix) or not self.source.holds(p):
                continue  # (a tensor this publisher handed out: DCP already wrote into our memory)
            if ours is None:
                ours = self._entries(kind, names)
            with lazy.resident([ours[name]], changed=True):  # (state on NVMe: one unit's shard at a time)
                copy_parts(ours[name], src)

    @torch.no_grad()
    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` (this publisher's template, filled by DCP, or any dict of the same layout) into
        the parameters or ZeRO masters, then let the source publish them."""
        self.source.prepare_load((PARAM,))
        self._copy_in(PARAM, list(self.model_names()), state, "")
        self.source.commit((PARAM,))

    @torch.no_grad()
    def load_optim_state(self, flat: dict[str, torch.Tensor]) -> None:
        names = list(self.optim_names(True))
        self.source.prepare_load(STATE_KEYS)
        for key in STATE_KEYS:
            self._copy_in(key, names, flat, f".{key}")
        self.source.commit(STATE_KEYS)
        steps = [flat[f"{n}.step"] for n, _ in names if f"{n}.step" in flat]
        if steps:
            self.source.set_step_count(steps[0])


class ShardedCheckpointState:
    """The checkpoint methods of a model-parallel wrapper (``model_state`` / ``optim_state`` /
    ``optim_template`` / ``load_model_state`` / ``load_optim_state``), through one
    :class:`CheckpointPublisher` over the wrapped strategy's
    :meth:`~podscale.parallel.strategy.DataParallelStrategy.checkpoint_source`.  The last pipeline stage's
    copy of the tied embedding is saved by the first stage (its model weight under ``lm_head.weight``, its
    Adam state under ``wte.weight``) and loaded by both.

    Mixed into a strategy that has ``self.inner`` (replicated or ZeRO over dp), ``self.mesh``,
    ``self.named_parameters(remove_duplicate)`` and ``self.named_buffers()`` (the persistent buffers of its
    model or chunks under single-process names, :func:`persistent_buffers`), which the model state carries
    too.
    """

    def _optim_names(self, duplicates: bool) -> list[tuple[str, torch.Tensor]]:
        return [("wte.weight" if tags(p).pipeline_duplicate else n, p)
                for n, p in self.named_parameters(True)
                if duplicates or not tags(p).pipeline_duplicate]

    @functools.cached_property
    def checkpoint_publisher(self) -> CheckpointPublisher:
        """This wrapper's publisher (one per wrapper: it remembers the tensors it handed out)."""
        return CheckpointPublisher(self.mesh, self.inner.checkpoint_source(), lambda: self.named_parameters(False),
                                   self._optim_names)

    def model_state(self) -> dict[str, torch.Tensor]:
        return self.checkpoint_publisher.model_state() | dict(self.named_buffers())

    def optim_state(self) -> dict[str, torch.Tensor]:
        return self.checkpoint_publisher.optim_state()

    def optim_template(self) -> dict[str, torch.Tensor]:
        return self.checkpoint_publisher.optim_template()

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self.checkpoint_publisher.load_model_state(state)
        copy_buffers(self.named_buffers(), state)

    def load_optim_state(self, flat: dict[str, torch.Tensor]) -> None:
        self.checkpoint_publisher.load_optim_state(flat)
