"""Tensors whose memory is resident only while a checkpoint reads or writes them, and the DCP planners
that stream them.

ZeRO-Infinity's state lives on NVMe (Rajbhandari et al. 2021): a checkpoint of it must not build the
whole master and both moments in host memory, or saving needs the RAM that offloading saved.  A
:class:`LazyPool` hands out flat buffers whose storage is empty; views of them are published as the
checkpoint's tensors (same names, shapes and shard metadata as any other layout, so checkpoints stay
interchangeable).  ``torch.distributed.checkpoint`` asks its planner for each tensor right before it
writes it (:meth:`~torch.distributed.checkpoint.SavePlanner.resolve_data`) and for each destination
right before it copies a stored chunk into it (:meth:`~torch.distributed.checkpoint.LoadPlanner.resolve_tensor`);
:class:`StreamingSavePlanner` and :class:`StreamingLoadPlanner` make the buffer behind that tensor
resident there — filled from its backing store, evicting the least recently used buffer beyond
``max_resident`` (written back first when a load changed it).  Peak memory is therefore
``max_resident`` buffers (a ZeRO unit's shard of one array each) plus the piece being written.  For
tensors of no pool both planners behave exactly as DCP's defaults.

Code that reads such tensors outside DCP (tests, tools) wraps the access in :func:`resident`.
"""
from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Callable, Hashable, Iterable

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

# id(published view) -> (pool, key); entries leave with their view (weakref.finalize)
_VIEWS: dict[int, tuple[weakref.ref, Hashable]] = {}


