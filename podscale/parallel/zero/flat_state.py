"""ZeRO's flat optimizer state as one object: the fp32 master, the optimizer moments and the reduced gradient
of this rank's shard of every unit, behind one interface with two backends.

ZeRO (Rajbhandari et al. 2020, section 5.1) gives each data-parallel rank a contiguous slice of every
unit's flattened parameters and keeps the fp32 master and the optimizer state only for that slice;
ZeRO-Offload (Ren et al. 2021) keeps it in host memory and steps it on the CPU; ZeRO-Infinity
(Rajbhandari et al. 2021, sections 5-6) keeps it on NVMe and streams it through memory in chunks.  The
strategy (:class:`~podscale.parallel.zero.strategy.ZeroStrategy`) does what is the same in every case —
gathering parameters, reduce-scattering gradients, hooks — and asks a :class:`FlatState` for everything
that depends on where the state lives:

* :class:`MemoryFlatState` — flat tensors on the device, or in (pinned) host memory with
  ``offload_optimizer = cpu``; the optimizer steps them in place.
* :class:`NvmeFlatState` — ZeRO-Infinity: gradient, master and moments in a swap file
  (:class:`~podscale.parallel.zero.nvme.NvmeOptimizerState`), the compute-dtype parameter shard in memory
  or, with ``offload_param = nvme``, in the same file, read one block ahead of its all-gather.

Both run the same update functions: AdamW is :meth:`podscale.optim.flat_adam.FlatAdamW.step_segments`
(the NVMe backend calls it on each chunk's segments), LAMB and LARS are the
:class:`~podscale.optim.flat_lamb.TrustRatioRule` passes (the NVMe backend streams its chunks through them).

Checkpoints go unit by unit (:meth:`FlatState.read_unit` / :meth:`FlatState.write_unit`): the in-memory
backend hands out views, the NVMe backend reads one unit's range of one array at a time, so saving or
loading never holds more than a unit's shard of the state in memory.

At stage 3 the NVMe step may stream under the next forward (``step(defer=True)``, ZeRO-Infinity section
6.3): :meth:`FlatState.param_source` and :meth:`FlatState.prefetch_param` catch the step up to the unit the
forward needs, and :meth:`FlatState.finish_step` completes it; the in-memory backend always steps at once.
"""
from __future__ import annotations

import functools
import math
import time
from abc import ABC, abstractmethod

import torch
import torch.nn as nn

