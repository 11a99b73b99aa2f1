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
  With one data rank (and no parameter offload) a shard is the whole block, so stage 3 keeps the
  parameters whole in stage 2's buckets: same memory, no gathers.

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
Where the state lives is the business of a :class:`~podscale.parallel.zero.flat_state.FlatState` (in
memory or on NVMe); this class does what is the same for both: gathering, reduce-scatter and hooks.
The configuration arrives validated (:class:`podscale.config.ZeroSection` holds ZeRO's rules).
"""
from __future__ import annotations

import collections
import contextlib
import functools

import torch
import torch.nn as nn

from podscale.parallel.model_protocols import recomputing
from podscale.parallel.param_tags import tags
from podscale.parallel.sharded_state import CheckpointPublisher, copy_buffers, persistent_buffers
from podscale.parallel.strategy import DataParallelStrategy, LocalMicroBatches
from podscale.parallel.zero.flat_state import DTYPES, FlatState, make_flat_state
from podscale.parallel.zero.layout import ShardGroup, Unit, bucket_units, layer_units
from podscale.parallel.zero.memory import reduce_buffers
from podscale.parallel.zero.state import ZeroSource
from podscale.runtime import comm, hostmem


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
    (lr, betas, eps, weight decay, precision, reduce dtype) and ``zero`` a validated
    :class:`~podscale.config.ZeroSection` with ``stage`` 1-3.  A model built on the ``meta`` device is
    materialised one unit at a time by ``param_init(name, tensor)`` (ZeRO-3's ``zero.Init``: the whole model
    never exists on one rank); its parameters are then replaced by views of the unit buffers.  The optimizer
    state is :attr:`state` (a :class:`~podscale.parallel.zero.flat_state.FlatState`).
    """

    max_inflight_reduce = 2  # stage 2/3 staging buffers alive at once (bounds gradient memory)
    sums_sequence_parallel = True  # wrappers leave the tp sum of sequence-parallel gradients to ZeRO
    reduce_commutes = False        # a reduce-scatter needs the full tp/pp sums first

    def __init__(self, module: nn.Module, mesh, train, zero, param_init=None, ep_sharded=()):
        if zero.stage not in (1, 2, 3):
            raise ValueError(f"ZeroStrategy runs stages 1-3 (got zero.stage={zero.stage}); stage 0 is "
                             "podscale.parallel.data.DataParallel")
        self.module, self.mesh, self.stage, self.zcfg = module, mesh, zero.stage, zero
        # the data ranks (dp, and ep when > 1): dense parameters are replicated, hence sharded, over them;
        # ep-sharded parameters (experts: each ep rank its own) over dp only.  Every gradient is a sum over
        # its group divided by the number of data ranks (the loss is the mean over all of them).
        self.axes = mesh.data_axes
        self.dp, self.dp_rank = mesh.size(*self.axes), mesh.local_rank(*self.axes)
        self.grad_divisor = self.dp
        sharded = {id(p) for p in ep_sharded} if mesh.size("ep") > 1 else set()
        expert_group = ShardGroup.of(mesh, ("dp",)) if sharded else None
        self.device = mesh.device
        self.cdtype = DTYPES[train.precision]
        self.rdtype = DTYPES[train.reduce_dtype] if train.reduce_dtype else self.cdtype
        self._sync = True
        self._closed = False
        self._inflight: collections.deque = collections.deque()
        self._staging_pool: list[torch.Tensor] = []  # stages 2/3: free staging buffers, during backward
        self._huge = False  # stage 3 on a CPU: block buffers are mmapped; ask for huge pages on them
        self._param_gathers: list = []
        self._written: set[int] = set()
        self.reshard_after_forward = zero.reshard_after_forward
        self.overlap_step = zero.nvme_overlap_step  # (stage 3: the state may step under the next forward)
        self._persist_pending = False  # a deferred step has yet to all-gather the persistent units
        self.accumulate = False          # stages 2/3: accumulate in .grad under no_sync (accumulate_locally)
        self._deferred: set[int] = set()  # parameters reduced only in finish_grad_sync (accumulate_locally)
        self._done: dict[int, set[int]] = {}  # stage 3, local accumulation: params whose backward ran, per unit

        named = list(module.named_parameters())  # tied parameters once, under their first name
        named = [(n, p) for n, p in named if p.requires_grad]
        self.aliases: dict[int, list[str]] = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            self.aliases.setdefault(id(p), []).append(n)
        cap = int(zero.reduce_bucket_mb * 2**20)
        # One data rank (dp = 1) without parameter offload or NVMe: a stage-3 shard is the whole unit, so
        # releasing and re-gathering blocks would only copy them; the parameters stay whole, in stage 2's
        # buckets (same memory, no gathers, no block hooks; bench/overhead.py, ZeRO-3 on one rank).
        self.sharded_params = self.stage == 3 and not (
            self.dp == 1 and zero.offload_param == "none" and zero.offload_optimizer != "nvme")
        if self.sharded_params:
            self.layers, persistent, self.root = layer_units(module, named, zero.param_persistence_threshold,
                                                             self.dp, self.dp_rank, cap, self.axes, sharded,
                                                             expert_group)
            self.units = self.layers + ([self.root] if self.root else []) + persistent
            # the state's flat arrays in the order the forward uses the units: a deferred step (NVMe) runs
            # front to back while the next forward catches up with it
            order = persistent + ([self.root] if self.root else []) + self.layers
        else:
            self.layers, self.root = [], None
            self.units = bucket_units(named, cap, self.dp, self.dp_rank, self.axes, sharded, expert_group)
            order = self.units
        self._persistent = [u for u in self.units if u.persistent]
        # staging buffers alive at once (one rule with the memory estimator)
        largest = max((u.padded for u in (self.layers or self.units)), default=0) * self.rdtype.itemsize
        self._max_inflight = reduce_buffers(largest, self.max_inflight_reduce) - 1
        # sequence-parallel parameters: (offset, numel) ranges per unit, summed over tp before the reduce
        sp = mesh.size("tp") > 1
        self._tp_ranges = {id(u): _merge([(o, n) for p, o, n in zip(u.params, u.offsets, u.numels)
                                          if sp and tags(p).sequence_parallel]) for u in self.units}
        self._layer_ids = {id(u) for u in self.layers}
        if self.sharded_params and self.device.type == "cpu" and self.layers:
            mb = zero.host_mmap_threshold_mb
            # default glibc's cap (32 MiB): blocks below it reuse heap memory (no page faults per gather),
            # larger ones are mmapped and leave on release; a fixed threshold stops the dynamic growth that
            # let the heap keep every released block.  Measured on bench/zero.py stage 3 (28 MB blocks, idle
            # machine): 32 MiB 0.76-0.80 s/step at 1375-1436 MiB peak RSS; half a block (14 MB, every
            # gather faulted in) 1.0-1.1 s at 1055-1079 MiB; glibc's dynamic default 0.66-0.75 s at
            # 1674-1791 MiB (FSDP2: 0.98-1.05 s at 1618-1780 MiB).
            nbytes = hostmem.DEFAULT_MMAP_THRESHOLD if mb is None else int(mb * 2**20)
            if nbytes > 0:
                self._huge = hostmem.set_mmap_threshold(nbytes)
        self.param_init = param_init
        self._owners: dict[int, list] = {}
        for mod in module.modules():
            for attr, p in mod._parameters.items():
                if p is not None:
                    self._owners.setdefault(id(p), []).append((mod, attr))
        self.state: FlatState = make_flat_state(self.units, order, mesh, train, zero, self.stage)
        self._allocate()
        self.state.initialized()
        self._source = ZeroSource(self, self.state)
        if self._huge:  # the model's original weights, freed into the heap by the move into unit buffers
            hostmem.trim_heap()
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for u in self.units for p in u.params]
        self._hooks.append(module.register_forward_pre_hook(self._pre_model))
        self._hooks.append(module.register_forward_hook(self._post_model))
        for u in self.layers:
            self._hooks.append(u.module.register_forward_pre_hook(self._make_pre(u)))
            self._hooks.append(u.module.register_forward_hook(self._make_post(u)))

    # allocation ------------------------------------------------------------------------------------
    def _allocate(self) -> None:
        """Build each unit's flat buffers from the module's current weights (rank 0's, broadcast) and hand
        this rank's slice to the state as its initial master."""
        with torch.no_grad():
            for u in self.units:
                full = torch.zeros(u.padded, dtype=torch.float32, device=self.device)
                for p, o, n, name in zip(u.params, u.offsets, u.numels, u.names):
                    if p.is_meta:
                        if self.param_init is None:
                            raise ValueError(f"parameter '{name}' is on the meta device: pass param_init to "
                                             "ZeroStrategy to materialise it")
                        self.param_init(name, full[o:o + n].view(p.shape))
                    else:
                        full[o:o + n].copy_(p.detach().reshape(-1))
                comm.broadcast(full, 0, self.mesh, u.axes)  # every replica starts from rank 0's weights
                u.full = full if self.cdtype == torch.float32 else full.to(self.cdtype)
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
                self.state.init_unit(u, full[u.lo:u.hi])
                del full
                if not u.persistent:
                    self._free(u)

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
        src = self.state.param_source(u)  # (NVMe: a deferred step catches up to u; its read is waited for)
        u.full.untyped_storage().resize_(u.padded * u.full.element_size())
        if self._huge:
            hostmem.advise_huge_pages(u.full)
        # kept until the gather is done; a shard in host memory (offload) is copied to the device first
        u.src_tmp = src.to(self.device, non_blocking=True) if src.device != self.device else src
        with torch.no_grad():
            h = comm.all_gather(u.full, u.src_tmp, self.mesh, u.axes, async_op=True)
        u.gathered = True
        u.gather_handle = h
        if not async_op:
            h.wait()
            u.gather_handle = None

    def _prefetch(self, u: Unit | None) -> None:
        """Let the state bring a stage-3 unit's shard closer ahead of its gather (a disk read under NVMe
        parameter offload, ZeRO-Infinity section 6.3)."""
        if u is not None and not u.persistent and not u.gathered:
            self.state.prefetch_param(u)

    def _layer(self, i: int) -> Unit | None:
        return self.layers[i] if 0 <= i < len(self.layers) else None

    def _make_pre(self, u: Unit):
        def hook(_m, _args):
            self._gather(u, async_op=False)
            if recomputing():  # activation recomputation: the block was gathered for its backward
                return
            nxt = u.index + 1
            if nxt < len(self.layers):
                self._gather(self.layers[nxt], async_op=True)  # prefetch the next block
            self._prefetch(self._layer(nxt + 1))  # and the disk read of the one after
        return hook

    def _make_post(self, u: Unit):
        def hook(_m, _args, out):
            if recomputing():  # recomputed forward inside backward: keep it for the backward that follows
                return out
            if self.reshard_after_forward or not torch.is_grad_enabled():
                self._free(u)  # (else it stays gathered until its gradients are reduce-scattered)
            # a block may return a tuple (an MoE block: its output and its routing record): the tensors in it
            # that backward will reach are wrapped (gathering is idempotent)
            tensors = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, tuple) else []
            if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
                if u.index >= len(self.layers) - 2:  # backward starts with the last two: read them now
                    self._prefetch(u)
                wrapped = [_RegatherBeforeBackward.apply(self, u, t)
                           if isinstance(t, torch.Tensor) and t.requires_grad else t for t in tensors]
                return wrapped[0] if isinstance(out, torch.Tensor) else type(out)(wrapped)
            return out
        return hook

    def _backward_gather(self, u: Unit) -> None:
        self._gather(u, async_op=False)
        if u.index > 0:
            self._gather(self.layers[u.index - 1], async_op=True)
        self._prefetch(self._layer(u.index - 2))

    def _pre_model(self, _m, _args):
        self.begin_forward()

    def begin_forward(self) -> None:
        """Before the step's first forward (the model's forward pre-hook, or a pipeline schedule that runs
        its chunks itself): all-gather the persistent units of a deferred step (they lead the state's
        arrays, so the state catches up with them first), wait for the updated parameters' all-gathers
        (stages 1/2), flush partial stage-2 accumulation, read and gather the root unit and prefetch the
        first block (stage 3)."""
        if self._persist_pending:
            self._persist_pending = False
            self._publish_persistent()
        self.wait_params()
        if self.stage >= 2 and torch.is_grad_enabled():
            self._flush_partial()
        for u in (self.root, self._layer(0), self._layer(1)):  # disk reads first, all in flight together
            self._prefetch(u)
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
            torch.mul(p.grad.reshape(-1), 1.0 / self.grad_divisor,
                      out=u.staging[u.offsets[i]:u.offsets[i] + u.numels[i]])
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
            wire.div_(self.grad_divisor)
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
        shard = self.state.grad_shard(u) if first and self.stage >= 2 else None
        if shard is not None and shard.dtype == self.rdtype and shard.device == self.device:
            out = shard  # reduce straight into the shard: no receive buffer, no copy
        else:
            out = torch.empty(u.shard, dtype=self.rdtype, device=self.device)
        # the wire is scratch once reduced (gloo then reduces in it, no staging copies): stages 2/3's staging
        # bucket; stage 1's full gradient buffer, of which only this rank's slice is read afterwards (it is
        # overwritten from ``out`` when the reduction is retired) and which zero_grad clears for the next step
        h = comm.reduce_scatter(out, wire, self.mesh, u.axes, async_op=True, scratch_input=True)
        self._inflight.append((u, out, wire, h, first))
        if self.stage == 3 and not u.persistent:
            self._free(u)
        while self.stage >= 2 and len(self._inflight) > self._max_inflight:
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
        # stage 1 reduces once per step: always the whole gradient
        self.state.receive_grad(u, out, fresh=self.stage == 1 or first)

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
        self._staging_pool.clear()  # nothing of the reduction stays between steps
        if self._huge:  # the heap's free pages too (allocations below the threshold: activations, ...)
            hostmem.trim_heap()
        unwritten = [u for u in self.units if id(u) not in self._written]  # no gradient at all this step
        self._written.update(id(u) for u in unwritten)
        self.state.end_reduction(unwritten)
        if self.root is not None and self.root.gathered:
            self._free(self.root)
        for u in self.layers:
            if u.gathered:
                self._free(u)

    def zero_grad(self) -> None:
        self.state.zero_grad()
        self._written.clear()  # the next reduce-scatter overwrites each unit's gradient shard
        for u in self.units:
            if u.grad_full is not None:
                u.grad_full.zero_()

    def grads(self) -> list[torch.Tensor]:
        """The fp32 gradient tensors this rank steps (per-unit views for stage 1); empty with a 16-bit shard
        or NVMe offload, where the engine scales and checks gradients through :meth:`scale_grads` and
        :meth:`found_inf` instead (the factor is applied inside the step)."""
        return self.state.grads()

    def scale_grads(self, coef) -> None:
        """Multiply this rank's gradients by ``coef`` (fp16 unscaling, clipping).  A 16-bit shard or one on
        NVMe keeps the factor, and the step applies it in fp32 as each chunk streams through (no rounding
        of the unscaled gradient to 16 bits, no extra pass over disk)."""
        self.state.scale_grads(coef)

    def pending_grad_scale(self) -> float:
        """The factor :meth:`scale_grads` deferred to the step (1.0 when gradients are scaled in place)."""
        return self.state.pending_grad_scale()

    def found_inf(self) -> torch.Tensor:
        """1.0 when this rank's gradients hold inf/NaN (16-bit or NVMe shards: seen as they arrived)."""
        return self.state.found_inf()

    def grad_pieces(self, params):
        """Each rank's slice of the flat gradient, cut at parameter boundaries (the caller applies
        :meth:`pending_grad_scale`); with NVMe offload each slice stands as a 1-element tensor holding its
        L2 norm (same sum of squares).  ``params`` is every parameter this strategy holds."""
        return self.state.grad_pieces(), True

    def grad_norm(self) -> torch.Tensor:
        """True global L2 norm: squared norms of the disjoint shards summed over dp (padding is zero)."""
        sq = self.state.grad_sumsq()
        comm.all_reduce(sq, self.mesh, self.axes)
        return sq.sqrt()[0] * abs(self.state.pending_grad_scale())

    # optimizer ------------------------------------------------------------------------------------
    def step(self, lr: float) -> None:
        self.complete_step()
        # stage 3: the state may stream the step while the next forward runs (each gather waits for its unit)
        if self.state.step(lr, defer=self.stage == 3 and self.overlap_step):
            self._persist_pending = True
        else:
            self._publish_persistent()

    @torch.no_grad()
    def _publish_persistent(self) -> None:
        """All-gather the updated shards of the persistent units into their compute buffers (overlapped
        until the next forward starts)."""
        for u in self._persistent:
            if u.dp == 1:  # (skipped where the buffer is its own master: an fp32 unit of one rank)
                src = self.state.param_source(u)
                if src.data_ptr() != u.full.data_ptr() or src.dtype != u.full.dtype:
                    u.full[u.lo:u.hi].copy_(src)
                continue
            src = self.state.param_source(u).to(device=self.device, dtype=self.cdtype, copy=True)
            self._param_gathers.append(comm.all_gather(u.full, src, self.mesh, u.axes, async_op=True))

    def complete_step(self) -> None:
        """Finish a deferred step and publish its persistent units (collective: every rank calls it at the
        same point)."""
        self.state.finish_step()
        if self._persist_pending:
            self._persist_pending = False
            self._publish_persistent()
            self.wait_params()

    def wait_params(self) -> None:
        """Wait for the all-gathers of updated persistent parameters (in flight until the next forward)."""
        for h in self._param_gathers:
            h.wait()
        self._param_gathers.clear()

    # checkpoints ----------------------------------------------------------------------------------
    def checkpoint_units(self) -> list[Unit]:
        """The units whose shards :attr:`state` holds, settled for a checkpoint: a deferred step is completed
        and the persistent parameters' all-gathers are waited for."""
        self.complete_step()
        self.wait_params()
        return self.units

    def loaded_masters(self) -> None:
        """After new masters were written through :meth:`FlatState.write_unit`: re-gather the persistent
        units' compute buffers (stage-3 units are gathered from the state at their next use)."""
        self._publish_persistent()
        self.wait_params()

    def checkpoint_source(self) -> ZeroSource:
        return self._source

    @functools.cached_property
    def checkpoint_publisher(self) -> CheckpointPublisher:
        """ZeRO alone: the model state under every tied name, the optimizer state under each parameter's
        first name (what a wrapper's publisher does with tp/pp layouts, here with none)."""
        return CheckpointPublisher(self.mesh, self._source,
                                   lambda: self.module.named_parameters(remove_duplicate=False),
                                   lambda duplicates: self.module.named_parameters())

    def model_state(self) -> dict[str, torch.Tensor]:
        """fp32 master weights per parameter name (all tied names), sharded as this rank holds them."""
        return self.checkpoint_publisher.model_state() | dict(persistent_buffers(self.module))

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self.checkpoint_publisher.load_model_state(state)
        copy_buffers(persistent_buffers(self.module), state)

    def optim_state(self) -> dict[str, torch.Tensor]:
        return self.checkpoint_publisher.optim_state()

    def optim_template(self) -> dict[str, torch.Tensor]:
        return self.checkpoint_publisher.optim_template()

    def load_optim_state(self, flat: dict[str, torch.Tensor]) -> None:
        self.checkpoint_publisher.load_optim_state(flat)

    # accounting -----------------------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        """Bytes of model states this rank keeps between steps, by kind (for the memory estimator)."""
        def nb(t):
            return 0 if t is None else t.numel() * t.element_size()
        held = self.state.bytes_held()
        held["params"] += sum(nb(u.full) for u in self._persistent)
        held["grads"] += sum(nb(u.grad_full) for u in self.units)
        return held

    def drain(self) -> None:
        """Wait for every collective this strategy still has in flight: a deferred NVMe step and its
        publication, the post-step all-gathers of updated parameters, stage 3's prefetched gathers and disk
        reads.  Collective (every rank calls it at the same point)."""
        self.complete_step()
        self.wait_params()
        for u in self.units:
            if u.gather_handle is not None:
                u.gather_handle.wait()
                u.gather_handle = None
        self.state.drop_prefetched()

    def close(self) -> None:
        """Drain the collectives in flight, remove hooks and release the state (with NVMe offload, its swap
        file); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.drain()
        self.remove_hooks()
        self.state.close()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
