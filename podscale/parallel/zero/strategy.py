"""ZeRO stages 1, 2 and 3 as a training strategy for :class:`~podscale.train.engine.Engine`.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", section 5:
with ``Ψ`` parameters, ``N_d`` data-parallel ranks and ``K`` bytes of optimizer state per parameter
(K = 12 for mixed-precision Adam: fp32 master, momentum, variance), model states per rank are

    stage 0 (replicated):      2Ψ + 2Ψ + KΨ
    stage 1 (P_os):            2Ψ + 2Ψ + KΨ/N_d
    stage 2 (P_os+g):          2Ψ + (2+K)Ψ/N_d
    stage 3 (P_os+g+p):        (2+2+K)Ψ/N_d

(fp32 training: 4-byte parameters and gradients, and the parameter is its own master, K = 8).

How each stage is built here (see :mod:`podscale.parallel.zero.layout` for the flat layout):

* **Stage 1.**  Parameters are views into persistent flat unit buffers; gradients are views into full flat
  gradient buffers (accumulated locally under ``no_sync``).  On the last micro-batch each bucket is
  reduce-scattered (asynchronously, from the post-accumulate-grad hook that completes it) so each rank
  receives the summed gradient of its own slice only; it steps its slice of the fp32 master and moments
  and all-gathers the updated parameters (ZeRO section 5.1, also the "weight-update sharding" of
  Xu et al. 2020 used on TPU pods).  The all-gather overlaps until the next forward starts.
* **Stage 2.**  As stage 1, but no full gradient buffer persists: each parameter's gradient is copied into
  its bucket's staging buffer as soon as it is accumulated and the parameter's ``.grad`` is dropped; full
  buckets are reduce-scattered during backward and accumulated into the gradient shard (ZeRO 5.2),
  on every micro-batch (the shard is where accumulation happens, so ``no_sync`` has nothing to save).
  Under a pipeline schedule (:meth:`ZeroStrategy.accumulate_locally`) stages 2 and 3 instead accumulate
  each micro-batch's gradient in ``.grad`` as stage 1 does and reduce-scatter once per step, on the
  chunk's last backward (what Megatron's distributed optimizer and FSDP2 with pipelines do: a pipeline
  stage interleaves the backwards of many micro-batches, so reducing each would cost ``m`` reduce-scatters
  per step; the full gradient of this stage's chunks lives only during the step, in the compute dtype as
  stage 1's buffers).
* **Stage 3.**  Parameters are sharded too (ZeRO 5.3).  Each block's flat buffer is a tensor whose storage
  is allocated only while the block is in use: a forward pre-hook waits for its all-gather and prefetches
  the next block's; a forward post-hook frees the storage; an identity autograd function on the block's
  output re-gathers it (and prefetches the previous block) when backward reaches it; after its gradients
  are reduce-scattered the storage is freed again.  Parameters with fewer than
  ``param_persistence_threshold`` elements stay whole, and the remaining top-level parameters (embeddings,
  the tied output head) form a root unit gathered for the whole forward+backward.
  On a CPU device, glibc's dynamic mmap threshold lets the heap keep its high-water mark resident; stage 3
  therefore fixes the threshold (``zero.host_mmap_threshold_mb``, see :mod:`podscale.runtime.hostmem`;
  default glibc's cap, 32 MiB) and the trim threshold with it, asks for transparent huge pages on each
  block buffer, and trims the heap once the step's gradients are reduced.  Stage 2/3
  gradient staging buckets are reused from a small pool during backward (at most
  ``max_inflight_reduce + 1`` bucket sizes) and dropped when the step's reduction is complete.
  ``zero.reshard_after_forward = false`` (FSDP2's name for it) keeps a block gathered from its first
  forward until its gradients are reduce-scattered: one all-gather per block and reduction instead of two
  (with a pipeline: one per step instead of ``2m``), for the memory of all of this rank's blocks at once.

Sequence parallelism (Korthikanti et al. 2022, 4.2.2): parameters marked ``sequence_parallel`` (layer
norms, position embedding, row-parallel biases under tp) hold partial gradients on each tp rank.  Their
ranges of a unit's gradient buffer are summed over tp right before the unit's dp reduce-scatter (one small
all-reduce per unit that has any), so every stage reduces complete gradients, overlapped with backward.

Mixed precision: with ``precision = bf16|fp16`` the parameters the model computes with (the unit buffers)
are 16-bit copies and the fp32 master slice lives with the optimizer; gradients are reduced in
``train.reduce_dtype`` (default: the compute dtype) and the gradient shard keeps that dtype: 2 bytes per
parameter in mixed precision, as in ZeRO's 2Ψ/N_d and DeepSpeed.  The fused optimizer step upcasts it in
L2-sized chunks; loss-scale unscaling and clipping are folded into one fp32 coefficient applied there
(never rounded in 16 bits, and fp16 gradients never underflow by unscaling).  Micro-batches accumulate
into the 16-bit shard with one rounding per micro-batch (DeepSpeed's default ``grad_accum_dtype``; the
relative error of an A-term sum grows like sqrt(A)·2^-9 for bf16, the order of the bf16 reduction across
ranks itself); ``zero.grad_accum_dtype = fp32`` keeps a 4-byte shard and accumulates exactly.  With
``reduce_dtype = fp32`` the shard is fp32 and everything is exactly the fp32 path.  Stage 1's shard is a
view of its full gradient buffer when both have the same dtype (no extra memory: 2Ψ + 2Ψ + 12Ψ/N_d).

Offload (ZeRO-Offload, Ren et al. 2021; ZeRO-Infinity, Rajbhandari et al. 2021): with
``offload_optimizer = cpu`` the fp32 master, moments and gradient shard live in (pinned, on CUDA) host
memory and the step runs there on the CPU; ``nvme`` streams them through :mod:`podscale.storage`.
"""
from __future__ import annotations

import collections
import contextlib
import math
import time

import torch
import torch.nn as nn

from podscale.optim.flat_adam import FlatAdamW, Segment
from podscale.parallel.strategy import DataParallelStrategy, LocalMicroBatches
from podscale.parallel.zero.layout import Unit, bucket_units, layer_units
from podscale.parallel.zero import state as zstate
from podscale.runtime import comm, hostmem
from podscale.storage.aio import aligned_empty

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ZeroError(ValueError):
    """A ZeRO configuration that cannot run; the message names the key and the fix."""