from podscale.optim import flat_lamb
from podscale.optim.flat_adam import FlatAdamW, Segment
from podscale.parallel.param_tags import tags
from podscale.parallel.zero.layout import Unit
from podscale.runtime import comm
from podscale.storage.aio import aligned_empty

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: the per-element fp32 arrays a checkpoint holds (``grad`` may also be read, for tests and tools)
MASTER, EXP_AVG, EXP_AVG_SQ, GRAD = "master", "exp_avg", "exp_avg_sq", "grad"
STATE_KINDS = (EXP_AVG, EXP_AVG_SQ)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class FlatState(ABC):
    """This rank's shard of ZeRO's optimizer state (see the module docstring).

    ``units`` are the strategy's units; each unit's shard starts at element ``u.goff`` of the rank's flat
    arrays, which the constructor assigns in ``order`` (stage 3: the order the forward uses the units).
    ``n_tensors`` and :meth:`pieces` number every parameter the same way on every rank (trust ratios).
    """

    def __init__(self, units: list[Unit], order: list[Unit], mesh, train, zero, stage: int, align: int = 1):
        self.units, self.mesh, self.stage = units, mesh, stage
        self.device = mesh.device
        self.cdtype = DTYPES[train.precision]
        self.rdtype = DTYPES[train.reduce_dtype] if train.reduce_dtype else self.cdtype
        self.betas, self.eps, self.weight_decay = (train.beta1, train.beta2), train.eps, train.weight_decay
        # gradient shard dtype: the reduce dtype (ZeRO's 2Ψ/N_d), fp32 on request or for LAMB/LARS (their
        # trust ratios read the gradient directly)
        wide = zero.grad_accum_dtype == "fp32" or zero.optimizer != "adamw"
        self.gdtype = torch.float32 if wide else self.rdtype
        self.optimizer_name = zero.optimizer
        off = 0
        for u in order:
            u.goff = off
            off = -(-(off + u.shard) // align) * align
        self.total = off
        # the unscale x clip factor deferred to the step, and whether an inf/NaN (fp16 overflow) was seen
        self.coef, self.nonfinite = 1.0, False

    # layout helpers -------------------------------------------------------------------------------------
    def pieces(self):
        """(tensor index, unit, [s, e) in the unit's shard, weight decay) of every parameter piece this rank
        holds; every rank numbers every tensor the same way."""
        index = 0
        for u in self.units:
            held = {i: (a, b) for i, a, b in u.shard_ranges()}
            for i, p in enumerate(u.params):
                if i in held:
                    yield (index, u, *held[i], self.weight_decay if p.dim() >= 2 else 0.0)
                index += 1

    @property
    def n_tensors(self) -> int:
        return sum(len(u.params) for u in self.units)

    def _allreduce_trust(self, t: torch.Tensor) -> None:
        """Sum the per-tensor squares ``t`` (2 x n_tensors) of the trust ratios over the ranks that hold
        pieces of each tensor: its unit's axes.  Under expert parallelism a dense tensor is sharded over dp x
        ep and an expert's over dp only (each ep rank's tensor at that index is another expert, so a sum over
        ep would mix experts): one all-reduce per group of axes.  A tensor split over tp (it has a tp layout:
        Megatron's shards, an expert's width split over tp) has pieces on the tp ranks too, so its squares are
        then summed over tp as well: a trust ratio is the whole tensor's (You et al. 2020, LAMB's per-layer
        norms), while a tensor each tp rank holds whole (a layer norm, a router) or another one of (an expert
        folded over ep x tp) counts alone."""
        for axes, idx in self._trust_groups:
            part = t if idx is None else t.index_select(1, idx.to(t.device))
            comm.all_reduce(part, self.mesh, axes)
            if idx is not None:
                t.index_copy_(1, idx.to(t.device), part)

    @functools.cached_property
    def _trust_groups(self) -> list[tuple[tuple[str, ...], torch.Tensor | None]]:
        """(mesh axes, tensor indices or None for all) of :meth:`_allreduce_trust`'s all-reduces, in order,
        fixed by the units: one per group of unit axes, then one over tp for the tensors split over it."""
        params = [p for u in self.units for p in u.params]
        axes = [u.axes for u in self.units for _ in u.params]
        distinct = sorted(set(axes))
        out = [(distinct[0], None)] if len(distinct) == 1 else [
            (g, torch.tensor([i for i, a in enumerate(axes) if a == g])) for g in distinct]
        split = [i for i, p in enumerate(params) if tags(p).tp_layout is not None]
        if split and self.mesh.size("tp") > 1:
            out.append((("tp",), torch.tensor(split)))
        return out

    # initial state ---------------------------------------------------------------------------------
    @abstractmethod
    def init_unit(self, u: Unit, master: torch.Tensor) -> None:
        """Take unit ``u``'s initial fp32 master shard (``u.full`` is allocated, stage 1's ``u.grad_full``
        too); called once per unit, in ``units`` order."""

    def initialized(self) -> None:
        """Every unit is initialised (build the optimizer)."""

    # parameters the model computes with --------------------------------------------------------------
    @abstractmethod
    def param_source(self, u: Unit) -> torch.Tensor:
        """The shard of unit ``u`` to all-gather into its compute buffer (compute dtype, or the fp32 master
        where the buffer is its own master), possibly in host memory; the NVMe backend first catches a
        deferred step up to ``u`` and waits for the shard's read."""

    def prefetch_param(self, u: Unit) -> None:
        """Start bringing ``u``'s shard where :meth:`param_source` finds it (NVMe parameter offload: a read
        one block ahead, ZeRO-Infinity section 6.3); nothing when it is in memory."""

    def drop_prefetched(self) -> None:
        """Discard prefetched shards no gather used (stale once the step updates them)."""

    # gradients --------------------------------------------------------------------------------------
    @abstractmethod
    def grad_shard(self, u: Unit) -> torch.Tensor | None:
        """``u``'s gradient shard in memory (a reduce-scatter may write into it), None where it is on disk."""

    @abstractmethod
    def receive_grad(self, u: Unit, out: torch.Tensor, fresh: bool) -> None:
        """Store (``fresh``: the first reduction since :meth:`zero_grad`) or accumulate ``u``'s reduced
        gradient shard ``out`` (the reduce dtype, on the device; may be :meth:`grad_shard` itself)."""

    @abstractmethod
    def end_reduction(self, unwritten: list[Unit]) -> None:
        """Every reduction of the step has been received; ``unwritten`` got no gradient (zero them)."""

    def zero_grad(self) -> None:
        self.coef, self.nonfinite = 1.0, False

    @abstractmethod
    def grads(self) -> list[torch.Tensor]:
        """fp32 gradient tensors the engine may scale and check in place (empty when deferred: 16-bit or
        on disk)."""

    @abstractmethod
    def scale_grads(self, coef) -> None:
        """Multiply the gradient by ``coef``, in place or deferred to the step (:meth:`pending_grad_scale`)."""

    def pending_grad_scale(self) -> float:
        return 1.0

    @abstractmethod
    def found_inf(self) -> torch.Tensor:
        """1-element float tensor on the mesh's device, > 0 when the gradient holds inf/NaN."""

    @abstractmethod
    def grad_pieces(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, this rank's part of its gradient — or a 1-element tensor holding that part's L2 norm
        where it is not in memory), unscaled by :meth:`pending_grad_scale`."""

    @abstractmethod
    def grad_sumsq(self) -> torch.Tensor:
        """1-element fp32 tensor on the mesh's device: this rank's sum of squares of its gradient shard
        (unscaled by :meth:`pending_grad_scale`)."""

    # the step ---------------------------------------------------------------------------------------
    @abstractmethod
    def step(self, lr: float, defer: bool) -> bool:
        """One optimizer step of the whole shard, the new master published to :meth:`param_source`.  With
        ``defer`` a backend may leave it running (True returned): it completes as :meth:`param_source` /
        :meth:`prefetch_param` catch up with it, or in :meth:`finish_step`."""

    def finish_step(self) -> None:
        """Complete a deferred step (nothing when none runs)."""

    @abstractmethod
    def step_count(self) -> int: ...

    @abstractmethod
    def set_step_count(self, t: int) -> None: ...

    # checkpoints ------------------------------------------------------------------------------------
    @abstractmethod
    def read_unit(self, kind: str, u: Unit) -> torch.Tensor:
        """``u``'s shard (``u.shard`` elements) of array ``kind`` (:data:`MASTER`, :data:`EXP_AVG`,
        :data:`EXP_AVG_SQ`, :data:`GRAD`): a view of the state where it is in memory, else a new tensor read
        from disk.  Hand it back to :meth:`write_unit` after changing it."""

    @abstractmethod
    def write_unit(self, kind: str, u: Unit, t: torch.Tensor) -> None:
        """Set ``u``'s shard of ``kind`` to ``t`` (a no-op copy when ``t`` is the view :meth:`read_unit`
        gave); a new master is published to :meth:`param_source`."""

    def reads_copy(self) -> bool:
        """True when :meth:`read_unit` returns a copy (the state is not in memory)."""
        return False

    # accounting -------------------------------------------------------------------------------------
    @abstractmethod
    def bytes_held(self) -> dict[str, int]:
        """Bytes this state keeps between steps: ``params`` (parameter shards it holds for gathers),
        ``grads``, ``optim`` in memory; the NVMe backend adds ``swap_buffers`` and ``on_disk``."""

    def close(self) -> None:
        """Release files and buffers (safe to call twice)."""


class MemoryFlatState(FlatState):
    """The state as flat tensors on the device, or in host memory with ``offload_optimizer = cpu``
    (ZeRO-Offload: pinned on CUDA, stepped by the CPU)."""

    def __init__(self, units, order, mesh, train, zero, stage):
        super().__init__(units, order, mesh, train, zero, stage)
        offload = zero.offload_optimizer != "none"
        self.param_cpu = zero.offload_param == "cpu"
        self.pin_params = self.param_cpu and self.device.type == "cuda"
        self.opt_device = torch.device("cpu") if offload else self.device
        self.pin = self.opt_device.type == "cpu" and self.device.type == "cuda"
        self.narrow = self.gdtype != torch.float32
        # stage 1: the shard is a view of the full gradient buffer when both are in the same place and dtype
        self.grad_in_full = stage == 1 and self.gdtype == self.cdtype and self.opt_device == self.device
        # the master aliases a persistent unit's compute buffer when it is fp32 in the same place
        self._alias = {u.index: u.persistent and self.cdtype == torch.float32 and not offload for u in units}
        self.grad_flat = self._empty(0 if self.grad_in_full else self.total, self.gdtype)
        self.exp_avg = self._empty(self.total, torch.float32)
        self.exp_avg_sq = self._empty(self.total, torch.float32)
        self.master_flat = self._empty(sum(u.shard for u in units if not self._alias[u.index]), torch.float32)
        self._moff = 0
        self._master: dict[int, torch.Tensor] = {}
        self._grad: dict[int, torch.Tensor] = {}
        # stage 3 (16-bit compute, offload): the compute-dtype gather source, kept apart from the master
        self._cshard: dict[int, torch.Tensor] = {}
        self._stage_offload = offload
        self._sumsq = 0.0
        self.optimizer: FlatAdamW | None = None
        self.trust: flat_lamb.FlatTrustRatio | None = None

    def _empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.zeros(n, dtype=dtype, device=self.opt_device)
        return t.pin_memory() if self.pin and self.opt_device.type == "cpu" else t

    def _view(self, flat: torch.Tensor, u: Unit) -> torch.Tensor:
        return flat[u.goff:u.goff + u.shard]

    def init_unit(self, u, master):
        if self._alias[u.index]:
            self._master[u.index] = u.full[u.lo:u.hi]
        else:
            m = self._master[u.index] = self.master_flat[self._moff:self._moff + u.shard]
            self._moff += u.shard
            m.copy_(master)
        self._grad[u.index] = u.grad_full[u.lo:u.hi] if self.grad_in_full else self._view(self.grad_flat, u)
        if not u.persistent and (self.cdtype != torch.float32 or self._stage_offload or self.param_cpu):
            # stage 3: the gather source; in host memory (pinned on CUDA) with offload_param=cpu
            c = master.to(self.cdtype).clone()
            if self.param_cpu:
                c = c.cpu().pin_memory() if self.pin_params else c.cpu()
            self._cshard[u.index] = c

    def initialized(self):
        if self.optimizer_name == "adamw":
            self.optimizer = FlatAdamW([self._segments(u) for u in self.units], self.betas, self.eps)
            return
        rule = flat_lamb.make_rule(self.optimizer_name, self.betas, self.eps)
        pieces = [flat_lamb.Piece(i, self._master[u.index][s:e], self._grad[u.index][s:e],
                                  self._view(self.exp_avg, u)[s:e], self._view(self.exp_avg_sq, u)[s:e], wd)
                  for i, u, s, e, wd in self.pieces()]
        self.trust = flat_lamb.FlatTrustRatio(rule, pieces, self.n_tensors, self._allreduce_trust, self.device)

    def _segments(self, u: Unit) -> list[Segment]:
        m, g = self._master[u.index], self._grad[u.index]
        ea, eas = self._view(self.exp_avg, u), self._view(self.exp_avg_sq, u)
        return [Segment(m[s:e], g[s:e], ea[s:e], eas[s:e], self.weight_decay if decay else 0.0,
                        torch.zeros((), dtype=torch.float32, device=self.opt_device))
                for s, e, decay in u.segments()]

    def param_source(self, u):
        c = self._cshard.get(u.index)
        return self._master[u.index] if c is None else c

    # gradients
    def grad_shard(self, u):
        return self._grad[u.index]

    def receive_grad(self, u, out, fresh):
        g = self._grad[u.index]
        if out is g:
            return
        if fresh:
            g.copy_(out, non_blocking=self.pin)
        else:
            # a later micro-batch (stages 2/3): one rounding per micro-batch into a 16-bit shard; blocking, so
            # the CPU add never reads the host copy before a device-to-host transfer lands
            g.add_(out.to(g.device))

    def _grad_tensors(self) -> list[torch.Tensor]:
        return [self._grad[u.index] for u in self.units] if self.grad_in_full else [self.grad_flat]

    def end_reduction(self, unwritten):
        if self.pin:  # gradient shards were copied to pinned host memory asynchronously: the CPU reads them next
            torch.cuda.current_stream(self.device).synchronize()
        for u in unwritten:
            self._grad[u.index].zero_()
        if self.narrow:
            # squared norm of the 16-bit shard, summed in fp32; inf/NaN (fp16 overflow) is what the
            # engine's overflow check reads from found_inf()
            self._sumsq = float(sum(torch.linalg.vector_norm(g, dtype=torch.float32).square()
                                    for g in self._grad_tensors()))
            self.nonfinite = not math.isfinite(self._sumsq)

    def grads(self):
        return [] if self.narrow else self._grad_tensors()

    def scale_grads(self, coef):
        if self.narrow:
            self.coef *= float(coef)
            return
        for g in self._grad_tensors():  # (on the host with optimizer offload, while ``coef`` is on the device)
            g.mul_(coef.to(g.device) if torch.is_tensor(coef) else coef)

    def pending_grad_scale(self):
        return self.coef if self.narrow else 1.0

    def found_inf(self):
        if self.narrow:
            return torch.tensor([float(self.nonfinite)], device=self.device)
        return sum((~torch.isfinite(g)).any().float() for g in self._grad_tensors()).reshape(1).to(self.device)

    def grad_pieces(self):
        return [(u.params[i], self._grad[u.index][a:b]) for u in self.units for i, a, b in u.shard_ranges()]

    def grad_sumsq(self):
        if self.narrow:
            return torch.tensor([self._sumsq], dtype=torch.float32, device=self.device)
        return sum(torch.linalg.vector_norm(g).square() for g in self._grad_tensors()).reshape(1).to(self.device)

    # the step
    def step(self, lr, defer):
        if self.trust is not None:
            self.trust.step(lr)
        else:
            coef = torch.tensor([self.coef], dtype=torch.float32, device=self.opt_device) if self.narrow else None
            self.optimizer.step(lr, grad_coef=coef)
        self._publish()
        return False

    def _publish(self) -> None:
        for u in self.units:
            c = self._cshard.get(u.index)
            if c is not None:
                c.copy_(self._master[u.index], non_blocking=self.pin)

    def step_count(self):
        if self.trust is not None:
            return self.trust.rule.t
        for group in self.optimizer.groups:
            for s in group:
                return int(float(s.step))
        return 0

    def set_step_count(self, t):
        if self.trust is not None:
            self.trust.rule.t = int(t)
            return
        for group in self.optimizer.groups:
            for s in group:
                s.step.fill_(float(t))

    # checkpoints
    def read_unit(self, kind, u):
        if kind == MASTER:
            return self._master[u.index]
        if kind == GRAD:
            return self._grad[u.index]
        return self._view(self.exp_avg if kind == EXP_AVG else self.exp_avg_sq, u)

    @torch.no_grad()
    def write_unit(self, kind, u, t):
        dst = self.read_unit(kind, u)
        if dst.data_ptr() != t.data_ptr():
            dst.copy_(t.reshape(-1))
        if kind == MASTER and u.index in self._cshard:
            self._cshard[u.index].copy_(dst)

    def bytes_held(self):
        return {"params": sum(_nbytes(c) for c in self._cshard.values()), "grads": _nbytes(self.grad_flat),
                "optim": _nbytes(self.exp_avg) + _nbytes(self.exp_avg_sq) + _nbytes(self.master_flat)}


class NvmeFlatState(FlatState):
    """ZeRO-Infinity: the state in a swap file on NVMe, streamed through chunk buffers at the step (see
    :mod:`podscale.parallel.zero.nvme`).  Memory keeps the compute-dtype shard of every unit, or with
    ``offload_param = nvme`` only that of persistent units (the others are read from the file one block
    ahead of their gather).

    A deferred step (stage 3, ``zero.nvme_overlap_step``) is caught up as the next forward asks for units:
    with parameter offload, units whose first piece is stepped on the way keep their new compute-dtype
    shard from the step's buffers for their gather (no write-then-read round trip to the disk)."""

    def __init__(self, units, order, mesh, train, zero, stage):
        from podscale.parallel.zero.nvme import ELEM_ALIGN, NvmeOptimizerState
        # swap-file shards start block-aligned (O_DIRECT transfers in place)
        super().__init__(units, order, mesh, train, zero, stage, align=ELEM_ALIGN)
        self.param_nvme = zero.offload_param == "nvme"
        chunk = int(zero.nvme_block_mb * 2**20) // 4
        self.swap = NvmeOptimizerState(units, self.total, zero.nvme_path, mesh.rank, chunk, self.betas, self.eps,
                                       self.weight_decay, param_dtype=self.cdtype if self.param_nvme else None)
        if self.optimizer_name != "adamw":
            rule = flat_lamb.make_rule(self.optimizer_name, self.betas, self.eps)
            pieces = [(i, u.goff + s, e - s, wd) for i, u, s, e, wd in self.pieces()]
            self.swap.use_trust_ratio(rule, lambda: flat_lamb.TrustRatioNorms(self.n_tensors, self._allreduce_trust,
                                                                               self.device), pieces)
        self._cshard: dict[int, torch.Tensor] = {}
        self._reads: dict[int, tuple] = {}       # unit index -> (request or None, buffer): parameter reads
        self._captured: dict[int, torch.Tensor] = {}
        self._capturing = False
        self.param_captured = 0
        self.param_wait_s = 0.0  # time stage-3 gathers spent waiting for parameter reads
        self.param_reads = self.param_demand_reads = self.param_dropped_reads = 0  # prefetch accounting
        self._fresh_norms = True
        self._piece_sq: dict[tuple[int, int], float] = {}  # (unit index, parameter index) -> squared norm

    def _on_disk(self, u: Unit) -> bool:
        return self.param_nvme and not u.persistent

    def init_unit(self, u, master):
        self.swap.write_master(u, master)
        if self._on_disk(u):
            self.swap.write_param(u, 0, master.to(self.cdtype))
        else:
            self._cshard[u.index] = master.to(self.cdtype).clone()

    # parameters
    def _catch_up(self, u: Unit) -> None:
        """Step a deferred step until the swap file's elements of ``u`` are updated (the forward needs them
        next), keeping the new shards of parameter-offloaded units it passes (:meth:`on_stepped`)."""
        self._capturing = self.param_nvme
        try:
            self.swap.advance(u.goff + u.shard)
        finally:
            self._capturing = False

    def prefetch_param(self, u):
        """Parameter offload to NVMe: start reading ``u``'s shard from the swap file into a page-aligned
        buffer, one block ahead of its all-gather (ZeRO-Infinity's prefetching of the parameters the next
        layer needs, section 6.3), so the disk works while the current block computes."""
        if not self._on_disk(u) or u.index in self._reads:
            return
        self._catch_up(u)
        buf = self._captured.pop(u.index, None)
        if buf is not None:
            self._reads[u.index] = (None, buf)
            self.param_captured += 1
            return
        buf = aligned_empty(u.shard, self.cdtype)
        self._reads[u.index] = (self.swap.read_param(u, buf), buf)
        self.param_reads += 1

    def param_source(self, u):
        self._catch_up(u)
        if not self._on_disk(u):
            return self._cshard[u.index]
        if u.index not in self._reads:
            self.param_demand_reads += 1
        self.prefetch_param(u)
        req, buf = self._reads.pop(u.index)
        t0 = time.perf_counter()
        if req is not None:  # (None: taken from the step's buffers)
            req.wait()
        self.param_wait_s += time.perf_counter() - t0
        return buf

    def drop_prefetched(self):
        for req, _buf in self._reads.values():
            if req is not None:
                req.wait()
            self.param_dropped_reads += 1
        self._reads.clear()
        self._captured.clear()

    def on_stepped(self, u: Unit, lo: int, hi: int, master: torch.Tensor) -> None:
        """The step has updated ``u``'s shard-local range [lo, hi) to ``master`` (a view of a chunk buffer):
        refresh the in-memory compute-dtype shard; offloaded parameters are written by the step's chunk
        write, and kept here only for a forward that is catching up with a deferred step."""
        c = self._cshard.get(u.index)
        if c is not None:
            c[lo:hi].copy_(master)
            return
        if not self._on_disk(u):
            return
        buf = self._captured.get(u.index)
        if buf is None and self._capturing and lo == 0:  # the unit's first piece: keep the whole shard
            buf = self._captured[u.index] = torch.zeros(u.shard, dtype=self.cdtype, device="cpu")  # (padding stays 0)
        if buf is not None:
            buf[lo:hi].copy_(master)

    # gradients
    def grad_shard(self, u):
        return None

    def receive_grad(self, u, out, fresh):
        if not torch.isfinite(out).all():
            self.nonfinite = True  # fp16 overflow: the engine's check sees it in found_inf()
        if fresh:  # squared norm per parameter piece (the model-parallel norm needs them by kind)
            for i, a, b in u.shard_ranges():
                self._piece_sq[(u.index, i)] = float(torch.linalg.vector_norm(out[a:b].float()).square())
        else:
            self._fresh_norms = False
        self.swap.add_grad(u, out.to("cpu"), fresh)

    def end_reduction(self, unwritten):
        for u in unwritten:  # no gradient this step: a zero shard on disk
            self.receive_grad(u, torch.zeros(u.shard, device="cpu"), True)

    def zero_grad(self):
        super().zero_grad()
        self._fresh_norms = True
        self._piece_sq.clear()

    def grads(self):
        return []

    def scale_grads(self, coef):
        """Kept as a factor the streamed step applies in fp32 to each chunk (no extra pass over disk)."""
        self.coef *= float(coef)

    def pending_grad_scale(self):
        return self.coef

    def found_inf(self):
        return torch.tensor([float(self.nonfinite)], device=self.device)

    def _piece_norms(self) -> list[tuple[nn.Parameter, float]]:
        """(parameter, squared L2 norm of the part of its gradient this rank holds), from the shards as they
        arrived or, after accumulation over micro-batches, read back from the swap file."""
        keys = [(u, i, a, b) for u in self.units for i, a, b in u.shard_ranges()]
        if self._fresh_norms:
            sq = [self._piece_sq.get((u.index, i), 0.0) for u, i, _a, _b in keys]
        else:
            sq = self.swap.grad_sumsq([(u.goff + a, u.goff + b) for u, _i, a, b in keys])
        return [(u.params[i], s) for (u, i, _a, _b), s in zip(keys, sq)]

    def grad_pieces(self):
        return [(p, torch.tensor([math.sqrt(sq)])) for p, sq in self._piece_norms()]

    def grad_sumsq(self):
        local = sum(self._piece_sq.values()) if self._fresh_norms else self.swap.grad_sumsq([(0, self.swap.S)])[0]
        return torch.tensor([local], dtype=torch.float32, device=self.device)

    # the step
    def step(self, lr, defer):
        self.finish_step()
        self.drop_prefetched()
        defer = defer and self.swap.trust is None  # LAMB/LARS: two passes, the norms need the whole shard first
        self.swap.step(lr, self.coef, self.on_stepped, defer=defer)
        return defer

    def finish_step(self):
        self.swap.finish()
        self._captured.clear()

    def step_count(self):
        return self.swap.t

    def set_step_count(self, t):
        self.swap.t = int(t)
        if self.swap.trust is not None:
            self.swap.trust.t = int(t)

    # checkpoints
    def reads_copy(self):
        return True

    def read_unit(self, kind, u):
        self.finish_step()
        return self.swap.read_unit(kind, u)

    @torch.no_grad()
    def write_unit(self, kind, u, t):
        self.finish_step()
        self.swap.write_unit(kind, u, t)
        if kind != MASTER:
            return
        if self._on_disk(u):
            self.swap.write_param(u, 0, t.reshape(-1).to(self.cdtype))
        else:
            self._cshard[u.index].copy_(t.reshape(-1))

    def bytes_held(self):
        return {"params": sum(_nbytes(c) for c in self._cshard.values()), "grads": 0, "optim": 0,
                "swap_buffers": sum(_nbytes(b) for b in self.swap.bufs), "on_disk": self.swap.file.size}

    def close(self):
        if self.swap is not None:
            self.swap.close()
            self.swap = None


def make_flat_state(units: list[Unit], order: list[Unit], mesh, train, zero, stage: int) -> FlatState:
    """The backend ``zero.offload_optimizer`` selects (``nvme``: :class:`NvmeFlatState`, else
    :class:`MemoryFlatState`)."""
    cls = NvmeFlatState if zero.offload_optimizer == "nvme" else MemoryFlatState
    return cls(units, order, mesh, train, zero, stage)
