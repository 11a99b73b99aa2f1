"""ZeRO's side of the checkpoint publisher: where each parameter's master and Adam moments live in this
rank's flat shards.

Each rank's flat slice cuts parameters at arbitrary element offsets; the piece of a parameter a rank holds
is described as the row-major boxes of :func:`~podscale.parallel.zero.layout.flat_range_boxes`
(:func:`zero_slice`) and published by the one
:class:`~podscale.parallel.sharded_state.CheckpointPublisher` — for ZeRO alone and under tensor/pipeline
parallelism alike — as a ``ShardedTensor`` whose local shards are views of the unit's shard of the array.
DCP saves each box once and, on load, reads whatever overlap the current layout needs, so a checkpoint
written at one (dp, stage) loads at any other, into the replicated strategy, and back (ZeRO,
Rajbhandari et al. 2020: the partitioned state is a partition of the same single-process tensors).

The shards come from the :class:`~podscale.parallel.zero.flat_state.FlatState`, unit by unit, through its
public :meth:`~podscale.parallel.zero.flat_state.FlatState.read_unit` /
:meth:`~podscale.parallel.zero.flat_state.FlatState.write_unit`: views of the state in memory, or
buffers read from and written back to the swap file (ZeRO-Infinity).
"""
from __future__ import annotations

import math

import torch

from podscale.parallel.sharded_state import PARAM, CheckpointSource, Holding, flat_start
from podscale.parallel.zero.flat_state import MASTER, FlatState
from podscale.parallel.zero.layout import Unit, flat_range_boxes


def _array(kind: str) -> str:
    return MASTER if kind == PARAM else kind


def zero_slice(u, i: int, buf: torch.Tensor) -> Holding:
    """Parameter ``i`` of ZeRO unit ``u``: dp rank ``d`` holds the elements ``u.owned(d)`` gives; ``buf`` is
    this rank's flat slice (``u.shard`` elements starting at element ``u.lo`` of the unit)."""
    shape = u.shapes[i]

    def boxes(d):
        return [b for pi, lo, hi in u.owned(d) if pi == i for b in flat_range_boxes(lo, hi, shape)]

    def view(off, size):
        start = u.offsets[i] + flat_start(off, shape) - u.lo
        return buf[start:start + math.prod(size)].view(size)
    return Holding(shape, u.dp, boxes, view)


class ZeroSource(CheckpointSource):
    """The :class:`~podscale.parallel.sharded_state.CheckpointSource` of a
    :class:`~podscale.parallel.zero.ZeroStrategy`: holdings are slices of :meth:`FlatState.read_unit`'s
    per-unit shards; :meth:`commit` hands them back through :meth:`FlatState.write_unit`."""

    def __init__(self, strategy, state: FlatState):
        self.strategy, self.state = strategy, state
        self._index = {id(q): (u, i) for u in strategy.units for i, q in enumerate(u.params)}
        self._buffers: dict[tuple[str, int], tuple[Unit, torch.Tensor]] = {}

    def open(self, kinds):
        self.strategy.checkpoint_units()  # a deferred step completes, parameter all-gathers are waited for
        for key in [k for k in self._buffers if k[0] in {_array(x) for x in kinds}]:
            del self._buffers[key]  # read the arrays anew

    def holds(self, p):
        return id(p) in self._index

    def _buffer(self, kind: str, u: Unit) -> torch.Tensor:
        key = (_array(kind), u.index)
        if key not in self._buffers:
            self._buffers[key] = (u, self.state.read_unit(key[0], u))
        return self._buffers[key][1]

    def holding(self, p, kind) -> Holding:
        u, i = self._index[id(p)]
        return zero_slice(u, i, self._buffer(kind, u))

    def prepare_load(self, kinds):
        self.strategy.checkpoint_units()

    @torch.no_grad()
    def commit(self, kinds):
        arrays = {_array(k) for k in kinds}
        for key in [k for k in self._buffers if k[0] in arrays]:
            u, buf = self._buffers.pop(key)
            self.state.write_unit(key[0], u, buf)
        if MASTER in arrays:
            self.strategy.loaded_masters()

    def step_count(self):
        return torch.tensor(float(self.state.step_count()))

    def set_step_count(self, t):
        self.state.set_step_count(int(float(t)))
