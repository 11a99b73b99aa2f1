"""ZeRO-Infinity's NVMe optimizer offload: fp32 gradient, master and Adam moments of this rank's shard on
disk, streamed through memory in fixed-size sub-groups ("chunks").

Rajbhandari et al. 2021 ("ZeRO-Infinity", sections 5.1 and 6.2-6.3): the optimizer state of a shard is
split into sub-groups; while one sub-group is stepped on the CPU, the next is read from NVMe and the
previous one is written back ("write-behind"), so the step runs at the disk's sequential bandwidth.  Here
the rank's flat shard of ``S`` elements is one file holding four fp32 arrays ``[grad | master | m | v]``
and, with parameter offload, the compute-dtype parameter shard after them.  A chunk of ``C`` elements is
four large sequential reads into one of three chunk buffers, a fused AdamW over the chunk's segments,
and asynchronous writes of the new master, moments and compute-dtype parameters.  Three buffers let the
read of chunk ``i+1`` and the writes of chunk ``i-1`` run on the disk while chunk ``i`` steps (with two,
the read of ``i+1`` would have to wait for the writes of ``i-1`` that use its buffer).  Gradients reach
the file as each unit's reduce-scatter completes (gradient offload), so resident memory is the
compute-dtype shard of persistent units, the chunk buffers and the working set of the layers in use —
independent of the optimizer state's size.

The file is read and written with ``O_DIRECT`` (:mod:`podscale.storage.aio`): every unit's shard starts
at an offset of :data:`ELEM_ALIGN` elements (the strategy lays them out so), chunks are multiples of it
and the buffers are page-aligned, so the transfers go to the disk in place, without bounce copies.

Scaling of the gradient (fp16 unscale, clipping) is deferred: the state keeps one coefficient and the
step applies it to each chunk (:meth:`podscale.parallel.zero.flat_state.NvmeFlatState.scale_grads`).  The
update functions are the in-memory backend's: AdamW's fused step on each chunk's segments, LAMB/LARS
through the two passes of :class:`podscale.optim.flat_lamb.TrustRatioRule`.  Checkpoints read and write
one unit's range of one array at a time (:meth:`NvmeOptimizerState.read_unit`).

At stage 3 the step itself can be deferred (``step(defer=True)``, config ``zero.nvme_overlap_step``): the
strategy lays the file out in the order the forward uses its units, and each gather of the next forward
calls :meth:`advance` up to the end of its unit, so a block's optimizer state streams through the disk
while the previous block computes — ZeRO-Infinity's overlap of NVMe traffic with compute (section 6.3),
applied to the optimizer step, which clipping by the global norm keeps from starting before backward ends.
The result is the same as stepping at once; anything else that touches the file (gradients of the next
backward, checkpoints, parameter writes) calls :meth:`finish` first.  :class:`NvmeFlatState
<podscale.parallel.zero.flat_state.NvmeFlatState>` drives this file for the strategy.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

import torch

from podscale.optim.flat_adam import FlatAdamW, Segment
from podscale.storage.aio import ALIGN, AsyncFile, aligned_empty

GRAD, MASTER, EXP_AVG, EXP_AVG_SQ = range(4)
ELEM_ALIGN = ALIGN // 2  # elements: an offset that is a multiple is block-aligned for 2- and 4-byte dtypes
SLOTS = 3
log = logging.getLogger("podscale.zero")


def remove_stale_swap_files(folder, host: str) -> list[Path]:
    """Delete swap files this host's killed runs left in ``folder`` (their process no longer exists):
    without it a crashed or restarted worker would leave its whole optimizer state on the disk.  Files
    of live processes and of other hosts sharing the folder are left alone.  Returns what was removed."""
    removed = []
    for f in Path(folder).glob(f"podscale-zero-{host}-rank*-*.swp"):
        try:
            pid = int(f.stem.rsplit("-", 1)[1])
        except ValueError:
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # alive (or not ours to signal: EPERM)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        f.unlink(missing_ok=True)
        removed.append(f)
    if removed:
        log.warning("removed %d swap file(s) left by runs that no longer exist: %s", len(removed),
                    ", ".join(p.name for p in removed))
    return removed


def _staged(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into a page-aligned buffer padded with zeros to whole blocks (a direct write, no
    read-modify-write of the last block)."""
    n = t.numel()
    out = aligned_empty(-(-n // ELEM_ALIGN) * ELEM_ALIGN, t.dtype)
    out[:n].copy_(t.reshape(-1))
    out[n:].zero_()
    return out


class NvmeOptimizerState:
    def __init__(self, units, total: int, folder: str, rank: int, chunk_elems: int, betas, eps: float,
                 weight_decay: float, threads: int = 4, param_dtype: torch.dtype | None = None,
                 direct: bool = True):
        self.units, self.S = units, -(-int(total) // ELEM_ALIGN) * ELEM_ALIGN
        self.C = min(max(ELEM_ALIGN, int(chunk_elems) // ELEM_ALIGN * ELEM_ALIGN), self.S)
        self.betas, self.eps, self.wd = betas, eps, weight_decay
        host = socket.gethostname().split(".")[0] or "host"
        remove_stale_swap_files(folder, host)
        self.path = Path(folder) / f"podscale-zero-{host}-rank{rank:05d}-{os.getpid()}.swp"
        # optional fifth region: the compute-dtype parameter shard (ZeRO-Infinity parameter offload)
        self.pdtype = param_dtype
        self.psize = torch.empty((), dtype=param_dtype).element_size() if param_dtype is not None else 0
        self.file = AsyncFile(self.path, (16 + self.psize) * self.S, threads=threads,
                              block_bytes=min(8 << 20, 4 * self.C), direct=direct)
        self.bufs = [aligned_empty(4 * self.C, torch.float32).view(4, self.C) for _ in range(SLOTS)]
        if self.psize:
            self.bufs += [aligned_empty(self.C, param_dtype) for _ in range(SLOTS)]
        self._writes: list[list] = [[] for _ in range(SLOTS)]
        self._slot_chunk = [-1] * SLOTS  # the chunk whose writes _writes[slot] holds
        self._pending = None  # a deferred step: generator over the chunks (see step(defer=True))
        self._done_upto = 0  # with a deferred step: elements [0, done_upto) of the file are stepped
        self._grad_writes: list = []
        self.t = 0
        self.trust = None  # a TrustRatioRule (LAMB, LARS) after use_trust_ratio
        self.step_s = self.step_exposed_s = 0.0  # totals over all steps (wall time, I/O waits)
        # (chunk start, chunk end) -> segments as (array offset within chunk, length, decay, unit)
        self.chunks = [(a, min(a + self.C, self.S)) for a in range(0, self.S, self.C)]
        self._plan = [self._segments_of(a, b) for a, b in self.chunks]

    def _off(self, array: int, elem: int) -> int:
        return (array * self.S + elem) * 4

    def _poff(self, elem: int) -> int:
        return 16 * self.S + elem * self.psize

    def _segments_of(self, a: int, b: int):
        out = []
        for u in self.units:
            for s, e, decay in u.segments():
                lo, hi = max(a, u.goff + s), min(b, u.goff + e)
                if hi > lo:
                    out.append((lo - a, hi - lo, decay, u, lo - u.goff))
        return out

    # parameter offload -----------------------------------------------------------------------------
    def write_param(self, u, lo: int, t: torch.Tensor) -> None:
        self.finish()
        self._wait_all_writes()
        self.file.write(self._poff(u.goff + lo), _staged(t)).wait()

    def read_param(self, u, out: torch.Tensor):
        """Start reading unit ``u``'s compute-dtype shard into ``out``: a deferred step is advanced past
        the unit and the writes of the chunks that hold it are waited for (later chunks keep streaming)."""
        lo, hi = u.goff, u.goff + u.shard
        self.advance(hi)
        for slot, i in enumerate(self._slot_chunk):
            if i >= 0 and self.chunks[i][0] < hi and self.chunks[i][1] > lo:
                self._wait_writes(slot)
        return self.file.read(self._poff(lo), out)

    # initial state / gradients -------------------------------------------------------------------
    def write_master(self, u, master_fp32: torch.Tensor) -> None:
        self.file.write(self._off(MASTER, u.goff), _staged(master_fp32)).wait()

    def add_grad(self, u, g: torch.Tensor, fresh: bool) -> None:
        """Store (fresh) or accumulate unit ``u``'s fp32 gradient shard on disk."""
        self.finish()  # the step must have read the previous gradient before this one overwrites it
        g = _staged(g.float())
        if not fresh:
            self.wait_grads()
            old = aligned_empty(g.numel(), torch.float32)
            self.file.read(self._off(GRAD, u.goff), old).wait()
            g.add_(old)
        self._grad_writes.append((self.file.write(self._off(GRAD, u.goff), g), g))
        while len(self._grad_writes) > 2:  # bound the gradient shards held in memory until written
            req, _keep = self._grad_writes.pop(0)
            req.wait()

    def wait_grads(self) -> None:
        for req, _keep in self._grad_writes:
            req.wait()
        self._grad_writes.clear()

    def grad_sumsq(self, ranges: list[tuple[int, int]]) -> list[float]:
        """Sum of squares of the gradient over each element range [lo, hi) of the file, read back chunk by
        chunk (after accumulation, when the sums taken as shards arrived no longer hold)."""
        self.flush()
        out = [0.0] * len(ranges)
        for a, b in self.chunks:
            buf = self.bufs[0][GRAD, : b - a]
            self.file.read(self._off(GRAD, a), buf).wait()
            for k, (lo, hi) in enumerate(ranges):
                lo, hi = max(lo, a), min(hi, b)
                if hi > lo:
                    out[k] += float(torch.linalg.vector_norm(buf[lo - a:hi - a]).square())
        return out

    # the step --------------------------------------------------------------------------------------
    def _wait_writes(self, slot: int) -> None:
        for r in self._writes[slot]:
            r.wait()
        self._writes[slot].clear()

    def _wait_all_writes(self) -> None:
        for s in range(SLOTS):
            self._wait_writes(s)

    def _read(self, i: int, arrays) -> list:
        a, b = self.chunks[i]
        slot = i % SLOTS
        self._wait_writes(slot)  # the buffer's previous chunk must be on disk before it is overwritten
        buf = self.bufs[slot]
        return [self.file.read(self._off(k, a), buf[k, :b - a]) for k in arrays]

    def _stream(self, reads, writes, body, params: bool = False):
        """One pass over the chunks, a generator that yields each chunk's end after stepping it: read
        arrays ``reads`` of chunk i+1 while ``body(i, buf, n)`` works on chunk i, then write arrays
        ``writes`` of chunk i behind (and, with ``params`` and parameter offload, its compute-dtype
        parameters, converted from the new master).  Time spent inside it counts in ``step_s`` (waits for
        I/O in ``step_exposed_s``), whether it runs at once or interleaved with the next forward."""
        def timed(t0, e0):
            self.step_s += time.perf_counter() - t0
            self.step_exposed_s += self.file.exposed_s - e0
        t0, e0 = time.perf_counter(), self.file.exposed_s
        self._wait_all_writes()
        pending = {0: self._read(0, reads)}
        for i, (a, b) in enumerate(self.chunks):
            slot, n = i % SLOTS, b - a
            if i + 1 < len(self.chunks):  # queue the next read first, so the disk never idles
                pending[i + 1] = self._read(i + 1, reads)
            for r in pending.pop(i):
                r.wait()
            buf = self.bufs[slot]
            body(i, buf, n)
            w = [self.file.write(self._off(k, a), buf[k, :n]) for k in writes]
            if params and self.psize:  # the whole chunk in one write: gaps and padding carry their (zero) master
                pbuf = self.bufs[SLOTS + slot]
                pbuf[:n].copy_(buf[MASTER, :n])
                w.append(self.file.write(self._poff(a), pbuf[:n]))
            self._writes[slot], self._slot_chunk[slot] = w, i
            timed(t0, e0)
            yield b
            t0, e0 = time.perf_counter(), self.file.exposed_s
        timed(t0, e0)

    def _run(self, gen) -> None:
        for _ in gen:
            pass

    def step(self, lr: float, coef: float, publish, defer: bool = False) -> None:
        """One optimizer step streamed through memory (read ahead i+1 while stepping i, write i behind).
        ``coef`` multiplies the gradient (deferred unscale/clipping); ``publish(u, lo, hi, master_view)``
        receives the new master of unit ``u``'s shard-local range [lo, hi); with parameter offload the
        chunk's compute-dtype parameters are written to the file here.  AdamW is one pass; LAMB and LARS
        (:meth:`use_trust_ratio`) take two, since a trust ratio needs norms over whole tensors first.

        With ``defer`` (AdamW) the step only starts: :meth:`advance` steps the chunks up to a point of the
        file as the next forward needs each unit's new parameters, so the step's disk traffic overlaps
        that forward's compute (the file is laid out in the order the forward uses the units); every
        other access (gradients, checkpoints, :meth:`finish`) completes it first.  The arithmetic is the
        same as stepping at once."""
        self.finish()
        self.wait_grads()
        self.t += 1
        if self.trust is not None:
            return self._trust_step(lr, coef, publish)
        step = torch.tensor(float(self.t - 1))

        def adamw(i, buf, n):
            if coef != 1.0:
                buf[GRAD, :n].mul_(coef)
            segs = [Segment(buf[MASTER, o:o + k], buf[GRAD, o:o + k], buf[EXP_AVG, o:o + k],
                            buf[EXP_AVG_SQ, o:o + k], self.wd if decay else 0.0, step.clone())
                    for o, k, decay, _u, _l in self._plan[i]]
            FlatAdamW.step_segments(segs, lr, self.betas[0], self.betas[1], self.eps)
            self._publish(i, buf, publish)
        gen = self._stream((GRAD, MASTER, EXP_AVG, EXP_AVG_SQ), (MASTER, EXP_AVG, EXP_AVG_SQ), adamw, params=True)
        if defer:
            self._pending, self._done_upto = gen, 0
        else:
            self._run(gen)

    def advance(self, upto: int) -> None:
        """Step the deferred step's chunks until elements [0, upto) of the file are updated."""
        while self._pending is not None and self._done_upto < upto:
            try:
                self._done_upto = next(self._pending)
            except StopIteration:
                self._pending = None
            except BaseException:
                self._pending = None
                raise

    def finish(self) -> None:
        """Complete a deferred step (no-op when none is in progress)."""
        gen, self._pending = self._pending, None
        if gen is not None:
            self._run(gen)

    def _publish(self, i: int, buf, publish) -> None:
        for o, k, _d, u, lo in self._plan[i]:
            publish(u, lo, lo + k, buf[MASTER, o:o + k])

    # LAMB / LARS: two streamed passes ---------------------------------------------------------------
    def use_trust_ratio(self, rule, norms, pieces) -> None:
        """Step with a :class:`~podscale.optim.flat_lamb.TrustRatioRule` (LAMB, LARS) instead of AdamW.
        ``norms()`` makes a fresh :class:`~podscale.optim.flat_lamb.TrustRatioNorms` (it all-reduces over dp);
        ``pieces`` lists this rank's parts of every tensor as (tensor index, first element in the swap
        file's element space, length, weight decay)."""
        self.trust, self._norms = rule, norms
        self._pieces = []
        for a, b in self.chunks:  # per chunk: (offset in chunk, length, tensor index, weight decay)
            self._pieces.append([(max(a, s) - a, min(b, s + k) - max(a, s), idx, wd)
                                 for idx, s, k, wd in pieces if max(a, s) < min(b, s + k)])

    _ARRAY = {"grad": GRAD, "master": MASTER, "state1": EXP_AVG, "state2": EXP_AVG_SQ}

    def _chunk_pieces(self, i: int, buf):
        from podscale.optim.flat_lamb import Piece
        return [Piece(idx, buf[MASTER, o:o + k], buf[GRAD, o:o + k], buf[EXP_AVG, o:o + k],
                      buf[EXP_AVG_SQ, o:o + k], wd) for o, k, idx, wd in self._pieces[i]]

    def _trust_step(self, lr: float, coef: float, publish) -> None:
        """Pass 1 streams the chunks through the rule's ``measure`` (per-tensor squares; LAMB updates and
        writes back its moments); one all-reduce gives the global norms (You et al. 2019, Alg. 2; You et
        al. 2017, eq. 6).  Pass 2 streams them again through ``apply`` and writes what it changed, the
        compute-dtype parameters with it.  Each pass moves only the arrays the rule names."""
        rule = self.trust
        rule.begin_step()
        norms = self._norms()

        def measure(i, buf, n):
            if coef != 1.0:
                buf[GRAD, :n].mul_(coef)
            for p in self._chunk_pieces(i, buf):
                norms.add(p.index, *rule.measure(p))
        arrays = lambda names: tuple(sorted(self._ARRAY[x] for x in names))  # noqa: E731
        self._run(self._stream(arrays(rule.measure_reads), arrays(rule.measure_writes), measure))
        wn, xn = norms.reduce()

        def apply(i, buf, n):
            if rule.apply_uses_grad and coef != 1.0:
                buf[GRAD, :n].mul_(coef)
            for p in self._chunk_pieces(i, buf):
                rule.apply(p, float(wn[p.index]), float(xn[p.index]), lr)
            self._publish(i, buf, publish)
        self._run(self._stream(arrays(rule.apply_reads), arrays(rule.apply_writes), apply, params=True))

    def flush(self) -> None:
        self.finish()
        self.wait_grads()
        self._wait_all_writes()

    # checkpoints: one unit's range of one array at a time -----------------------------------------------
    _KIND = {"grad": GRAD, "master": MASTER, "exp_avg": EXP_AVG, "exp_avg_sq": EXP_AVG_SQ}

    def read_unit(self, kind: str, u) -> torch.Tensor:
        """Unit ``u``'s shard of array ``kind`` (``grad``, ``master``, ``exp_avg``, ``exp_avg_sq``), read into
        a new page-aligned fp32 buffer."""
        self.flush()
        out = aligned_empty(u.shard, torch.float32)
        self.file.read(self._off(self._KIND[kind], u.goff), out).wait()
        return out

    def write_unit(self, kind: str, u, t: torch.Tensor) -> None:
        self.flush()
        self.file.write(self._off(self._KIND[kind], u.goff), _staged(t.float())).wait()

    def close(self) -> None:
        """Remove the swap file.  The rest of a deferred step is dropped (its result would go with the file);
        requests in flight finish first, and their errors (already raised where they mattered, e.g. a full
        disk at the step) are not raised again: the state they belong to is being discarded."""
        if self._pending is not None:
            self._pending.close()
            self._pending = None
        for req in [r for r, _ in self._grad_writes] + [r for w in self._writes for r in w]:
            try:
                req.wait()
            except OSError:
                pass
        self._grad_writes.clear()
        self._writes = [[] for _ in range(SLOTS)]
        self.file.close()
