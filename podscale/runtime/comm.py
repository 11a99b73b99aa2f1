"""Instrumented collectives: every byte podscale moves between ranks goes through here.

Each call names the mesh axis (or axes) it runs on and records, per ``(axis, op)``, the number of calls,
the bytes each rank puts on the wire by the ring algorithm's count (all-reduce ``2(n-1)/n * size``,
all-gather and reduce-scatter ``(n-1)/n * full size``, all-to-all ``(n-1)/n * size``), the time
from launch to completion ("busy") and the time the caller was blocked waiting ("exposed").  Exposed time
is what overlap did not hide; busy time is what the planner's cost model is calibrated against.

Each call also counts, in the mesh's :class:`Ledger`, which collective of its group this rank has entered
and which one it is blocked in: the hang watchdog (:mod:`podscale.runtime.watchdog`) publishes that record
from a thread and reads the other ranks' to name the one that did not arrive.  Recording is two dict
operations per call and never touches the network.
"""
from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils.weak import WeakIdKeyDictionary

# torch 2.13 renamed the flat-tensor collectives; older releases (the package supports torch >= 2.6) have
# only the *_tensor names, with the same arguments.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    busy_s: float = 0.0
    exposed_s: float = 0.0


@dataclass
class CommStats:
    """Per-(axis, op) communication counters; ``snapshot`` then ``reset`` once per step."""

    ops: dict[tuple[str, str], OpStats] = field(default_factory=lambda: defaultdict(OpStats))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, axis: str, op: str, nbytes: int, busy: float = 0.0, exposed: float = 0.0) -> None:
        with self._lock:
            s = self.ops[(axis, op)]
            s.calls += 1
            s.bytes += int(nbytes)
            s.busy_s += busy
            s.exposed_s += exposed

    def add_time(self, axis: str, op: str, busy: float = 0.0, exposed: float = 0.0) -> None:
        with self._lock:
            s = self.ops[(axis, op)]
            s.busy_s += busy
            s.exposed_s += exposed

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{"dp/all_reduce": {"calls", "bytes", "busy_s", "exposed_s"}, ...}``."""
        with self._lock:
            return {f"{a}/{o}": vars(s).copy() for (a, o), s in sorted(self.ops.items())}

    def totals(self) -> dict[str, float]:
        with self._lock:
            return {
                "bytes": sum(s.bytes for s in self.ops.values()),
                "busy_s": sum(s.busy_s for s in self.ops.values()),
                "exposed_s": sum(s.exposed_s for s in self.ops.values()),
            }

    def per_axis(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        with self._lock:
            for (axis, _), s in self.ops.items():
                a = out.setdefault(axis, {"bytes": 0, "busy_s": 0.0, "exposed_s": 0.0})
                a["bytes"] += s.bytes
                a["busy_s"] += s.busy_s
                a["exposed_s"] += s.exposed_s
        return out

    def reset(self) -> None:
        with self._lock:
            self.ops.clear()


class Ledger:
    """What this rank's collectives have reached, in memory: the step being trained, how many collectives
    it has entered per group (a group's members issue the same collectives in the same order, so the
    ``k``-th entry on a group matches every member's ``k``-th), and the one it is blocked in.

    Groups are keyed ``"AXIS:r0,r1,..."`` (the global ranks) and point-to-point pairs ``"AXIS:src>dst"``
    (sender and receiver count under the same key).  The caller's thread writes; the watchdog's thread only
    copies (each write is one assignment, atomic under the GIL).
    """

    __slots__ = ("step", "entered", "blocked", "_keys")

    def __init__(self):
        self.step = 0
        self.entered: dict[str, int] = {}
        #: ``(key, seq, op, axis, since)`` of the collective this rank waits in (``since``: time.monotonic())
        self.blocked: tuple | None = None
        self._keys: dict = {}

    def group_key(self, mesh, axes) -> str:
        """The key of this rank's group over ``axes`` (a name or a sequence of names), cached."""
        axes = axes if isinstance(axes, (str, tuple)) else tuple(axes)
        key = self._keys.get(axes)
        if key is None:
            ranks = mesh.group_ranks(*_axes_tuple(axes))
            key = self._keys[axes] = f"{_axis_name(axes)}:{','.join(map(str, ranks))}"
        return key

    def enter(self, key: str) -> int:
        seq = self.entered.get(key, 0) + 1
        self.entered[key] = seq
        return seq

    def snapshot(self) -> dict:
        """A JSON-able copy: ``{"step", "entered", "blocked": [key, seq, op, axis, waited_s] | None}``."""
        b = self.blocked
        return {"step": self.step, "entered": dict(self.entered),
                "blocked": None if b is None else [*b[:4], time.monotonic() - b[4]]}


class Handle:
    """An in-flight collective; ``wait()`` blocks and books the blocked time as exposed."""

    def __init__(self, work, stats: CommStats, axis: str, op: str, start: float, timed: bool = True,
                 ledger: Ledger | None = None, key: str = "", seq: int = 0):
        self._work, self._stats, self._axis, self._op = work, stats, axis, op
        self._start, self._done, self._timed = start, False, False
        self._ledger, self._key, self._seq = ledger, key, seq
        if work is not None and timed:
            try:
                fut = work.get_future()
            except RuntimeError:  # some gloo collectives have no future; busy time is then taken at wait()
                fut = None
            if fut is not None:
                # Completion is timed on the communication thread, so busy time excludes overlap gaps.
                self._timed = True
                fut.add_done_callback(lambda _f: stats.add_time(axis, op, busy=time.perf_counter() - start))

    def is_completed(self) -> bool:
        """True once the collective has finished (then ``wait`` returns at once); never blocks."""
        return self._done or self._work is None or self._work.is_completed()

    def wait(self):
        if self._done:
            return
        t0 = time.perf_counter()
        if self._work is not None:
            ledger = self._ledger
            if ledger is None:
                self._work.wait()
            else:
                mark = (self._key, self._seq, self._op, self._axis, time.monotonic())
                ledger.blocked = mark
                self._work.wait()
                if ledger.blocked is mark:
                    ledger.blocked = None
        now = time.perf_counter()
        busy = 0.0 if self._timed or self._work is None else now - self._start
        self._stats.add_time(self._axis, self._op, busy=busy, exposed=now - t0)
        self._done = True


def settle(seconds: float = 0.05) -> None:
    """Let torch's communication threads finish with collectives that have completed.

    A gloo worker thread drops its reference to a finished collective after marking it complete; when that
    is the last reference, freeing the collective's tensors takes the GIL.  If the interpreter finalizes
    while such a thread waits for the GIL, the thread is torn down inside C++ and the process aborts
    ("terminate called without an active exception").  Sleeping releases the GIL, so a thread that waits
    for it gets it; call this after every collective has been waited for (``Engine.close`` does).
    """
    time.sleep(seconds)


# ---------------------------------------------------------------------------------------------------
# Device check: every tensor a collective is given must live on the mesh's device (NCCL refuses a CPU
# tensor; gloo would silently take one and hide the bug on the CPU).  The check is always on.  On a CPU
# run the mesh's device *is* the CPU, so a tensor allocated without ``device=`` (on torch's default device,
# which on a GPU mesh is the CPU) passes unnoticed; the strict mode (PODSCALE_STRICT_DEVICE=1, on in the
# test suite) makes that detectable: it records every tensor a factory call (torch.zeros, torch.tensor,
# ...) made without a device, and the collectives refuse those.  ``t.to(device)`` clears the record;
# ``t.to(dtype)`` passes it on.  Tensors made by other means (arithmetic, torch.from_numpy) are not followed.
# ---------------------------------------------------------------------------------------------------
STRICT_ENV = "PODSCALE_STRICT_DEVICE"
_FACTORIES = frozenset(_device_constructors())
_default_placed = WeakIdKeyDictionary()
_strict_mode: "_DefaultDeviceTracker | None" = None


class CommDeviceError(RuntimeError):
    """A collective was given a tensor that is not on the mesh's device; the message is one line."""


def _names_device(args, kwargs) -> bool:
    """True when a ``Tensor.to`` call names a device (positionally, by keyword or by another tensor)."""
    return "device" in kwargs or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:])


