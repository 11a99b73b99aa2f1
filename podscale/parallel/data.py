"""Data parallelism with bucketed gradient all-reduce overlapped with backward compute.

Gradients live in flat bucket buffers (each parameter's ``.grad`` is a view into its bucket), so a bucket
is reduced with one collective and no copies.  With a single replica there is nothing to reduce: the
composition (:mod:`podscale.parallel.compose`) then picks :class:`SingleReplica`,
whose gradients are autograd's own tensors, exactly as in a plain training loop.  Buckets are filled in
reverse registration order, which is
roughly the order backward produces gradients (Li et al. 2020, "PyTorch Distributed", section 3.2.3); a
post-accumulate-grad hook counts each bucket down and launches its asynchronous all-reduce as soon as it is
full, so communication of late layers overlaps backward through early layers.  Buckets are always launched
in index order so every rank issues the same collectives in the same order.  Gradients are pre-divided by
the group size so the all-reduce yields the mean.

Parameters sharded over ``ep`` (a mixture-of-experts model's experts: each ep rank holds other experts,
GShard section 3) form buckets of their own.  The loss is the mean over every data rank (dp x ep) of its
local loss, so a dense parameter, replicated on every rank, is averaged over dp x ep; an expert's parameters
live on the dp ranks of one ep coordinate only, and their local gradient already sums the contributions of
the tokens every ep rank sent them (the all-to-all's backward brings them home), so their buckets are summed
over dp and divided by dp·ep.  They are broadcast at start over dp only, and the gradient norm adds their
squares over ep.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from podscale.parallel.buckets import reverse_order_buckets
from podscale.parallel.strategy import DataParallelStrategy, LocalMicroBatches
from podscale.runtime import comm
from podscale.train.precision import nonfinite_flag

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, None: None}


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    axes: tuple[str, ...]           # the ranks that hold these parameters (the all-reduce's group)
    divisor: int                    # the gradient is the sum over ``axes`` divided by this
    ready: int = 0
    handle: comm.Handle | None = None
    wire: torch.Tensor | None = None
    pending: set = field(default_factory=set)


class ReplicatedStrategy(LocalMicroBatches, DataParallelStrategy):
    """What every replicated data-parallel strategy shares: each replica holds the whole model and steps it
    with its own torch optimizer, so the optimizer side, the checkpoint state and the model-parallel
    wrapper's view of the gradients are the same whether the gradients are all-reduced
    (:class:`DataParallel`) or there is one replica (:class:`SingleReplica`)."""

    reduce_commutes = True          # a mean over dp: tp and pp sums may follow it
    sums_sequence_parallel = False  # the model-parallel wrapper sums them after the all-reduce

    module: nn.Module
    mesh: object
    optimizer: torch.optim.Optimizer | None

    def scale_grads(self, coef) -> None:
        grads = self.grads()
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device) if torch.is_tensor(coef) else coef)

    def found_inf(self) -> torch.Tensor:
        return nonfinite_flag(self.grads())

    def grad_pieces(self, params):
        """Every replica holds the whole averaged gradient of each parameter (ep-sharded ones — experts,
        marked ``expert_parallel`` — are this ep rank's own: the wrapper's norm sums their squares over ep)."""
        return [(p, p.grad) for p in params if p.grad is not None], False

    def pending_grad_scale(self) -> float:
        return 1.0

    def accumulate_locally(self, deferred=()) -> None:
        """Nothing to switch: under ``no_sync`` gradients already add up (in the buckets), and a tied
        parameter's all-reduce (a mean) commutes with the caller's sum of its pipeline copies."""

    def begin_forward(self) -> None:
        """Nothing per step: the replicas hold their parameters."""

    def end_forward(self) -> None:
        """Nothing per step."""

    def checkpoint_source(self):
        """Every dp rank holds every parameter and its torch AdamW state whole."""
        from podscale.parallel.sharded_state import ReplicatedSource
        return ReplicatedSource(self.module, self.optimizer, self.mesh.size("dp"))

    # optimizer side of the strategy ---------------------------------------------------------------
    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def model_state(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)

    def optim_state(self) -> dict[str, torch.Tensor]:
        """Optimizer state as ``"<parameter name>.<key>"`` tensors (only tensors: DCP pickles the rest)."""
        return {f"{name}.{k}": v for name, p in self._named_optim_params()
                for k, v in self.optimizer.state.get(p, {}).items()}

    def optim_template(self) -> dict[str, torch.Tensor]:
        """Tensors shaped like the Adam state, to load a checkpoint into a fresh optimizer."""
        out = {}
        for name, p in self._named_optim_params():
            out[f"{name}.step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            out[f"{name}.exp_avg"] = torch.zeros_like(p)
            out[f"{name}.exp_avg_sq"] = torch.zeros_like(p)
        return out

    def load_optim_state(self, flat: dict[str, torch.Tensor]) -> None:
        for name, p in self._named_optim_params():
            self.optimizer.state[p] = {k: flat[f"{name}.{k}"] for k in ("step", "exp_avg", "exp_avg_sq")}

    def _named_optim_params(self):
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [(names[id(p)], p) for g in self.optimizer.param_groups for p in g["params"]]


class SingleReplica(ReplicatedStrategy):
    """Data parallelism over one replica: nothing to reduce, so no buckets, no hooks and no memset per step;
    the gradients are autograd's own tensors, stolen by AccumulateGrad and dropped by :meth:`zero_grad`, as
    in a plain training loop (buckets would cost an in-place add per gradient and a memset per step:
    bench/overhead.py).  With an ``optimizer`` it is a complete training strategy."""

    def __init__(self, module: nn.Module, mesh, optimizer: torch.optim.Optimizer | None = None):
        self.module, self.mesh, self.optimizer = module, mesh, optimizer
        self.params = [p for p in module.parameters() if p.requires_grad]

    def no_sync(self):
        """Gradients accumulate locally anyway."""
        return contextlib.nullcontext()

    def finish_grad_sync(self) -> None:
        """Nothing to reduce."""

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def grad_norm(self) -> torch.Tensor:
        """The L2 norm of the gradients (zero before any backward)."""
        grads = self.grads()
        return torch.nn.utils.get_total_norm(grads, foreach=True) if grads else \
            torch.zeros((), device=self.mesh.device)

    def close(self) -> None:
        """Nothing in flight."""


class DataParallel(ReplicatedStrategy):
    """Replicates ``module`` over the mesh axes ``axes`` and averages gradients across them.

    Use ``no_sync()`` around all but the last micro-batch of a gradient-accumulation step, and call
    ``finish_grad_sync()`` after the last backward, before reading gradients.  With an ``optimizer`` it is a
    complete training strategy (:class:`~podscale.parallel.strategy.Strategy`): every replica steps the
    whole model.  Over one replica it is correct but pays for buckets it does not need: the composition
    picks :class:`SingleReplica` there.
    """

    def __init__(self, module: nn.Module, mesh, axes: tuple[str, ...] = ("dp",), bucket_mb: float = 25.0,
                 reduce_dtype: str | None = None, optimizer: torch.optim.Optimizer | None = None,
                 ep_sharded: list[nn.Parameter] = ()):
        """``axes``: the data ranks (``("dp", "ep")`` with expert parallelism); ``ep_sharded``: parameters
        each ``ep`` rank holds its own of (experts), replicated over ``axes`` without ``ep``."""
        self.module, self.mesh, self.axes = module, mesh, axes
        self.size = mesh.size(*axes)
        self.reduce_dtype = _DTYPES[reduce_dtype]
        self.params = [p for p in module.parameters() if p.requires_grad]
        # (ep = 1: every rank holds every expert, which are then ordinary replicated parameters)
        sharded = {id(p) for p in ep_sharded} if mesh.size("ep") > 1 else set()
        if sharded and "ep" not in axes:
            raise ValueError(f"ep-sharded parameters need the data axes to include 'ep' (got {axes})")
        self.expert_axes = tuple(a for a in axes if a != "ep")
        self._sharded = sharded
        self.optimizer = optimizer
        self._sync = True
        self._broadcast_parameters()
        cap = int(bucket_mb * 2**20)
        self.buckets = self._make_buckets([p for p in self.params if id(p) not in sharded], cap, axes) + \
            self._make_buckets([p for p in self.params if id(p) in sharded], cap, self.expert_axes)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._next_launch = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def _broadcast_parameters(self) -> None:
        """Start every replica from rank 0's weights and buffers, as DDP does (a group of one has nothing to
        send, and its tensors need not be on the mesh's device yet)."""
        if self.size == 1:
            return
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                axes = self.expert_axes if id(t) in self._sharded else self.axes
                comm.broadcast(t.data, 0, self.mesh, axes)

    def _make_buckets(self, params: list[nn.Parameter], cap_bytes: int, axes: tuple[str, ...]) -> list[_Bucket]:
        out = []
        for params in reverse_order_buckets(params, cap_bytes, lambda p: p.numel() * p.element_size()):
            dtype, dev = params[0].dtype, params[0].device
            buf = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=dev)
            offset = 0
            for p in params:
                p.grad = buf[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
            out.append(_Bucket(params=params, buffer=buf, axes=axes, divisor=self.size))
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communication (micro-steps of gradient accumulation)."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        b = self.buckets[self._bucket_of[id(p)]]
        if id(p) in b.pending:
            return
        b.pending.add(id(p))
        b.ready += 1
        if b.ready == len(b.params):
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if not force and b.ready < len(b.params):
                return
            self._launch(b)
            self._next_launch += 1

    def _launch(self, b: _Bucket) -> None:
        if self.reduce_dtype is not None and self.reduce_dtype != b.buffer.dtype:
            b.wire = b.buffer.to(self.reduce_dtype).div_(b.divisor)
        else:
            b.wire = b.buffer.div_(b.divisor)
        b.handle = comm.all_reduce(b.wire, self.mesh, b.axes, async_op=True)

    def finish_grad_sync(self) -> None:
        """Launch buckets that unused parameters kept back, wait for all, and reset for the next step."""
        self._launch_ready(force=True)
        for b in self.buckets:
            b.handle.wait()
            if b.wire is not b.buffer:
                b.buffer.copy_(b.wire)
            b.handle, b.wire, b.ready = None, None, 0
            b.pending.clear()
        self._next_launch = 0

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the (already averaged, hence identical on every replica) gradients; the squares
        of ep-sharded buckets (other experts on each ep rank) are summed over ep."""
        if not self._sharded:
            return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(b.buffer) for b in self.buckets]))

        def sq(buckets):
            return torch.stack([torch.linalg.vector_norm(b.buffer).square() for b in buckets]).sum() if buckets \
                else torch.zeros((), device=self.mesh.device)
        dense = sq([b for b in self.buckets if b.axes == self.axes])
        experts = sq([b for b in self.buckets if b.axes != self.axes]).reshape(1)
        comm.all_reduce(experts, self.mesh, "ep")
        return (dense + experts[0]).sqrt()

    def grads(self) -> list[torch.Tensor]:
        return [b.buffer for b in self.buckets]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def close(self) -> None:
        """Wait for all-reduces still in flight (a step left unfinished); safe to call twice."""
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
                b.handle = None