class LazyPool:
    """Flat buffers keyed by ``key``, resident at most ``max_resident`` at a time.

    ``fill(key) -> Tensor`` gives a buffer's current values (read from the backing store);
    ``store(key, tensor)`` writes a changed buffer back.  :meth:`view` registers the tensors handed out
    so the planners find their buffer."""

    def __init__(self, fill: Callable[[Hashable], torch.Tensor], store: Callable[[Hashable, torch.Tensor], None],
                 max_resident: int = 2):
        self.fill, self.store, self.max_resident = fill, store, max(1, int(max_resident))
        self._bases: dict[Hashable, torch.Tensor] = {}
        self._resident: collections.OrderedDict[Hashable, bool] = collections.OrderedDict()  # key -> dirty
        self.peak_resident_bytes = 0

    def buffer(self, key: Hashable, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (empty) buffer of ``key``: slice it and pass the slices to :meth:`view`."""
        base = self._bases.get(key)
        if base is None or base.numel() != numel or base.dtype != dtype:
            self.release(key)
            base = torch.empty(numel, dtype=dtype, device="cpu")
            base.untyped_storage().resize_(0)
            self._bases[key] = base
        return base

    def view(self, key: Hashable, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``make()``, a view of :meth:`buffer` ``(key)``, registered as published: the planners make the
        buffer resident before DCP touches it.  (torch checks a view against its storage's size: the
        storage is allocated around ``make`` — its pages untouched, so not resident — and freed again.)"""
        base = self._bases[key]
        if key in self._resident:
            t = make()
        else:
            base.untyped_storage().resize_(base.numel() * base.element_size())
            try:
                t = make()
            finally:
                base.untyped_storage().resize_(0)
        _VIEWS[id(t)] = (weakref.ref(self), key)
        weakref.finalize(t, _VIEWS.pop, id(t), None)
        return t

    def acquire(self, key: Hashable, dirty: bool = False) -> None:
        """Make ``key``'s buffer resident (filled from the store), the most recently used; ``dirty``: it
        will be changed and must be stored when released."""
        if key in self._resident:
            self._resident.move_to_end(key)
            self._resident[key] = self._resident[key] or dirty
            return
        while len(self._resident) >= self.max_resident:
            self.release(next(iter(self._resident)))
        base = self._bases[key]
        src = self.fill(key)
        base.untyped_storage().resize_(base.numel() * base.element_size())
        base.copy_(src.reshape(-1))
        del src
        self._resident[key] = dirty
        self.peak_resident_bytes = max(self.peak_resident_bytes, sum(
            self._bases[k].numel() * self._bases[k].element_size() for k in self._resident))

    def release(self, key: Hashable) -> None:
        """Store ``key``'s buffer if it changed, then free its memory."""
        dirty = self._resident.pop(key, None)
        base = self._bases.get(key)
        if dirty is None or base is None:
            return
        if dirty:
            self.store(key, base)
        base.untyped_storage().resize_(0)

    def flush(self, keys: Iterable[Hashable] | None = None) -> None:
        """Release every resident buffer (of ``keys``), storing the changed ones."""
        for key in list(self._resident if keys is None else [k for k in keys if k in self._resident]):
            self.release(key)


def _source(t) -> tuple[LazyPool, Hashable] | None:
    entry = _VIEWS.get(id(t))
    if entry is None:
        return None
    pool = entry[0]()
    return None if pool is None else (pool, entry[1])


class StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner; a tensor of a :class:`LazyPool` is made resident when DCP writes it and
    handed over as a copy (so the pool may release its buffer while the writer still holds the piece).

    DCP's file writer keeps every tensor it wrote referenced until the file is complete, so the copies
    handed out are freed here once they are surely written: its loader resolves at most
    :attr:`COPY_AHEAD` bytes (``FileSystemWriter``'s ``per_thread_copy_ahead``) plus one item ahead of
    the write, and copies older than that are released."""

    COPY_AHEAD = 10_000_000

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._handed: collections.deque[torch.Tensor] = collections.deque()
        self._handed_bytes = self._largest = 0

    def resolve_data(self, write_item):
        obj = self.lookup_object(write_item.index)
        src = _source(obj)
        if src is None:
            return self.transform_object(write_item, obj)
        pool, key = src
        pool.acquire(key)
        out = self.transform_object(write_item, obj).detach().clone()
        n = out.numel() * out.element_size()
        self._largest = max(self._largest, n)
        while self._handed and self._handed_bytes - self._handed[0].nbytes >= self.COPY_AHEAD + 2 * self._largest:
            old = self._handed.popleft()  # written: the writer resolved far enough past it
            self._handed_bytes -= old.nbytes
            old.untyped_storage().resize_(0)
        self._handed.append(out)
        self._handed_bytes += n
        return out


class StreamingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner; the buffer behind a :class:`LazyPool` tensor is made resident (and
    marked changed) right before DCP copies a stored chunk into it."""

    def resolve_tensor(self, read_item):
        t = self.lookup_tensor(read_item.dest_index)
        src = _source(t)
        if src is not None:
            src[0].acquire(src[1], dirty=True)
        return self.transform_tensor(read_item, t)


def _parts(tensors: Iterable[torch.Tensor]):
    for t in tensors:
        if isinstance(t, ShardedTensor):
            yield from (s.tensor for s in t.local_shards())
        else:
            yield t


@contextlib.contextmanager
def resident(tensors: Iterable[torch.Tensor], changed: bool = False):
    """Make every buffer behind ``tensors`` (plain or ``ShardedTensor``) resident at once, for reading them
    outside DCP (or writing them, with ``changed``: then they are stored on exit); released on exit."""
    held: dict[int, tuple[LazyPool, list]] = {}
    for t in _parts(tensors):
        src = _source(t)
        if src is not None:
            held.setdefault(id(src[0]), (src[0], []))[1].append(src[1])
    saved = {}
    try:
        for k, (pool, keys) in held.items():
            saved[k] = pool.max_resident
            pool.max_resident = max(pool.max_resident, len(set(keys)) + len(pool._resident))
            for key in keys:
                pool.acquire(key, dirty=changed)
        yield
    finally:
        for k, (pool, keys) in held.items():
            pool.flush(keys)
            pool.max_resident = saved.get(k, pool.max_resident)


__all__ = ["LazyPool", "StreamingSavePlanner", "StreamingLoadPlanner", "resident"]