class _DefaultDeviceTracker(TorchFunctionMode):
    """Records the tensors that factory calls made on torch's default device (no ``device=``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        if func in _FACTORIES:
            from_tensor = func in (torch.as_tensor, torch.asarray) and args and isinstance(args[0], torch.Tensor)
            if kwargs.get("device") is None and not from_tensor:
                _default_placed[out] = True
        elif func is torch.Tensor.to:
            if _names_device(args, kwargs):
                _default_placed.pop(out, None)
            elif args[0] in _default_placed:
                _default_placed[out] = True
        return out


def enable_strict_devices() -> None:
    """Turn on the strict device check in this process (idempotent); :meth:`Mesh.build` calls it when
    ``PODSCALE_STRICT_DEVICE=1``.  Only tensors made after this call are recorded."""
    global _strict_mode
    if _strict_mode is None:
        _strict_mode = _DefaultDeviceTracker()
        _strict_mode.__enter__()  # (for the rest of the process, on this thread: where collectives are issued)


def strict_devices_requested() -> bool:
    return os.environ.get(STRICT_ENV, "0") not in ("", "0")


def check_devices(op: str, axes, mesh, *tensors: torch.Tensor) -> None:
    """Raise :class:`CommDeviceError` unless every tensor is on ``mesh.device`` (and, in strict mode, was
    not allocated on torch's default device)."""
    want = mesh.device
    for t in tensors:
        d = t.device
        if d.type != want.type or (want.index is not None and d.index is not None and d.index != want.index):
            raise CommDeviceError(
                f"comm.{op} on axis {_axis_name(axes)} got a {t.dtype} tensor on {d}, but the mesh's device is "
                f"{want}: allocate it with device=mesh.device (NCCL takes only tensors on the rank's GPU)")
        if _strict_mode is not None and t in _default_placed:
            raise CommDeviceError(
                f"comm.{op} on axis {_axis_name(axes)} got a {t.dtype} tensor allocated on torch's default "
                f"device (a factory call without device=), which on a GPU mesh is the CPU and NCCL refuses it: "
                f"pass device=mesh.device (strict device check, {STRICT_ENV}=1)")


def _axes_tuple(axes) -> tuple:
    """``axes`` (one name or a sequence of names) as a tuple of names."""
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _axis_name(axes) -> str:
    return axes if isinstance(axes, str) else "+".join(axes)


def _group(mesh, axes):
    return mesh.group(*_axes_tuple(axes))


def _axis_group(mesh, axes):
    return mesh.axis_group(*_axes_tuple(axes))


def _size(mesh, axes) -> int:
    return mesh.size(*_axes_tuple(axes))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _issue(mesh, axes, op, nbytes, fn, async_op, timed: bool = True, key: str | None = None):
    name = _axis_name(axes)
    ledger = mesh.ledger
    key = key or ledger.group_key(mesh, axes)
    seq = ledger.enter(key)
    start = time.perf_counter()
    work = fn()
    mesh.stats.record(name, op, nbytes)
    h = Handle(work, mesh.stats, name, op, start, timed, ledger, key, seq)
    if async_op:
        return h
    h.wait()
    return None


def all_reduce(t: torch.Tensor, mesh, axes, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce of ``t`` over ``axes``; returns a Handle when ``async_op``."""
    check_devices("all_reduce", axes, mesh, t)
    n = _size(mesh, axes)
    if n == 1:
        return Handle(None, mesh.stats, _axis_name(axes), "all_reduce", 0.0) if async_op else None
    g = _group(mesh, axes)
    return _issue(mesh, axes, "all_reduce", 2 * (n - 1) * _nbytes(t) // n,
                  lambda: dist.all_reduce(t, op=op, group=g, async_op=True), async_op)


# ---------------------------------------------------------------------------------------------------
# Flat all-gather and reduce-scatter on gloo.  torch's gloo backend implements both through a staging copy:
# ``all_gather_into_tensor`` allocates a new flat output, gathers into it and copies every chunk into the
# caller's tensor; ``reduce_scatter_tensor`` copies the whole input, reduces and copies the slice out.  On
# ZeRO-3's 20 MB blocks (bench/zero_phases.py, 12 x 640 GPT, 2 ranks) those copies were 33 % of the
# stage-3 step's CPU time on the main and communication threads together (torch.profiler: 60 copies of
# a shard and 12 of a block, 3.3 s of 10.2 s).  Large gloo tensors therefore take a path without them: the
# all-gather is one in-place broadcast per rank into its slice of ``out``; the reduce-scatter (when the caller
# lets its input be overwritten) one in-place reduce per rank onto its slice, then one copy of the slice.
# Measured on 19.7 MB, 2 ranks: gather 9.7 vs 21.8 ms (process CPU 5.4 vs 8.3 ms), reduce-scatter
# 15.1 vs 34.7 ms (10.5 vs 16.5 ms).  Other backends (NCCL writes in place) keep the flat collectives.
# ---------------------------------------------------------------------------------------------------
GLOO_INPLACE_MIN_BYTES = 1 << 20  # below this the per-rank collectives' latency outweighs the copies saved


def _gloo_inplace(record, nbytes: int) -> bool:
    """Whether a collective of ``nbytes`` on the group ``record`` (a :class:`~podscale.runtime.mesh.AxisGroup`,
    whose backend the mesh recorded when it created the group) takes the in-place path."""
    return nbytes >= GLOO_INPLACE_MIN_BYTES and record.backend == "gloo"


class _Works:
    """Several works as one (per-rank collectives of one call), with an optional step run after the last
    completes (on the waiting thread).  No future: its busy time is taken at ``wait``."""

    def __init__(self, works: list, then=None):
        self._works, self._then = works, then

    def get_future(self):
        raise RuntimeError("no future for a composite work")

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self):
        for w in self._works:
            w.wait()
        if self._then is not None:
            self._then()
            self._then = None
        return True


def _gather_by_broadcasts(out: torch.Tensor, shard: torch.Tensor, ranks: list[int], me: int, g) -> _Works:
    flat = out.view(-1)
    s = shard.numel()
    mine = flat[me * s:(me + 1) * s]
    if mine.data_ptr() != shard.data_ptr():
        mine.copy_(shard.reshape(-1))
    return _Works([dist.broadcast(flat[j * s:(j + 1) * s], src=r, group=g, async_op=True)
                   for j, r in enumerate(ranks)])


def _scatter_by_reduces(out: torch.Tensor, full: torch.Tensor, ranks: list[int], me: int, g, op) -> _Works:
    flat = full.view(-1)
    s = out.numel()
    works = [dist.reduce(flat[j * s:(j + 1) * s], dst=r, op=op, group=g, async_op=True) for j, r in enumerate(ranks)]
    mine = flat[me * s:(me + 1) * s]
    return _Works(works, None if mine.data_ptr() == out.data_ptr() else lambda: out.view(-1).copy_(mine))


def all_gather(out: torch.Tensor, shard: torch.Tensor, mesh, axes, async_op: bool = False):
    """Gather equal ``shard``s of every rank on ``axes`` into the flat ``out`` (rank-major)."""
    check_devices("all_gather", axes, mesh, out, shard)
    n = _size(mesh, axes)
    if n == 1:
        if out.data_ptr() != shard.data_ptr():
            out.copy_(shard.reshape(out.shape))
        return Handle(None, mesh.stats, _axis_name(axes), "all_gather", 0.0) if async_op else None
    record = _axis_group(mesh, axes)
    g = record.group
    if out.is_contiguous() and _gloo_inplace(record, _nbytes(out)):
        key = _axes_tuple(axes)
        ranks, me = mesh.group_ranks(*key), mesh.local_rank(*key)
        fn = lambda: _gather_by_broadcasts(out, shard, ranks, me, g)  # noqa: E731
    else:
        fn = lambda: _all_gather_flat(out, shard, group=g, async_op=True)  # noqa: E731
    return _issue(mesh, axes, "all_gather", (n - 1) * _nbytes(out) // n, fn, async_op)


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, mesh, axes, op=dist.ReduceOp.SUM,
                   async_op: bool = False, scratch_input: bool = False):
    """Reduce ``full`` over ``axes`` and leave this rank's equal slice (rank-major) in ``out``.
    ``scratch_input``: the caller does not read ``full`` afterwards, so a backend may reduce in it (on gloo,
    large tensors: no staging copies, see above); its contents are then undefined."""
    check_devices("reduce_scatter", axes, mesh, out, full)
    n = _size(mesh, axes)
    if n == 1:
        if out.data_ptr() != full.data_ptr():
            out.copy_(full.reshape(out.shape))
        return Handle(None, mesh.stats, _axis_name(axes), "reduce_scatter", 0.0) if async_op else None
    record = _axis_group(mesh, axes)
    g = record.group
    if scratch_input and full.is_contiguous() and out.is_contiguous() and _gloo_inplace(record, _nbytes(full)):
        key = _axes_tuple(axes)
        ranks, me = mesh.group_ranks(*key), mesh.local_rank(*key)
        fn = lambda: _scatter_by_reduces(out, full, ranks, me, g, op)  # noqa: E731
    else:
        fn = lambda: _reduce_scatter_flat(out, full, op=op, group=g, async_op=True)  # noqa: E731
    return _issue(mesh, axes, "reduce_scatter", (n - 1) * _nbytes(full) // n, fn, async_op)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, mesh, axes, out_splits=None, in_splits=None,
               async_op: bool = False):
    """All-to-all over ``axes`` with optional uneven split sizes (``all_to_all_single``: works on gloo)."""
    check_devices("all_to_all", axes, mesh, out, inp)
    n = _size(mesh, axes)
    if n == 1:
        out.copy_(inp)
        return Handle(None, mesh.stats, _axis_name(axes), "all_to_all", 0.0) if async_op else None
    g = _group(mesh, axes)
    return _issue(mesh, axes, "all_to_all", (n - 1) * _nbytes(inp) // n,
                  lambda: dist.all_to_all_single(out, inp, out_splits, in_splits, group=g, async_op=True),
                  async_op)


def broadcast(t: torch.Tensor, src_local: int, mesh, axes, async_op: bool = False):
    """Broadcast from the rank with index ``src_local`` inside this rank's group over ``axes``."""
    check_devices("broadcast", axes, mesh, t)
    n = _size(mesh, axes)
    if n == 1:
        return Handle(None, mesh.stats, _axis_name(axes), "broadcast", 0.0) if async_op else None
    src = mesh.group_ranks(*_axes_tuple(axes))[src_local]
    g = _group(mesh, axes)
    return _issue(mesh, axes, "broadcast", _nbytes(t),
                  lambda: dist.broadcast(t, src=src, group=g, async_op=True), async_op)


def send(t: torch.Tensor, dst: int, mesh, axis: str = "pp", async_op: bool = False, tag: int = 0):
    """Point-to-point send to global rank ``dst`` (pipeline activations and gradients); messages between
    the same pair of ranks are matched by ``tag``, in issue order within a tag."""
    check_devices("send", axis, mesh, t)
    # No completion callback: a point-to-point message completes when its peer gets to it, which is not
    # busy time, and a callback per message takes the GIL from the compute thread on each completion.
    return _issue(mesh, axis, "send", _nbytes(t), lambda: dist.isend(t, dst, tag=tag), async_op, timed=False,
                  key=f"{axis}:{mesh.rank}>{dst}")


def recv(t: torch.Tensor, src: int, mesh, axis: str = "pp", async_op: bool = False, tag: int = 0):
    """Point-to-point receive from global rank ``src`` into ``t`` (the send with the same ``tag``)."""
    check_devices("recv", axis, mesh, t)
    return _issue(mesh, axis, "recv", _nbytes(t), lambda: dist.irecv(t, src, tag=tag), async_op, timed=False,
                  key=f"{axis}:{src}>{mesh.rank}")
