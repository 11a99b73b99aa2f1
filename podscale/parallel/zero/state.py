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
from podscale.parallel.zero.layout import flat_range_boxes
from podscale.storage.lazy import LazyPool


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
    return Holding(shape, u.dp, boxes, view, axes=u.axes)


class ZeroSource(CheckpointSource):
    """The :class:`~podscale.parallel.sharded_state.CheckpointSource` of a
    :class:`~podscale.parallel.zero.ZeroStrategy`.

    With the state in memory, holdings are slices of :meth:`FlatState.read_unit`'s views and a load writes
    straight into the state.  With the state on NVMe (:meth:`FlatState.reads_copy`), holdings are slices of
    the buffers of a :class:`~podscale.storage.lazy.LazyPool`, one per (array, unit), resident only while
    DCP writes or fills them (:class:`~podscale.storage.lazy.StreamingSavePlanner`,
    :class:`~podscale.storage.lazy.StreamingLoadPlanner`): saving or loading moves the state unit by unit,
    never more than ``max_resident`` unit shards of it in memory (ZeRO-Infinity's state is larger than
    the host memory it would otherwise take)."""

    def __init__(self, strategy, state: FlatState, max_resident: int = 2):
        self.strategy, self.state = strategy, state
        self._index = {id(q): (u, i) for u in strategy.units for i, q in enumerate(u.params)}
        self._units = {u.index: u for u in strategy.units}
        self.pool: LazyPool | None = None
        if state.reads_copy():
            self.pool = LazyPool(lambda key: state.read_unit(key[0], self._units[key[1]]),
                                 lambda key, t: state.write_unit(key[0], self._units[key[1]], t), max_resident)

    def _keys(self, kinds) -> list[tuple[str, int]]:
        arrays = {_array(k) for k in kinds}
        return [(a, u.index) for a in arrays for u in self.strategy.units]

    def open(self, kinds):
        self.strategy.checkpoint_units()  # a deferred step completes, parameter all-gathers are waited for
        if self.pool is not None:
            self.pool.flush(self._keys(kinds))  # what is read next is read anew from the state

    def holds(self, p):
        return id(p) in self._index

    def holding(self, p, kind) -> Holding:
        u, i = self._index[id(p)]
        array = _array(kind)
        if self.pool is None:
            return zero_slice(u, i, self.state.read_unit(array, u))
        key = (array, u.index)
        h = zero_slice(u, i, self.pool.buffer(key, u.shard))
        return Holding(h.shape, h.dp, h.boxes, lambda off, size: self.pool.view(key, lambda: h.view(off, size)),
                       axes=h.axes)

    def prepare_load(self, kinds):
        self.strategy.checkpoint_units()

    @torch.no_grad()
    def commit(self, kinds):
        arrays = {_array(k) for k in kinds}
        if self.pool is not None:
            self.pool.flush(self._keys(kinds))  # changed buffers go back to the state
        elif MASTER in arrays:
            for u in self.strategy.units:  # the masters were written in place: refresh their compute copies
                self.state.write_unit(MASTER, u, self.state.read_unit(MASTER, u))
        if MASTER in arrays:
            self.strategy.loaded_masters()

    def step_count(self):
        return torch.tensor(float(self.state.step_count()))

    def set_step_count(self, t):
        self.state.set_step_count(int(float(t)))