def check_zero_config(zero) -> None:
    """Raise :class:`ZeroError` for impossible combinations before anything is allocated.

    The rules live in one place, :class:`podscale.config.ZeroSection`'s validator; this re-runs them for
    settings that did not come through a validated config (e.g. built with ``model_construct``)."""
    from pydantic import ValidationError

    from podscale.config import ZeroSection
    try:
        ZeroSection.model_validate(zero.model_dump() if hasattr(zero, "model_dump") else dict(vars(zero)))
    except ValidationError as err:
        raise ZeroError(err.errors()[0]["msg"].removeprefix("Value error, ")) from None


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass (e.g. activation checkpointing recomputes)."""
    return torch._C._current_graph_task_id() != -1


class _RegatherBeforeBackward(torch.autograd.Function):
    """Identity on a unit's output whose backward gathers the unit before its own backward runs."""

    @staticmethod
    def forward(ctx, strategy, unit, x):
        ctx.strategy, ctx.unit = strategy, unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.strategy._backward_gather(ctx.unit)
        return None, None, g


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) ranges with neighbours joined (fewer, larger copies)."""
    out: list[tuple[int, int]] = []
    for o, n in sorted(ranges):
        if out and out[-1][0] + out[-1][1] == o:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((o, n))
    return out


class ZeroStrategy(LocalMicroBatches, DataParallelStrategy):
    """ZeRO-``stage`` data parallelism over the mesh's ``dp`` axis (see the module docstring).

    ``module`` is a plain model on ``mesh.device``; ``train`` is the :class:`~podscale.config.TrainSection`
    (lr, betas, eps, weight decay, precision, reduce dtype) and ``zero`` the
    :class:`~podscale.config.ZeroSection`.  A model built on the ``meta`` device is materialised one unit
    at a time by ``param_init(name, tensor)`` (ZeRO-3's ``zero.Init``: the whole model never exists on one
    rank); its parameters are then replaced by views of the unit buffers.
    """

    max_inflight_reduce = 2  # stage 2/3 staging buffers alive at once (bounds gradient memory)
    sums_sequence_parallel = True  # wrappers leave the tp sum of sequence-parallel gradients to ZeRO
    reduce_commutes = False        # a reduce-scatter needs the full tp/pp sums first

    def __init__(self, module: nn.Module, mesh, train, zero, param_init=None):
        if zero.stage not in (1, 2, 3):
            raise ZeroError(f"ZeroStrategy runs stages 1-3 (got zero.stage={zero.stage}); stage 0 is "
                            "podscale.parallel.data.DataParallel")
        check_zero_config(zero)
        self.module, self.mesh, self.stage, self.zcfg = module, mesh, zero.stage, zero
        self.axes = "dp"
        self.dp, self.dp_rank = mesh.size("dp"), mesh.local_rank("dp")
        self.device = mesh.device
        self.cdtype = _DTYPES[train.precision]
        self.rdtype = _DTYPES[train.reduce_dtype] if train.reduce_dtype else self.cdtype
        self.opt_device = torch.device("cpu") if zero.offload_optimizer in ("cpu", "nvme") else self.device
        self.offload = zero.offload_optimizer != "none"
        self.nvme = zero.offload_optimizer == "nvme"
        self.param_nvme = zero.offload_param == "nvme"
        self.param_cpu = zero.offload_param == "cpu"
        self.pin_params = self.param_cpu and self.device.type == "cuda"
        if self.param_nvme and not self.nvme:
            raise ZeroError("zero.offload_param='nvme' is implemented together with "
                            "zero.offload_optimizer='nvme': set both to nvme")
        self.betas, self.eps = (train.beta1, train.beta2), train.eps
        # gradient shard dtype: the reduce dtype (ZeRO's 2Ψ/N_d), fp32 on request or for LAMB/LARS (their
        # trust ratios read the gradient directly)
        wide = getattr(zero, "grad_accum_dtype", None) == "fp32" or getattr(zero, "optimizer", "adamw") != "adamw"
        self.gdtype = torch.float32 if wide else self.rdtype
        self.narrow = self.gdtype != torch.float32 and zero.offload_optimizer != "nvme"
        self.pin = self.opt_device.type == "cpu" and self.device.type == "cuda"
        self.weight_decay = train.weight_decay
        self._sync = True
        self._inflight: collections.deque = collections.deque()
        self._staging_pool: list[torch.Tensor] = []  # stages 2/3: free staging buffers, during backward
        self._huge = False  # stage 3 on a CPU: block buffers are mmapped; ask for huge pages on them
        self._param_gathers: list = []
        self._ck: dict[str, torch.Tensor] = {}
        self._written: set[int] = set()
        self.reshard_after_forward = getattr(zero, "reshard_after_forward", True)
        self.overlap_step = getattr(zero, "nvme_overlap_step", True)  # (NVMe, stage 3; settable between steps)
        self.accumulate = False          # stages 2/3: accumulate in .grad under no_sync (accumulate_locally)
        self._deferred: set[int] = set()  # parameters reduced only in finish_grad_sync (accumulate_locally)
        self._done: dict[int, set[int]] = {}  # stage 3, local accumulation: params whose backward ran, per unit

        named = list(module.named_parameters())  # tied parameters once, under their first name
        named = [(n, p) for n, p in named if p.requires_grad]
        self.aliases: dict[int, list[str]] = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            self.aliases.setdefault(id(p), []).append(n)
        cap = int(zero.reduce_bucket_mb * 2**20)
        if self.stage == 3:
            self.layers, persistent, self.root = layer_units(module, named, zero.param_persistence_threshold,
                                                             self.dp, self.dp_rank, cap)
            self.units = self.layers + ([self.root] if self.root else []) + persistent
        else:
            self.layers, self.root = [], None
            self.units = bucket_units(named, cap, self.dp, self.dp_rank)
        # sequence-parallel parameters: (offset, numel) ranges per unit, summed over tp before the reduce
        sp = mesh.size("tp") > 1
        self._tp_ranges = {id(u): _merge([(o, n) for p, o, n in zip(u.params, u.offsets, u.numels)
                                          if sp and getattr(p, "sequence_parallel", False)]) for u in self.units}
        self._layer_ids = {id(u) for u in self.layers}
        if self.stage == 3 and self.device.type == "cpu" and self.layers:
            mb = getattr(zero, "host_mmap_threshold_mb", None)
            # default glibc's cap (32 MiB): blocks below it reuse heap memory (no page faults per gather),
            # larger ones are mmapped and leave on release; a fixed threshold stops the dynamic growth that
            # let the heap keep every released block.  Measured on bench/zero.py stage 3 (28 MB blocks, idle
            # machine): 32 MiB 0.76-0.80 s/step at 1375-1436 MiB peak RSS; half a block (14 MB, every
            # gather faulted in) 1.0-1.1 s at 1055-1079 MiB; glibc's dynamic default 0.66-0.75 s at
            # 1674-1791 MiB (FSDP2: 0.98-1.05 s at 1618-1780 MiB).
            nbytes = 32 << 20 if mb is None else int(mb * 2**20)
            if nbytes > 0:
                self._huge = hostmem.set_mmap_threshold(nbytes)
        self.param_init = param_init
        self._owners: dict[int, list] = {}
        for mod in module.modules():
            for attr, p in mod._parameters.items():
                if p is not None:
                    self._owners.setdefault(id(p), []).append((mod, attr))
        self._allocate()
        if self._huge:  # the model's original weights, freed into the heap by the move into unit buffers
            hostmem.trim_heap()
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        self.optimizer = FlatAdamW([] if self.nvme else [self._segments(u) for u in self.units],
                                   (train.beta1, train.beta2), train.eps)
        self.alt_optimizer = self._trust_ratio_optimizer(getattr(zero, "optimizer", "adamw"), train)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for u in self.units for p in u.params]
        self._hooks.append(module.register_forward_pre_hook(self._pre_model))
        self._hooks.append(module.register_forward_hook(self._post_model))
        for u in self.layers:
            self._hooks.append(u.module.register_forward_pre_hook(self._make_pre(u)))
            self._hooks.append(u.module.register_forward_hook(self._make_post(u)))

    # allocation ------------------------------------------------------------------------------------
    def _empty(self, n, dtype, device):
        t = torch.zeros(n, dtype=dtype, device=device)
        return t.pin_memory() if self.pin and device.type == "cpu" else t

    def _allocate(self) -> None:
        """Build each unit's flat buffers from the module's current weights (rank 0's, broadcast)."""
        total = sum(u.shard for u in self.units)
        order = self.units
        if self.nvme and self.stage == 3:
            # the swap file in the order the forward uses the units: a deferred step (NvmeOptimizerState.step)
            # runs front to back while the next forward catches up with it
            order = [u for u in self.units if u.persistent] + ([self.root] if self.root else []) + self.layers
        off = 0
        for u in order:
            u.goff = off
            off += u.shard
            if self.nvme:  # swap-file shards start block-aligned (O_DIRECT transfers in place)
                from podscale.parallel.zero.nvme import ELEM_ALIGN
                off = -(-off // ELEM_ALIGN) * ELEM_ALIGN
        # fp32 optimizer flats for this rank's slices: gradient, Adam moments; the master only where the
        # parameter buffer cannot be its own master (16-bit compute, offload, or stage-3 unit).
        self.swap = None
        if self.nvme:
            # ZeRO-Infinity: gradient, master and moments live in the swap file; memory keeps the
            # compute-dtype shard (every unit's; persistent units all-gather from it after the step)
            from podscale.parallel.zero.nvme import NvmeOptimizerState
            chunk = int(self.zcfg.nvme_block_mb * 2**20) // 4
            self.swap = NvmeOptimizerState(self.units, off, self.zcfg.nvme_path, self.mesh.rank, chunk,
                                           self.betas, self.eps, self.weight_decay,
                                           param_dtype=self.cdtype if self.param_nvme else None)
            self._param_reads: dict[int, tuple] = {}
            self._persist_pending = False  # a deferred step has yet to all-gather the persistent units
            # parameter offload with a deferred step: new compute-dtype shards taken from the step's chunk
            # buffers for the forward that is catching up with it (no write-then-read round trip to disk)
            self._captured: dict[int, torch.Tensor] = {}
            self._capturing = False
            self.param_captured = 0
            self._head_end = max((u.goff + u.shard for u in self.units if u.persistent), default=0)
            self.param_wait_s = 0.0  # time stage-3 gathers spent waiting for parameter reads
            self.param_reads = self.param_demand_reads = self.param_dropped_reads = 0  # prefetch accounting
            self._fresh: set[int] = set()
            self._norm_exact = True
            self._piece_sq: dict[tuple[int, int], float] = {}  # (unit, parameter index) -> squared norm
            total = 0
        # stage 1: the shard is a view of the full gradient buffer when both are in the same place and dtype
        self.grad_in_full = self.stage == 1 and self.gdtype == self.cdtype and self.opt_device == self.device
        self.grad_flat = self._empty(0 if self.grad_in_full else total, self.gdtype, self.opt_device)
        # 16-bit or NVMe gradient shards: the unscale x clip factor, applied in fp32 at the step, and whether
        # an inf/NaN (fp16 overflow) was seen
        self._coef, self._nonfinite = 1.0, False
        self._sumsq = 0.0
        self.exp_avg = self._empty(total, torch.float32, self.opt_device)
        self.exp_avg_sq = self._empty(total, torch.float32, self.opt_device)
        alias = [self._aliases_master(u) and not self.nvme for u in self.units]
        master_total = 0 if self.nvme else sum(u.shard for u, a in zip(self.units, alias) if not a)
        self.master_flat = self._empty(master_total, torch.float32, self.opt_device)
        moff = 0
        with torch.no_grad():
            for u, a in zip(self.units, alias):
                full = torch.zeros(u.padded, dtype=torch.float32, device=self.device)
                for p, o, n, name in zip(u.params, u.offsets, u.numels, u.names):
                    if p.is_meta:
                        if self.param_init is None:
                            raise ZeroError(f"parameter '{name}' is on the meta device: pass param_init to "
                                            "ZeroStrategy to materialise it")
                        self.param_init(name, full[o:o + n].view(p.shape))
                    else:
                        full[o:o + n].copy_(p.detach().reshape(-1))
                comm.broadcast(full, 0, self.mesh, self.axes)  # every replica starts from rank 0's weights
                mine = full[u.lo:u.hi]
                s = slice(u.goff, u.goff + u.shard)
                u.full = full if self.cdtype == torch.float32 else full.to(self.cdtype)
                if self.nvme:
                    self.swap.write_master(u, mine)
                    if self.param_nvme and not u.persistent:
                        self.swap.write_param(u, 0, mine.to(self.cdtype))
                    else:
                        u.cshard = mine.to(self.cdtype).clone()
                    u.master = None
                elif a:
                    u.master = u.full[u.lo:u.hi]
                else:
                    u.master = self.master_flat[moff:moff + u.shard]
                    moff += u.shard
                    u.master.copy_(mine)
                if not self.nvme:
                    u.exp_avg, u.exp_avg_sq = self.exp_avg[s], self.exp_avg_sq[s]
                    if not self.grad_in_full:
                        u.grad = self.grad_flat[s]
                if not u.persistent and not self.nvme and (self.cdtype != torch.float32 or self.offload
                                                            or self.param_cpu):
                    # stage 3: the gather source; in host memory (pinned on CUDA) with offload_param=cpu
                    u.cshard = mine.to(self.cdtype).clone()
                    if self.param_cpu:
                        u.cshard = u.cshard.cpu().pin_memory() if self.pin_params else u.cshard.cpu()
                for i, (p, o, n, shape) in enumerate(zip(u.params, u.offsets, u.numels, u.shapes)):
                    if p.is_meta:  # a new Parameter over the buffer, under every name it had
                        # not a view (a view would share the buffer's version counter, which the
                        # in-place all-gathers bump): an empty Parameter whose data is set to the view
                        newp = nn.Parameter(torch.empty(0, dtype=u.full.dtype, device=self.device),
                                            requires_grad=p.requires_grad)
                        newp.data = u.full[o:o + n].view(shape)
                        for mod, attr in self._owners.get(id(p), []):
                            mod._parameters[attr] = newp
                        self.aliases[id(newp)] = self.aliases.pop(id(p), [u.names[i]])
                        u.params[i] = newp
                        continue
                    p.data = u.full[o:o + n].view(shape)
                    p.grad = None
                u.pos = {id(p): i for i, p in enumerate(u.params)}
                if self.stage == 1:
                    u.grad_full = torch.zeros(u.padded, dtype=self.cdtype, device=self.device)
                    for p, o, n, shape in zip(u.params, u.offsets, u.numels, u.shapes):
                        p.grad = u.grad_full[o:o + n].view(shape)
                    if self.grad_in_full:
                        u.grad = u.grad_full[u.lo:u.hi]
                del full, mine
                if not u.persistent:
                    self._free(u)

    def _aliases_master(self, u: Unit) -> bool:
        return u.persistent and self.cdtype == torch.float32 and not self.offload

    def _trust_ratio_optimizer(self, name: str, train):
        """LAMB or LARS over this rank's pieces of every tensor (see podscale.optim.flat_lamb)."""
        if name == "adamw":
            return None

        def allreduce(t):
            comm.all_reduce(t, self.mesh, self.axes)

        def owned_pieces():
            """(tensor index, unit, [s, e) in the unit's shard, weight decay) of every piece this rank holds;
            every rank numbers every tensor the same way, so trust-ratio norms can be summed by index."""
            index = 0
            for u in self.units:
                held = {i: (a, b) for i, a, b in u.shard_ranges()}
                for i, p in enumerate(u.params):
                    if i in held:
                        yield (index, u, *held[i], self.weight_decay if p.dim() >= 2 else 0.0)
                    index += 1

        count = sum(len(u.params) for u in self.units)
        if self.nvme:  # streamed in two passes over the swap file (NvmeOptimizerState._trust_step)
            pieces = [(index, u.goff + s, e - s, wd) for index, u, s, e, wd in owned_pieces()]
            self.swap.use_trust_ratio(name, allreduce, count, pieces)
            return None
        from podscale.optim.flat_lamb import FlatLamb, FlatLars, Piece
        pieces = [Piece(index, u.master[s:e], u.grad[s:e], u.exp_avg[s:e], u.exp_avg_sq[s:e], wd)
                  for index, u, s, e, wd in owned_pieces()]
        if name == "lamb":
            return FlatLamb(pieces, count, allreduce, (train.beta1, train.beta2), train.eps)
        return FlatLars(pieces, count, allreduce, momentum=train.beta1)

    def _segments(self, u: Unit) -> list[Segment]:
        segs = []
        for s, e, decay in u.segments():
            segs.append(Segment(u.master[s:e], u.grad[s:e], u.exp_avg[s:e], u.exp_avg_sq[s:e],
                                self.weight_decay if decay else 0.0,
                                torch.zeros((), dtype=torch.float32, device=self.opt_device)))
        return segs

    # stage 3: gather / release ---------------------------------------------------------------------
    def _free(self, u: Unit) -> None:
        if u.gather_handle is not None:
            u.gather_handle.wait()
            u.gather_handle = None
        u.full.untyped_storage().resize_(0)
        u.gathered = False
        u.src_tmp = None

    def _gather(self, u: Unit, async_op: bool) -> None:
        if u.persistent or u.gathered:
            if not async_op and u.gather_handle is not None:
                u.gather_handle.wait()
                u.gather_handle = None
            return
        if self.swap is not None:  # a deferred NVMe step: this unit's new parameters first
            self._advance_for_forward(u.goff + u.shard)
        u.full.untyped_storage().resize_(u.padded * u.full.element_size())
        if self._huge:
            hostmem.advise_huge_pages(u.full)
        src = u.cshard if u.cshard is not None else u.master
        if src is not None and src.device != self.device:  # parameter shard offloaded to host memory
            src = u.src_tmp = src.to(self.device, non_blocking=True)
        if src is None:  # parameter shard on NVMe: wait for its (usually prefetched) read, then gather
            if id(u) not in self._param_reads:
                self.param_demand_reads += 1
            self._read_param(u)
            req, buf = self._param_reads.pop(id(u))
            t0 = time.perf_counter()
            if req is not None:  # (None: taken from the step's buffers)
                req.wait()
            self.param_wait_s += time.perf_counter() - t0
            src = u.src_tmp = buf.to(self.device)
        with torch.no_grad():
            h = comm.all_gather(u.full, src, self.mesh, self.axes, async_op=True)
        u.gathered = True
        u.gather_handle = h
        if not async_op:
            h.wait()
            u.gather_handle = None

    def _read_param(self, u: Unit | None) -> None:
        """Parameter offload to NVMe: start reading unit ``u``'s shard from the swap file into a
        page-aligned buffer, one block ahead of its all-gather (ZeRO-Infinity's prefetching of the
        parameters the next layer needs, section 6.3), so the disk works while the current block computes."""
        if (u is None or not self.param_nvme or u.persistent or u.gathered or u.cshard is not None
                or id(u) in self._param_reads):
            return
        self._advance_for_forward(u.goff + u.shard)
        buf = self._captured.pop(id(u), None)
        if buf is not None:
            self._param_reads[id(u)] = (None, buf)
            self.param_captured += 1
            return
        buf = aligned_empty(u.shard, self.cdtype)
        self._param_reads[id(u)] = (self.swap.read_param(u, buf), buf)
        self.param_reads += 1

    def _drop_param_reads(self) -> None:
        """Discard prefetched parameter reads that no gather used (stale once the step updates them)."""
        for req, _buf in self._param_reads.values():
            if req is not None:
                req.wait()
            self.param_dropped_reads += 1
        self._param_reads.clear()
        self._captured.clear()

    def _advance_for_forward(self, upto: int) -> None:
        """Step a deferred NVMe step until the swap file's elements [0, upto) are updated (the forward
        needs them next).  With parameter offload, units whose first piece is stepped on the way keep
        their new compute-dtype shard in memory for their gather (:meth:`_publish_range`): at most the
        unit or two a chunk reaches past ``upto``."""
        self._capturing = self.param_nvme
        try:
            self.swap.advance(upto)
        finally:
            self._capturing = False

    def _layer(self, i: int) -> Unit | None:
        return self.layers[i] if 0 <= i < len(self.layers) else None

    def _make_pre(self, u: Unit):
        def hook(_m, _args):
            self._gather(u, async_op=False)
            if _in_backward():  # activation recomputation: the block was gathered for its backward
                return
            nxt = u.index + 1
            if nxt < len(self.layers):
                self._gather(self.layers[nxt], async_op=True)  # prefetch the next block
            self._read_param(self._layer(nxt + 1))  # and the disk read of the one after
        return hook

    def _make_post(self, u: Unit):
        def hook(_m, _args, out):
            if _in_backward():  # recomputed forward inside backward: keep it for the backward that follows
                return out
            if self.reshard_after_forward or not torch.is_grad_enabled():
                self._free(u)  # (else it stays gathered until its gradients are reduce-scattered)
            if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
                if u.index >= len(self.layers) - 2:  # backward starts with the last two: read them now
                    self._read_param(u)
                return _RegatherBeforeBackward.apply(self, u, out)
            return out
        return hook

    def _backward_gather(self, u: Unit) -> None:
        self._gather(u, async_op=False)
        if u.index > 0:
            self._gather(self.layers[u.index - 1], async_op=True)
        self._read_param(self._layer(u.index - 2))

    def _pre_model(self, _m, _args):
        self.begin_forward()

    def begin_forward(self) -> None:
        """Before the step's first forward (the model's forward pre-hook, or a pipeline schedule that runs
        its chunks itself): complete a deferred NVMe step's persistent units, wait for the updated
        parameters' all-gathers (stages 1/2), flush partial stage-2 accumulation, read and gather the root
        unit and prefetch the first block (stage 3)."""
        if self.swap is not None and self._persist_pending:
            # a deferred NVMe step: the persistent units lead the swap file; gather them once stepped
            self._advance_for_forward(self._head_end)
            self._persist_pending = False
            self._publish()
        for h in self._param_gathers:  # stages 1/2: updated parameters all-gathered after the last step
            h.wait()
        self._param_gathers.clear()
        if self.stage >= 2 and torch.is_grad_enabled():
            self._flush_partial()
        for u in (self.root, self._layer(0), self._layer(1)):  # disk reads first, all in flight together
            self._read_param(u)
        if self.root is not None:
            self._gather(self.root, async_op=False)
        if self.layers:
            self._gather(self.layers[0], async_op=True)

    def _post_model(self, _m, _args, out):
        self.end_forward()
        return out

    def end_forward(self) -> None:
        """After a forward without autograd (validation, sampling): stage 3 frees the root unit (a training
        forward keeps it gathered for backward)."""
        if self.root is not None and not torch.is_grad_enabled():
            self._free(self.root)

    # gradients -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Stage 1: accumulate full gradients locally.  Stages 2/3 reduce-scatter every micro-batch into
        the gradient shard (ZeRO 5.2), so the full gradient never has to be kept; after
        :meth:`accumulate_locally` they accumulate locally too."""
        prev, self._sync = self._sync, False
        self._done.clear()  # one backward per no_sync: a unit's completion is counted afresh
        try:
            yield
        finally:
            self._sync = prev

    def accumulate_locally(self, deferred=()) -> None:
        """Switch stages 2/3 to local accumulation for a pipeline schedule: under ``no_sync`` gradients add
        up in each parameter's ``.grad`` (as stage 1's buffers), and the backward that runs outside
        ``no_sync`` (the chunk's last micro-batch) reduce-scatters the sums, overlapped with the rest of
        that backward.  A stage-3 block is released after each backward unless ``reshard_after_forward``
        is false.  Parameters in ``deferred`` (the tied embedding's two pipeline copies) keep their summed
        ``.grad`` until :meth:`finish_grad_sync`, so the caller can add the other copy's first."""
        self.accumulate = True
        self._deferred = {id(p) for p in deferred}

    def _on_grad(self, p: torch.Tensor) -> None:
        u = self._unit_of[id(p)]
        if not self._sync or id(p) in self._deferred:
            if self.stage == 1:
                return
            if self.accumulate:
                self._backward_done(u, p)
                return
        self._stage_grad(u, p)

    def _stage_grad(self, u: Unit, p: torch.Tensor) -> None:
        """Note that ``p``'s gradient is complete for this reduction (stages 2/3: moved into the unit's
        staging buffer) and launch the unit's reduce-scatter once all its parameters are."""
        if self.stage >= 2:
            if u.staging is None:
                u.staging = self._take_staging(u.padded)
                u.staging[u.numel:].zero_()
            i = u.pos[id(p)]
            # one pass: scale by 1/N_d (the mean over ranks) while copying into the bucket
            torch.mul(p.grad.reshape(-1), 1.0 / self.dp, out=u.staging[u.offsets[i]:u.offsets[i] + u.numels[i]])
            p.grad = None
        u.ready.add(id(p))
        if len(u.ready) == len(u.params):
            self._launch_reduce(u)

    def _backward_done(self, u: Unit, p: torch.Tensor) -> None:
        """Local accumulation: ``p.grad`` keeps the sum.  A stage-3 block whose backward is complete is
        released until its next use (reshard after forward)."""
        if id(u) not in self._layer_ids or not self.reshard_after_forward:
            return
        done = self._done.setdefault(id(u), set())
        done.add(id(p))
        if len(done) == len(u.params):
            done.clear()
            self._free(u)

    def _take_staging(self, n: int) -> torch.Tensor:
        """A staging bucket of ``n`` elements: the smallest free pooled buffer that fits, else a new one."""
        fits = [i for i, b in enumerate(self._staging_pool) if b.numel() >= n]
        if fits:
            i = min(fits, key=lambda j: self._staging_pool[j].numel())
            return self._staging_pool.pop(i)[:n]
        t = torch.empty(n, dtype=self.rdtype, device=self.device)
        if self._huge:
            hostmem.advise_huge_pages(t)
        return t

    def _launch_reduce(self, u: Unit) -> None:
        """Reduce-scatter unit ``u``'s gradients (pre-divided by N_d, so the result is the mean)."""
        if self.stage == 1:
            wire = u.grad_full.to(self.rdtype) if self.rdtype != u.grad_full.dtype else u.grad_full
            wire.div_(self.dp)
        else:
            wire, u.staging = u.staging, None
            if len(u.ready) < len(u.params):  # parameters without a gradient this micro-batch contribute 0
                for i, q in enumerate(u.params):
                    if id(q) not in u.ready:
                        wire[u.offsets[i]:u.offsets[i] + u.numels[i]].zero_()
        u.ready.clear()
        if self._tp_ranges[id(u)]:
            self._sum_over_tp(wire, self._tp_ranges[id(u)])
        first = id(u) not in self._written  # the first gradient since zero_grad: overwrite, no memset
        self._written.add(id(u))
        if (first and self.stage >= 2 and not self.nvme and u.grad.dtype == self.rdtype
                and u.grad.device == self.device):
            out = u.grad  # reduce straight into the shard: no receive buffer, no copy
        else:
            out = torch.empty(u.shard, dtype=self.rdtype, device=self.device)
        h = comm.reduce_scatter(out, wire, self.mesh, self.axes, async_op=True)
        self._inflight.append((u, out, wire, h, first))
        if self.stage == 3 and not u.persistent:
            self._free(u)
        while self.stage >= 2 and len(self._inflight) > self.max_inflight_reduce:
            self._retire()

    def _sum_over_tp(self, buf: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
        """Sum the sequence-parallel parameters' ranges of ``buf`` over tp, in place (Korthikanti et al.
        2022, 4.2.2: each tp rank saw only its part of the sequence); every tp rank then reduce-scatters
        the same complete gradient over dp."""
        if len(ranges) == 1:
            o, n = ranges[0]
            comm.all_reduce(buf[o:o + n], self.mesh, "tp")
            return
        packed = torch.cat([buf[o:o + n] for o, n in ranges])
        comm.all_reduce(packed, self.mesh, "tp")
        k = 0
        for o, n in ranges:
            buf[o:o + n].copy_(packed[k:k + n])
            k += n

    def _retire(self) -> None:
        u, out, wire, h, first = self._inflight.popleft()
        h.wait()
        if self.stage >= 2:
            base = wire if wire._base is None else wire._base
            self._staging_pool.append(base)  # reused by the next bucket of this backward
        if self.nvme:
            fresh = self.stage == 1 or id(u) not in self._fresh
            if not torch.isfinite(out).all():
                self._nonfinite = True  # fp16 overflow: the engine's check sees it in found_inf()
            if fresh:  # squared norm per parameter piece (the model-parallel norm needs them by kind)
                for i, a, b in u.shard_ranges():
                    self._piece_sq[(id(u), i)] = float(torch.linalg.vector_norm(out[a:b].float()).square())
            else:
                self._norm_exact = False
            self._fresh.add(id(u))
            self.swap.add_grad(u, out.to("cpu"), fresh)
        elif out is u.grad:
            pass
        elif self.stage == 1 or first:
            u.grad.copy_(out, non_blocking=self.pin)
        else:
            # a later micro-batch (stages 2/3): one rounding per micro-batch into a 16-bit shard; blocking, so
            # the CPU add never reads the host copy before a device-to-host transfer lands
            u.grad.add_(out.to(u.grad.device))

    def _flush_partial(self) -> None:
        """Reduce units whose parameters did not all receive gradients (unused in this micro-batch)."""
        for u in self.units:
            if self.stage >= 2 and u.staging is not None and u.ready:
                self._launch_reduce(u)

    def finish_grad_sync(self) -> None:
        if self.stage == 1 and self._sync:
            for u in self.units:  # buckets with unused parameters, in the same order on every rank
                if id(u) not in self._written:
                    self._launch_reduce(u)
        else:
            if self.accumulate:  # sums never reduced on a synced backward, deferred ones included
                for u in self.units:
                    for q in list(u.params):
                        if q.grad is not None:
                            self._stage_grad(u, q)
            self._flush_partial()
        while self._inflight:
            self._retire()
        if self.pin:  # gradient shards were copied to pinned host memory asynchronously: the CPU reads them next
            torch.cuda.current_stream(self.device).synchronize()
        self._staging_pool.clear()  # nothing of the reduction stays between steps
        if self._huge:  # the heap's free pages too (allocations below the threshold: activations, ...)
            hostmem.trim_heap()
        if not self.nvme:
            for u in self.units:  # a unit that got no gradient at all this step
                if id(u) not in self._written:
                    u.grad.zero_()
                    self._written.add(id(u))
            if self.narrow:
                # squared norm of the 16-bit shard, summed in fp32; inf/NaN (fp16 overflow) is what the
                # engine's overflow check reads from found_inf()
                self._sumsq = float(sum(torch.linalg.vector_norm(g, dtype=torch.float32).square()
                                        for g in self._grad_tensors()))
                self._nonfinite = not math.isfinite(self._sumsq)
        if self.root is not None and self.root.gathered:
            self._free(self.root)
        for u in self.layers:
            if u.gathered:
                self._free(u)

    def zero_grad(self) -> None:
        if self.nvme:
            self._fresh.clear()
            self._norm_exact = True
            self._piece_sq.clear()
        self._written.clear()  # the next reduce-scatter overwrites each unit's gradient shard
        self._coef, self._nonfinite = 1.0, False
        for u in self.units:
            if u.grad_full is not None:
                u.grad_full.zero_()

    def _grad_tensors(self) -> list[torch.Tensor]:
        return [u.grad for u in self.units] if self.grad_in_full else [self.grad_flat]

    def grads(self) -> list[torch.Tensor]:
        """The fp32 gradient tensors this rank steps (per-unit views for stage 1); empty with a 16-bit shard
        or NVMe offload, where the engine scales and checks gradients through :meth:`scale_grads` and
        :meth:`found_inf` instead (the factor is applied inside the step)."""
        return [] if (self.nvme or self.narrow) else self._grad_tensors()

    def scale_grads(self, coef) -> None:
        """Multiply this rank's gradients by ``coef`` (fp16 unscaling, clipping).  A 16-bit shard or one on
        NVMe keeps the factor, and the step applies it in fp32 as each chunk streams through (no rounding
        of the unscaled gradient to 16 bits, no extra pass over disk)."""
        if self.nvme or self.narrow:
            self._coef *= float(coef)
            return
        for g in self._grad_tensors():  # (on the host with optimizer offload, while ``coef`` is on the device)
            g.mul_(coef.to(g.device) if torch.is_tensor(coef) else coef)

    def pending_grad_scale(self) -> float:
        """The factor :meth:`scale_grads` deferred to the step (1.0 when gradients are scaled in place)."""
        return self._coef if (self.nvme or self.narrow) else 1.0

    def found_inf(self) -> torch.Tensor:
        """1.0 when this rank's gradients hold inf/NaN (16-bit or NVMe shards: seen as they arrived)."""
        if self.nvme or self.narrow:
            return torch.tensor([float(self._nonfinite)], device=self.device)
        return sum((~torch.isfinite(g)).any().float() for g in self._grad_tensors()).reshape(1).to(self.device)

    def grad_pieces(self, params):
        """Each rank's slice of the flat gradient, cut at parameter boundaries (the caller applies
        :meth:`pending_grad_scale`); with NVMe offload each slice stands as a 1-element tensor holding its
        L2 norm (same sum of squares), from :meth:`grad_piece_norms`.  ``params`` is every parameter this
        strategy holds."""
        if self.nvme:
            return [(p, torch.tensor([math.sqrt(sq)])) for p, sq in self.grad_piece_norms()], True
        return [(u.params[i], u.grad[a:b]) for u in self.units for i, a, b in u.shard_ranges()], True

    def grad_piece_norms(self) -> list[tuple[nn.Parameter, float]]:
        """NVMe offload: (parameter, squared L2 norm of the part of its gradient this rank holds), from the
        shards as they arrived or, after accumulation over micro-batches, read back from the swap file."""
        keys = [(u, i, a, b) for u in self.units for i, a, b in u.shard_ranges()]
        if self._norm_exact:
            sq = [self._piece_sq.get((id(u), i), 0.0) for u, i, _a, _b in keys]
        else:
            sq = self.swap.grad_sumsq([(u.goff + a, u.goff + b) for u, _i, a, b in keys])
        return [(u.params[i], s) for (u, i, _a, _b), s in zip(keys, sq)]

    def grad_norm(self) -> torch.Tensor:
        """True global L2 norm: squared norms of the disjoint shards summed over dp (padding is zero)."""
        if self.nvme:
            local = sum(self._piece_sq.values()) if self._norm_exact else self.swap.grad_sumsq([(0, self.swap.S)])[0]
            sq = torch.tensor([local], dtype=torch.float32, device=self.device)
            comm.all_reduce(sq, self.mesh, self.axes)
            return sq.sqrt()[0] * abs(self._coef)
        if self.narrow:
            sq = torch.tensor([self._sumsq], dtype=torch.float32, device=self.device)
            comm.all_reduce(sq, self.mesh, self.axes)
            return sq.sqrt()[0] * abs(self._coef)
        sq = sum(torch.linalg.vector_norm(g).square() for g in self._grad_tensors()).reshape(1).to(self.device)
        comm.all_reduce(sq, self.mesh, self.axes)
        return sq.sqrt()[0]

    # optimizer ------------------------------------------------------------------------------------
    def step(self, lr: float) -> None:
        if self.nvme:
            self.complete_step()
            self._drop_param_reads()
            # stage 3: the step streams while the next forward runs (each gather waits for its unit)
            defer = self.stage == 3 and self.overlap_step
            self.swap.step(lr, self._coef, self._publish_range, defer=defer)
            if defer:
                self._persist_pending = True
            else:
                self._publish()
            return
        if self.alt_optimizer is not None:
            self.alt_optimizer.step(lr)
        else:
            coef = torch.tensor([self._coef], dtype=torch.float32, device=self.opt_device) if self.narrow else None
            self.optimizer.step(lr, grad_coef=coef)
        self._publish()

    def _publish_range(self, u: Unit, lo: int, hi: int, master: torch.Tensor) -> None:
        # units whose parameters are offloaded too get them written by the swap's chunk write
        if u.cshard is not None:
            u.cshard[lo:hi].copy_(master, non_blocking=self.pin)
            return
        if not self.param_nvme or u.persistent:
            return
        buf = self._captured.get(id(u))
        if buf is None and self._capturing and lo == 0:  # the unit's first piece: keep the whole shard
            buf = self._captured[id(u)] = torch.zeros(u.shard, dtype=self.cdtype)  # (padding stays 0)
        if buf is not None:
            buf[lo:hi].copy_(master)

    @torch.no_grad()
    def _publish(self) -> None:
        """Make the updated master slices visible to compute: 16-bit shard copies for stage-3 units,
        an (overlapped) all-gather of the whole buffer for persistent units."""
        for u in self.units:
            if u.cshard is not None and not self.nvme:
                u.cshard.copy_(u.master, non_blocking=self.pin)
            if u.persistent:
                src = (u.cshard if self.nvme else u.master).to(device=self.device, dtype=self.cdtype, copy=True)
                if self.dp == 1:
                    u.full[u.lo:u.hi].copy_(src)
                else:
                    self._param_gathers.append(comm.all_gather(u.full, src, self.mesh, self.axes, async_op=True))

    def complete_step(self) -> None:
        """Finish a deferred NVMe step and publish its persistent units (collective: every rank calls it
        at the same point)."""
        if self.swap is None:
            return
        self.swap.finish()
        self._captured.clear()
        if self._persist_pending:
            self._persist_pending = False
            self._publish()
            self._wait_params()

    def _wait_params(self) -> None:
        for h in self._param_gathers:
            h.wait()
        self._param_gathers.clear()

    # checkpoints ----------------------------------------------------------------------------------
    def _getter(self, kind: str):
        """Per-unit accessor of the fp32 ``master``/``exp_avg``/``exp_avg_sq`` slices.  With NVMe offload
        the array is read from the swap file into memory for the checkpoint (one array at a time)."""
        if not self.nvme:
            return lambda u: getattr(u, kind)
        from podscale.parallel.zero import nvme as _nv
        array = {"master": _nv.MASTER, "exp_avg": _nv.EXP_AVG, "exp_avg_sq": _nv.EXP_AVG_SQ}[kind]
        if kind not in self._ck:
            self._ck[kind] = self.swap.read_array(array)
        flat = self._ck[kind]
        return lambda u: flat[u.goff:u.goff + u.shard]

    def _writeback(self, kind: str) -> None:
        if self.nvme and kind in self._ck:
            from podscale.parallel.zero import nvme as _nv
            array = {"master": _nv.MASTER, "exp_avg": _nv.EXP_AVG, "exp_avg_sq": _nv.EXP_AVG_SQ}[kind]
            flat = self._ck.pop(kind)
            self.swap.write_array(array, flat)
            if kind == "master":
                for u in self.units:
                    m = flat[u.goff:u.goff + u.shard]
                    if u.cshard is not None:
                        u.cshard.copy_(m)
                    else:
                        self.swap.write_param(u, 0, m.to(self.cdtype))

    def model_state(self) -> dict[str, torch.Tensor]:
        """fp32 master weights per parameter name (all tied names), sharded as this rank holds them."""
        self.complete_step()
        self._wait_params()
        self._ck = {}
        out = zstate.sharded_entries(self, self._getter("master"))
        for n, b in self.module.named_buffers():
            out[n] = b
        return out

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self.complete_step()
        zstate.copy_in(self, state, self._getter("master"))
        for n, b in self.module.named_buffers():
            if n in state and state[n] is not b:
                b.copy_(state[n])
        self._writeback("master")
        self._publish()
        self._wait_params()

    def optim_state(self) -> dict[str, torch.Tensor]:
        self.complete_step()
        out = {}
        self._ck = {}
        for key in ("exp_avg", "exp_avg_sq"):
            for n, t in zstate.sharded_entries(self, self._getter(key), tied=False).items():
                out[f"{n}.{key}"] = t
        step = self._step_value()
        for u in self.units:
            for n in u.names:
                out[f"{n}.step"] = step.clone()
        return out

    def optim_template(self) -> dict[str, torch.Tensor]:
        return self.optim_state()

    def load_optim_state(self, flat: dict[str, torch.Tensor]) -> None:
        self.complete_step()
        for key in ("exp_avg", "exp_avg_sq"):
            zstate.copy_in(self, {k[: -len(key) - 1]: v for k, v in flat.items() if k.endswith("." + key)},
                           self._getter(key), tied=False)
            self._writeback(key)
        steps = [v for k, v in flat.items() if k.endswith(".step")]
        if steps and self.nvme:
            self.swap.t = int(float(steps[0]))
        elif steps and getattr(self.alt_optimizer, "t", None) is not None:
            self.alt_optimizer.t = int(float(steps[0]))
        elif steps:
            for group in self.optimizer.groups:
                for s in group:
                    s.step.fill_(float(steps[0]))

    def _step_value(self) -> torch.Tensor:
        if self.nvme:
            return torch.tensor(float(self.swap.t))
        if getattr(self.alt_optimizer, "t", None) is not None:
            return torch.tensor(float(self.alt_optimizer.t))
        for group in self.optimizer.groups:
            for s in group:
                return s.step.detach().to("cpu", torch.float32).clone()
        return torch.zeros((), dtype=torch.float32)

    # accounting -----------------------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        """Bytes of model states this rank keeps between steps, by kind (for the memory estimator)."""
        def nb(t):
            return 0 if t is None else t.numel() * t.element_size()
        params = sum(nb(u.full) for u in self.units if u.persistent) + sum(nb(u.cshard) for u in self.units)
        grads = nb(self.grad_flat) + sum(nb(u.grad_full) for u in self.units)
        optim = nb(self.exp_avg) + nb(self.exp_avg_sq) + nb(self.master_flat)
        if self.nvme:
            params = sum(nb(u.full) for u in self.units if u.persistent) + sum(nb(u.cshard) for u in self.units)
            return {"params": params, "grads": grads, "optim": optim,
                    "swap_buffers": sum(nb(b) for b in self.swap.bufs), "on_disk": self.swap.file.size}
        return {"params": params, "grads": grads, "optim": optim}

    def drain(self) -> None:
        """Wait for every collective this strategy still has in flight: a deferred NVMe step and its
        publication, the post-step all-gathers of updated parameters, stage 3's prefetched gathers and disk
        reads.  Collective (every rank calls it at the same point)."""
        self.complete_step()
        self._wait_params()
        for u in self.units:
            if u.gather_handle is not None:
                u.gather_handle.wait()
                u.gather_handle = None
        if self.swap is not None:
            self._drop_param_reads()

    def close(self) -> None:
        """Drain the collectives in flight, remove hooks and, with NVMe offload, the swap file; safe to call
        twice."""
        self.drain()
        self.remove_hooks()
        if self.swap is not None:
            self.swap.close()
            self.swap = None

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
