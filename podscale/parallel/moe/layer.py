"""The mixture-of-experts feed-forward layer and expert parallelism over the mesh's ``ep`` axis.

``MoELayer(x)`` replaces a transformer's MLP: a :class:`~podscale.parallel.moe.gate.Router` picks k experts
per token (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021), the chosen experts' feed-forward
networks run on their tokens, and the outputs are combined with the gate values.  Two implementations of
the same function:

* :meth:`MoELayer.forward_reference` — GShard's einsum form (section 2.2 / Algorithm 1): a dispatch mask
  and combine weights of shape (G, S, E, C), ``expert_in = einsum("gsec,gsm->egcm")``, ``out =
  einsum("gsec,egcm->gsm")``.  Readable, O(S·E·C) memory, used by the tests.
* :meth:`MoELayer.forward` — the training path: the kept (token, expert) choices are sorted by expert,
  (one stable sort, which also hands out the capacity slots), their tokens gathered into one (M, d) buffer
  in expert order, each expert runs one matmul pair on its contiguous rows (a grouped feed-forward with a
  hand-written backward, run by the device's :class:`~podscale.parallel.moe.kernels.ExpertKernel`), and
  the rows, scaled by their gate values, are added back onto their tokens (``index_add``).  Nothing of
  size S·E·C (or S·E) exists; the work is proportional to the choices actually dispatched.

Expert parallelism (GShard section 3): with ``mesh.sizes["ep"] = n`` rank ``i`` of the ep group holds the
experts ``[i * E/n, (i+1) * E/n)``.  Each forward exchanges first the per-expert token counts
(``all_to_all_single`` of n·E/n integers), then the tokens (``all_to_all_single`` with those split sizes), runs
its experts, and sends the outputs back the same way; the backward runs the two token exchanges in reverse.
Under tensor parallelism the expert-parallel group can span the tp ranks too (``fold_tp``, MoE parallel
folding: see :meth:`MoELayer.forward`); "the ep group" below is then the ep x tp group.  Or each expert's
hidden width can be split over the tp ranks (``expert_tensor_parallel``, Megatron-core's expert tensor
parallelism: :class:`WidthSplit`), which adds, after the rows exchange, an all-gather of the counts and
one all-to-all of the rows over tp per forward, one more all-to-all over tp before the outputs go back, and
the same two over tp in the backward; a shared expert's width is then split too, and its tokens gathered
and outputs reduce-scattered over tp the same way (:meth:`WidthSplit.run_dense`).
A rank's own rows (those for its own experts) stay out of the exchanges and run while they are in flight
(:class:`_ExpertParallelFFN`), unless the experts' segments are short (:data:`MIN_SEGMENT_ROWS`).
Every rank issues exactly these three collectives per layer and forward and two per backward (one when the
layer's input wants no gradient: the input gradients are not sent back), in the same order, whatever the
routing: an empty split (no token for an expert, a rank or every remote rank) is still a collective that
every rank enters.  That is the default dispatch, a row per kept choice (:class:`ChoiceDispatch`); behind the
same :class:`ExpertDispatch` seam a token can instead go once to each rank holding any of its choices, its
choices combined there (:class:`RankDispatch`, DeepEP's dispatch and combine: as many collectives), or once to
each node and then per rank inside it (:class:`NodeDispatch`, DeepEP's internode dispatch): ``expert_dispatch``.

Gradients (see :func:`reduce_gradients`): the loss is the mean over all dp·ep ranks of their local losses.
A dense parameter is replicated on every rank, so its gradient is averaged over dp×ep.  An expert's
parameters live on the dp ranks with the same ep coordinate, and their local gradient already sums the
contributions of every token sent to them from the whole ep group (the all-to-all's backward brings them
home), so they are summed over dp and divided by dp·ep.  Data-parallel strategies tell the two apart with
:func:`expert_parameters` / :func:`dense_parameters` (an ``isinstance`` test on :class:`Experts`; every
expert parameter is named by its global expert id, ``...experts.<id>.w_fc``, and carries an
the ``expert_parallel`` tag (:mod:`podscale.parallel.param_tags`), which survives ``GPT.materialize``).

What a data-parallel strategy must do with an MoE model (the contract :func:`reduce_gradients` and
:func:`grad_norm` implement synchronously):

1. dense parameters: replicated over dp×ep — broadcast at start and average gradients over ``("dp", "ep")``
   (ZeRO: shard them over dp×ep);
2. expert parameters: replicated over dp only — broadcast at start over ``("dp",)`` (never over ep: each ep
   rank holds other experts), sum gradients over ``("dp",)`` and divide by dp·ep (a mean over dp, then
   ``/ ep``) (ZeRO: shard them over dp);
3. gradient norm for clipping: dense squares once, expert squares summed over ep (and tp, folded or
   width-split: each tp rank holds other experts or other parts of them);
4. checkpoints: the names are already global (one file per expert id), so no translation between ep sizes.

:class:`~podscale.parallel.data.DataParallel` and :class:`~podscale.parallel.zero.ZeroStrategy` follow it
for the parameters a task names in :meth:`~podscale.tasks.Task.ep_sharded_parameters` (the GPT-MoE task:
:func:`expert_parameters`); plain data parallelism over ``("dp", "ep")`` without that split would be wrong
on two counts: it would broadcast rank 0's experts over ep and average different experts' gradients together.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from podscale.parallel.moe.gate import Gating, MoEStats, Router, Routing, StepCounts, check_aux_loss_scope, \
    check_drop_policy, \
    expert_capacity, first_choice_counts, load_balancing_loss, route, routing_uniform, router_z_loss
from podscale.parallel.model_protocols import StepState, recomputing
from podscale.config import expert_dispatch_problem, expert_width_split_problem
from podscale.parallel.param_tags import tag, tags
from podscale.parallel.sharded_state import global_shape
from podscale.parallel.tensor import GatherBatchFromTP, ReduceFromTP, SplitBatchToTP, global_grad_norm, shard
from podscale.parallel.moe.kernels import ExpertKernel, WeightGrads, cast_weights, kernel_for, segment_bounds
from podscale.runtime import comm
from podscale.runtime.process import local_slot


def check_moe_args(experts: int, top_k: int, capacity_factor: float, eval_capacity_factor: float,
                   ep: int, folded_tp: int = 1, width_tp: int = 1, hidden: int = 1) -> None:
    """One-line ValueErrors naming the key and the fix (the config layer will call this before workers
    start).  ``folded_tp``: the tp size folded into the expert-parallel group (1: not folded); ``width_tp``:
    the tp size each expert's ``hidden`` width is split over (expert tensor parallelism; 1: not split)."""
    if experts < 1:
        raise ValueError(f"model.experts={experts} must be >= 1: set model.experts to a positive number")
    if ep < 1 or experts % ep:
        raise ValueError(f"model.experts={experts} is not divisible by parallel.ep={ep}: "
                         f"make model.experts a multiple of parallel.ep")
    if experts % (ep * folded_tp):
        raise ValueError(f"model.experts={experts} is not divisible by parallel.ep*parallel.tp={ep * folded_tp} "
                         "(parallel.fold_tp_into_ep shards the experts over both): make model.experts a multiple "
                         f"of {ep * folded_tp} or set parallel.fold_tp_into_ep = false")
    if folded_tp > 1 and width_tp > 1:
        raise ValueError("parallel.expert_tensor_parallel and parallel.fold_tp_into_ep both use the tp ranks for "
                         "the experts (splitting each expert, or sharding whole experts over ep x tp): set one "
                         "of them to false")
    problem = expert_width_split_problem(hidden, width_tp)
    if problem:
        raise ValueError(problem)
    if not 1 <= top_k <= experts:
        raise ValueError(f"model.top_k={top_k} must be between 1 and model.experts={experts}: "
                         f"lower model.top_k or add experts")
    for key, cf in (("capacity_factor", capacity_factor), ("eval_capacity_factor", eval_capacity_factor)):
        if not 0 < cf < math.inf:   # inf: no capacity has a number of slots (ceil(inf) raises OverflowError)
            raise ValueError(f"model.{key}={cf} must be a finite number > 0: use e.g. 1.25 (or model.dropless = "
                             f"true for no capacity)")


# ---------------------------------------------------------------------------------------------------
# the experts


#: how expert tensor parallelism splits a routed expert over tp, as the tp layout of each single-process tensor
#: (:func:`~podscale.parallel.tensor.shard`): the first linear column-parallel (``w_fc``'s columns and ``b_fc``),
#: the second row-parallel (``w_proj``'s rows), Shoeybi et al. 2019, section 3; ``b_proj`` stays whole on
#: every tp rank (added once per row, after the partial outputs are summed)
WIDTH_LAYOUTS = {"w_fc": "cols", "b_fc": "rows", "w_proj": "rows"}


class Expert(nn.Module):
    """One GELU feed-forward expert ``x -> gelu(x w_fc + b_fc) w_proj + b_proj`` (``w_fc`` (d, h),
    ``w_proj`` (h, d)).  A routed expert (``routed``) has every parameter tagged ``expert_parallel``; a
    shared one (:attr:`MoELayer.shared`) has dense parameters (replicated over dp x ep).  ``width``: expert tensor
    parallelism (:class:`WidthSplit`): this rank holds its tp rank's ``h/tp`` of the hidden width, each
    split tensor tagged with its tp layout (:data:`WIDTH_LAYOUTS`), so checkpoints store the single-process
    tensor and :meth:`own_part` cuts this rank's part out of its initial value."""

    def __init__(self, d_model: int, d_hidden: int, bias: bool = True, routed: bool = True,
                 width: "WidthSplit | None" = None):
        super().__init__()
        self.width = width
        h = d_hidden // width.tp if width is not None else d_hidden
        self.w_fc = nn.Parameter(torch.empty(d_model, h))
        self.w_proj = nn.Parameter(torch.empty(h, d_model))
        self.b_fc = nn.Parameter(torch.zeros(h)) if bias else None
        self.b_proj = nn.Parameter(torch.zeros(d_model)) if bias else None
        nn.init.normal_(self.w_fc, std=0.02)
        nn.init.normal_(self.w_proj, std=0.02)
        for name, p in self.named_parameters():
            if routed:
                tag(p, expert_parallel=True)
            if width is not None and name in WIDTH_LAYOUTS:
                tag(p, tp_layout=WIDTH_LAYOUTS[name])

    def single_process_shape(self, leaf: str) -> tuple[int, ...]:
        """The shape of parameter ``leaf`` (``"w_fc"``, ...) in the one-process model."""
        p = self.get_parameter(leaf)
        return global_shape(tags(p).tp_layout, tuple(p.shape), self.width.tp if self.width is not None else 1)

    def own_part(self, leaf: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full``, the one-process value of parameter ``leaf`` (``full`` itself unless
        the expert's width is split over tp)."""
        layout = tags(self.get_parameter(leaf)).tp_layout
        return full if layout is None else shard(full, layout, self.width.mesh)

    def weights(self) -> list[nn.Parameter]:
        """``w_fc, w_proj`` and, with biases, ``b_fc, b_proj``: an :class:`ExpertKernel`'s order for one
        expert."""
        return [self.w_fc, self.w_proj] + ([self.b_fc, self.b_proj] if self.b_fc is not None else [])

    def run(self, x: torch.Tensor, kernel: ExpertKernel) -> torch.Tensor:
        """The expert on every row of ``x`` on ``kernel`` (the shared expert's path; routed experts run
        grouped, :class:`Experts`); with the width split, every tp rank's rows through this rank's part
        (:meth:`WidthSplit.run_dense`)."""
        if self.width is not None:
            return self.width.run_dense(self, x, kernel)
        return _GroupedFFN.apply(x, [(0, x.shape[0])], kernel, 1, self.b_fc is not None, *self.weights())

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The expert in plain autograd operations (the tests' reference for the kernels)."""
        return _reference_ffn(x, self.w_fc, self.w_proj, self.b_fc, self.b_proj)


def _reference_ffn(x: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor, b_fc: torch.Tensor | None,
                   b_proj: torch.Tensor | None) -> torch.Tensor:
    """``gelu(x w_fc + b_fc) w_proj + b_proj`` in plain autograd operations, in ``x``'s dtype (one expert's
    weights, or several stacked with rows (E, R, d) and biases (E, 1, .): the einsum reference's batch)."""
    h = x @ w_fc.to(x.dtype)
    if b_fc is not None:
        h = h + b_fc.to(x.dtype)
    y = F.gelu(h, approximate="tanh") @ w_proj.to(x.dtype)
    return y + b_proj.to(x.dtype) if b_proj is not None else y


class Experts(nn.ModuleDict):
    """This rank's experts ``[first, first + num_local)`` of ``num_experts``, keyed by *global* expert id
    (parameter names ``experts.<id>.w_fc``, ...), so a model's parameter names are the same at every ep
    size and checkpoints are keyed by global expert id with no translation.

    ``kernel``: how the experts run on their rows (:mod:`podscale.parallel.moe.kernels`); None picks the
    kernel for the input's device and dtype at each call (:func:`~podscale.parallel.moe.kernels.kernel_for`), the
    variant that recomputes the GELU in the backward when ``recompute_activation``.  ``width``: each expert's
    hidden width split over tp (expert tensor parallelism, :class:`WidthSplit`); :attr:`d_hidden` is then
    this rank's part of it, the width its kernels see."""

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, ep_size: int = 1, ep_rank: int = 0,
                 bias: bool = True, kernel: ExpertKernel | None = None, recompute_activation: bool = False,
                 width: "WidthSplit | None" = None):
        local = num_experts // ep_size
        super().__init__({str(ep_rank * local + j): Expert(d_model, d_hidden, bias, width=width)
                          for j in range(local)})
        self.num_experts, self.num_local, self.first = num_experts, local, ep_rank * local
        self.d_model, self.d_hidden = d_model, d_hidden // width.tp if width is not None else d_hidden
        self.bias, self.kernel, self.recompute_activation = bias, kernel, recompute_activation
        self.width = width

    def kernel_for_rows(self, x: torch.Tensor) -> ExpertKernel:
        """The kernel these experts run rows like ``x`` on (:attr:`kernel`, or the one for its device and dtype)."""
        return pick_kernel(self.kernel, x, self.d_model, self.d_hidden, self.recompute_activation)

    def kernel_weights(self) -> list[nn.Parameter]:
        """Every local expert's parameters in an :class:`ExpertKernel`'s order: all ``w_fc``, all ``w_proj``,
        then (with biases) all ``b_fc``, all ``b_proj``."""
        ex = list(self.values())
        out = [e.w_fc for e in ex] + [e.w_proj for e in ex]
        if self.bias:
            out += [e.b_fc for e in ex] + [e.b_proj for e in ex]
        return out

    def run_received(self, x: torch.Tensor, sources: list[list[int]]) -> torch.Tensor:
        """Rows of ``x`` laid out by source, then local expert (``sources[s][j]`` rows from source ``s`` for
        local expert ``j``: what an exchange delivers) through their experts, outputs row for row.  With
        more than one source the rows are regrouped expert-major (one gather, and back) so that each expert
        runs one matmul pair on one contiguous segment, as Megatron-core's dispatcher sorts its received
        chunks by expert; with the width split over tp, every tp rank's rows run on this rank's part of each
        expert (:meth:`WidthSplit.run`)."""
        if self.width is not None:
            return self.width.run(self, x, sources)
        perm, inverse, segments = _expert_major(sources, x.device)
        if perm is not None:
            x = _PermuteRows.apply(x, perm, inverse)
        y = self(x, segments)
        return y if perm is None else _PermuteRows.apply(y, inverse, perm)

    def forward(self, x: torch.Tensor, segments: list[tuple[int, int]]) -> torch.Tensor:
        """Rows of ``x`` in consecutive segments, ``segments[i] = (local expert, rows)`` (a local expert may
        own several segments; zero rows allowed: an expert without rows gets a zero gradient, never a
        missing one).  Returns the experts' outputs, row for row."""
        return _GroupedFFN.apply(x, segments, self.kernel_for_rows(x), self.num_local, self.bias,
                                 *self.kernel_weights())

    def forward_exchanged(self, flat: torch.Tensor, exchange: "_Exchange") -> torch.Tensor:
        """Expert parallelism: the rows of ``flat`` that ``exchange`` names (sorted by global expert) through
        their experts, wherever those live on the ep group: with this rank's own rows run while the
        exchanges are in flight (:class:`_ExpertParallelFFN`), or, when the experts' segments are short
        (:data:`MIN_SEGMENT_ROWS`) or their width is split over tp, every row exchanged and run by
        :meth:`run_received`."""
        if exchange.overlap:
            return _ExpertParallelFFN.apply(flat, exchange, self.kernel_for_rows(flat), self.num_local, self.bias,
                                            *self.kernel_weights())
        x = _AllToAll.apply(flat.index_select(0, exchange.token_remote), exchange.mesh, exchange.axes,
                            exchange.recv_splits, exchange.send_splits)
        y = self.run_received(x, exchange.sources)
        return _AllToAll.apply(y, exchange.mesh, exchange.axes, exchange.send_splits, exchange.recv_splits)

    def forward_padded(self, x: torch.Tensor) -> torch.Tensor:
        """(El, R, d) -> (El, R, d): every expert on its own R rows (the reference's batched form)."""
        ex = list(self.values())
        b_fc = torch.stack([e.b_fc for e in ex])[:, None] if self.bias else None
        b_proj = torch.stack([e.b_proj for e in ex])[:, None] if self.bias else None
        return _reference_ffn(x, torch.stack([e.w_fc for e in ex]), torch.stack([e.w_proj for e in ex]), b_fc, b_proj)


def pick_kernel(given: ExpertKernel | None, x: torch.Tensor, d_model: int, d_hidden: int,
                recompute_activation: bool) -> ExpertKernel:
    """``given``, or the kernel for ``x``'s device and dtype and these widths."""
    return given if given is not None else kernel_for(x.device, x.dtype, d_model, d_hidden, recompute_activation)


def expert_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts compute in for tokens ``x``: autocast's 16-bit type when autocast is on for
    ``x``'s device and would cast ``x`` (floating, not fp64), else ``x``'s own.

    ``nn.Linear`` experts under ``torch.autocast`` run their matmuls in 16 bits; the expert kernels write
    into preallocated buffers (``mm(..., out=)``), which autocast never casts, so the layer casts the tokens
    once before the experts (the exchanged rows, the kept activations and the weights' copies then take
    16 bits too, as in Megatron-core and DeepSpeed under bf16) while the router keeps fp32 (Switch's
    selective precision).  The parameters and their gradients stay fp32."""
    dev = x.device.type
    if x.is_floating_point() and x.dtype != torch.float64 and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _once(ctx) -> None:
    """Refuse a second backward through one forward: the first overwrote the kernel's saved tensors with
    gradients in place (:meth:`~podscale.parallel.moe.kernels.ExpertKernel.backward`)."""
    if ctx.consumed:
        raise RuntimeError("the experts' backward ran twice on one forward (retain_graph=True): it "
                           "overwrites its saved activations with gradients in place; "
                           "run the forward again instead")
    ctx.consumed = True


class _GroupedFFN(torch.autograd.Function):
    """Every expert's ``gelu(x w_fc + b_fc) w_proj + b_proj`` on its rows of one buffer (the segments of
    :meth:`Experts.forward`), forward and backward written out by an
    :class:`~podscale.parallel.moe.kernels.ExpertKernel`, no per-expert autograd nodes.  It saves the input
    and the kernel's two tensors; because the backward overwrites those in place, a second backward through
    the same forward (``retain_graph=True``) is refused."""

    @staticmethod
    def forward(ctx, x, segments, kernel, El, bias, *params):
        weights = cast_weights(params, x.dtype)
        bounds = segment_bounds(segments)
        out = x.new_empty(x.shape[0], weights[El].shape[1])
        saved = kernel.forward(x, bounds, weights, El, bias, out)
        ctx.bounds, ctx.kernel, ctx.El, ctx.bias, ctx.consumed = bounds, kernel, El, bias, False
        ctx.n_saved = len(saved)
        ctx.save_for_backward(x, *saved, *params)
        return out

    @staticmethod
    def backward(ctx, grad):
        _once(ctx)
        x, *rest = ctx.saved_tensors
        saved, params = tuple(rest[:ctx.n_saved]), rest[ctx.n_saved:]
        weights = cast_weights(params[:2 * ctx.El], x.dtype)
        acc = WeightGrads(ctx.El, ctx.bias)
        g_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        ctx.kernel.backward(grad.contiguous(), x, saved, ctx.bounds, weights, ctx.El, acc, g_x)
        return (g_x, None, None, None, None, *acc.result(params, x))


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of every :class:`Experts` module in ``model`` (sharded over ep, reduced over dp)."""
    return [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()]


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every other parameter of ``model`` (replicated over dp×ep, reduced over dp×ep)."""
    experts = {id(p) for p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in experts]


def reduce_gradients(model: nn.Module, mesh) -> None:
    """Make every rank's gradients those of the global mean loss (a synchronous reference implementation;
    a data-parallel strategy does the same with buckets): dense gradients averaged over dp×ep, expert
    gradients summed over dp and divided by dp·ep.  Parameters without a gradient count as zero."""
    n = mesh.size("dp", "ep")
    for params, axes in ((dense_parameters(model), ("dp", "ep")), (expert_parameters(model), ("dp",))):
        params = [p for p in params if p.requires_grad]
        if not params:
            continue
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        comm.all_reduce(flat, mesh, axes)
        flat.div_(n)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()


def grad_norm(model: nn.Module, mesh) -> torch.Tensor:
    """The global L2 norm of the whole model's (reduced) gradient, the same on every rank: dense gradients
    are replicated, so they count once; each ep rank holds other experts (tagged ``expert_parallel``), so
    their squares are summed over ep. The trunk's rule, :func:`~podscale.parallel.tensor.global_grad_norm`."""
    return global_grad_norm([(p, p.grad) for p in model.parameters()], mesh)


# ---------------------------------------------------------------------------------------------------
# the exchange


#: below this many rows per (source rank, local expert) segment on average, a rank's own rows go through the
#: exchange with the others' and all of them are regrouped expert-major before its experts run, so that each
#: expert runs one matmul pair on one segment: with short segments (many experts) a weight-gradient matmul
#: costs about its output's size whatever its rows, so cutting an expert's rows into parts costs nearly a
#: matmul a part.  At or above it the own rows stay out of the exchange and run while it is in flight
#: (:class:`_ExpertParallelFFN`).  Between the 64-row segments, where the split lost on every point measured,
#: and the 128-row ones, where it broke even or won; the planner applies the same rule (BENCHMARKS.md: the
#: ablation)
MIN_SEGMENT_ROWS = 96


def overlaps_exchange(rows_received: float, segments: float) -> bool:
    """Whether a rank receiving ``rows_received`` rows in ``segments`` (source rank, local expert) segments
    keeps its own rows out of the exchange and runs them while it is in flight (:data:`MIN_SEGMENT_ROWS`):
    the layer's rule, which the planner prices too."""
    return rows_received >= MIN_SEGMENT_ROWS * segments


class _Exchange:
    """One MoE layer's expert-parallel exchange, fixed by the row counts: ``send[r][j]`` rows of this rank go
    to rank ``r``'s local expert ``j``, ``recv[r][j]`` rows come from rank ``r`` for my local expert ``j``.

    The rows sorted by global expert are sorted by destination rank.  When the segments are long (see
    :data:`MIN_SEGMENT_ROWS`) rows ``[first, first + local)``, this rank's own, never enter the all-to-all
    (its own split is 0 both ways) and run in two parts, A (``[0, half)``) and B, so that each of the four
    exchanges of a layer has expert work to hide behind (see :class:`_ExpertParallelFFN`); otherwise
    ``local`` is 0 and the own rows travel with the rest (:meth:`Experts.forward_exchanged`).  Received rows arrive grouped by source rank, then
    local expert; with more than one source they are regrouped expert-major (one gather, and back), so
    that each expert runs one matmul per part on one contiguous segment, as Megatron-core's dispatcher
    sorts its received chunks by expert.  A rank's choice is its own: the splits two ranks exchange are
    the same either way."""

    def __init__(self, mesh, axes: tuple[str, ...], send: list[list[int]], recv: torch.Tensor, pending,
                 token: torch.Tensor, may_overlap: bool = True):
        """``axes``: the expert-parallel group's mesh axes (see :attr:`MoELayer.expert_axes`); ``recv``:
        filled by the count exchange ``pending``; ``may_overlap``: False when the experts cannot run a
        rank's own rows apart (their width split over tp: every tp rank's rows run together)."""
        self.mesh, self.axes = mesh, axes
        me, ep, El = mesh.local_rank(*axes), len(send), len(send[0])
        pending.wait()
        recv = recv.tolist()
        out_rows, in_rows = [sum(s) for s in send], [sum(r) for r in recv]
        #: the rows my experts run: every rank's for them, my own included
        self.rows_in = sum(in_rows)
        self.overlap = overlap = may_overlap and overlaps_exchange(self.rows_in, ep * El)
        self.total = sum(out_rows)
        self.first, self.local = (sum(out_rows[:me]), out_rows[me]) if overlap else (0, 0)
        self.own_block = _OwnBlock(self.first, self.local, self.total)
        #: rows per rank of what I send (and get back), and of what I receive (and send back)
        self.send_splits = [0 if r == me and overlap else n for r, n in enumerate(out_rows)]
        self.recv_splits = [0 if r == me and overlap else n for r, n in enumerate(in_rows)]
        self.token_local, self.token_remote = self.own_block.own(token), self.own_block.others(token)
        self.half = self.local // 2
        self.part_a, self.part_b = (_split_bounds(segment_bounds(enumerate(send[me])), self.half) if overlap
                                    else ([], []))
        #: the received rows' counts by source rank, then local expert (:meth:`Experts.run_received`)
        self.sources = [src for r, src in enumerate(recv) if r != me or not overlap]
        #: the regrouping of the received rows expert-major and their segments (the overlapped path's)
        self.perm, self.inverse, segments = _expert_major(self.sources, token.device) if overlap \
            else (None, None, [])
        self.remote = segment_bounds(segments)


@dataclass(frozen=True)
class _OwnBlock:
    """Rows ``[first, first + local)`` of ``total`` rows sorted by destination rank: the block a rank keeps out
    of an exchange (its own rows, run while the exchange is in flight); ``local = 0``: every row travels."""

    first: int
    local: int
    total: int

    def own(self, t: torch.Tensor) -> torch.Tensor:
        """The own block's rows of ``t`` (all ``total`` rows in sorted order), a view."""
        return t[self.first:self.first + self.local]

    def others(self, t: torch.Tensor) -> torch.Tensor:
        """The rows of ``t`` (all ``total`` rows in sorted order) that go to other ranks, contiguous (a view
        when the own rows come first or last, as always with ep = 2, or when there are none)."""
        end = self.first + self.local
        if not self.local:
            return t
        if self.first and end < self.total:
            return torch.cat((t[:self.first], t[end:]))
        return t[:self.first] if self.first else t[end:]

    def merge(self, own: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
        """All ``total`` rows in sorted order from the own block's ``own`` and the others' ``others`` (the
        inverse of :meth:`others`)."""
        return torch.cat((others[:self.first], own, others[self.first:])) if self.local else others

    def place(self, rows: torch.Tensor, arrive):
        """Receive the rows that come back from other ranks into ``rows`` (all ``total`` rows in sorted
        order): ``arrive(buffer)`` starts the exchange into ``buffer`` and returns its handle; returns a
        ``finish()`` that waits and moves the rows into place (a view of ``rows`` when the own rows come
        first or last, as always with ep = 2, so nothing is copied)."""
        end = self.first + self.local
        if not self.local or not self.first or end == self.total:
            handle = arrive(rows if not self.local else rows[end:] if not self.first else rows[:self.first])
            return handle.wait
        buf = rows.new_empty((self.total - self.local,) + tuple(rows.shape[1:]))
        handle = arrive(buf)

        def finish():
            handle.wait()
            rows[:self.first].copy_(buf[:self.first])
            rows[end:].copy_(buf[self.first:])
        return finish


def _expert_major(sources: list[list[int]], device) -> tuple[torch.Tensor | None, torch.Tensor | None, list]:
    """Rows laid out by source, then local expert (``sources[s][j]`` rows) -> (the gather that regroups
    them expert-major, its inverse, the regrouped (local expert, rows) segments); no gather (None, None)
    with one source or none."""
    if len(sources) <= 1:
        return None, None, list(enumerate(sources[0])) if sources else []
    counts = torch.tensor(sources, dtype=torch.long)
    flat = counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(counts)
    perm = _segments(starts.t().reshape(-1), counts.t().reshape(-1)).to(device)
    inverse = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=device))
    return perm, inverse, list(enumerate(counts.sum(0).tolist()))


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` exchanged over the expert-parallel group's ``axes`` with split sizes; the backward sends
    the gradients back."""

    @staticmethod
    def forward(ctx, x, mesh, axes, out_splits, in_splits):
        ctx.mesh, ctx.axes, ctx.out_splits, ctx.in_splits = mesh, axes, out_splits, in_splits
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), mesh, axes, out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        gx = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        comm.all_to_all(gx, grad.contiguous(), ctx.mesh, ctx.axes, ctx.in_splits, ctx.out_splits)
        return gx, None, None, None, None


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` (rows, ...) as (rows, bytes a row) uint8, no copy when contiguous."""
    return t.contiguous().view(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


def _pair_all_to_all(a: torch.Tensor, a_send: list[int], a_recv: list[int], b: torch.Tensor, b_send: list[int],
                     b_recv: list[int], mesh, axes):
    """Rows of ``a`` and rows of ``b`` (other widths, other dtypes) exchanged in one ``all_to_all_single``: one
    collective's latency, not two.  Each destination's block of the bytes holds its ``a_send`` rows of ``a``,
    then its ``b_send`` rows of ``b``; ``a_recv``, ``b_recv`` say what arrives from each source.  Returns a
    ``finish()`` that waits and gives the received ``(a, b)``, so the caller can work while they travel."""
    a_bytes, b_bytes = _as_bytes(a), _as_bytes(b)
    ra, rb = a_bytes.shape[1], b_bytes.shape[1]
    pieces, i, j = [], 0, 0
    for na, nb in zip(a_send, b_send):
        pieces += [a_bytes[i:i + na].reshape(-1), b_bytes[j:j + nb].reshape(-1)]
        i, j = i + na, j + nb
    recv = [ra * na + rb * nb for na, nb in zip(a_recv, b_recv)]
    got = a_bytes.new_empty(sum(recv))
    pending = comm.all_to_all(got, torch.cat(pieces), mesh, axes, recv,
                              [ra * na + rb * nb for na, nb in zip(a_send, b_send)], async_op=True)

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        pending.wait()
        got_a, got_b, k = [], [], 0
        for na, size in zip(a_recv, recv):
            got_a.append(got[k:k + ra * na])
            got_b.append(got[k + ra * na:k + size])
            k += size
        return (torch.cat(got_a).view(a.dtype).view((-1,) + tuple(a.shape[1:])),
                torch.cat(got_b).view(b.dtype).view((-1,) + tuple(b.shape[1:])))
    return finish


class _PairAllToAll(torch.autograd.Function):
    """:func:`_pair_all_to_all` with its reverse as backward: two row tensors out in one exchange, and their
    gradients back in one (``a``'s only when it wants one: every rank's input does or none's does)."""

    @staticmethod
    def forward(ctx, a, b, mesh, axes, a_recv, a_send, b_recv, b_send):
        ctx.mesh, ctx.axes, ctx.splits = mesh, axes, (a_recv, a_send, b_recv, b_send)
        return _pair_all_to_all(a, a_send, a_recv, b, b_send, b_recv, mesh, axes)()

    @staticmethod
    def backward(ctx, g_a, g_b):
        a_recv, a_send, b_recv, b_send = ctx.splits
        if not ctx.needs_input_grad[0]:
            a_recv, a_send, g_a = [0] * len(a_recv), [0] * len(a_send), g_a[:0]
        back_a, back_b = _pair_all_to_all(g_a, a_recv, a_send, g_b, b_recv, b_send, ctx.mesh, ctx.axes)()
        return (back_a if ctx.needs_input_grad[0] else None, back_b, None, None, None, None, None, None)


class _PermuteRows(torch.autograd.Function):
    """``x.index_select(0, perm)`` whose backward is the gather by the ``inverse`` permutation (a
    permutation's adjoint), where ``index_select``'s own backward zero-fills and scatter-adds."""

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _split_bounds(bounds, h: int):
    """``bounds`` cut at row ``h``: (the parts before h, the parts from h on, counted from h)."""
    before, after = [], []
    for j, a, b in bounds:
        if a < h:
            before.append((j, a, min(b, h)))
        if b > h:
            after.append((j, max(a, h) - h, b - h))
    return before, after


class _ExpertParallelFFN(torch.autograd.Function):
    """The rows of ``flat`` (this rank's tokens) that the :class:`_Exchange` names, sorted by global expert
    -> the experts' outputs, row for row, with the rows for other ranks' experts exchanged over ep and the exchanges
    overlapped with this rank's own rows (the all-to-all runs on the communication backend's threads or
    stream while the expert matmuls run; Tutel, Hwang et al. 2023, and FasterMoE, He et al. 2022, pipeline
    the exchange with expert compute the same way)::

        forward:   send rows ──────────┐          return outputs ──────┐
                   experts on own A ───┴─ experts on received ─ own B ──┴─
        backward:  send output grads ──┐          return input grads ──┐
                   own B backward ─────┴─ received backward ── own A ──┴─

    Every rank issues the same two all-to-alls per forward and per backward in the same order whatever
    the routing (empty splits included); the backward's second, which returns the input gradients, only
    when the input wants them.  The weight gradients of an expert are summed over its parts;
    the input gradient is scattered onto ``flat`` (``index_add``: a token picked twice gets both)."""

    @staticmethod
    def forward(ctx, flat, ex: _Exchange, kernel, El, bias, *params):
        weights = cast_weights(params, flat.dtype)
        D = weights[El].shape[1]
        send = flat.index_select(0, ex.token_remote)
        got = flat.new_empty((sum(ex.recv_splits), flat.shape[1]))
        pending = comm.all_to_all(got, send, ex.mesh, ex.axes, ex.recv_splits, ex.send_splits, async_op=True)
        del send
        x_own = flat.index_select(0, ex.token_local)
        rows = flat.new_empty(ex.total, D)
        own = ex.own_block.own(rows)
        a = kernel.forward(x_own[:ex.half], ex.part_a, weights, El, bias, own[:ex.half])
        pending.wait()
        x_got = got if ex.perm is None else got.index_select(0, ex.perm)
        del got
        y_got = flat.new_empty(x_got.shape[0], D)
        r = kernel.forward(x_got, ex.remote, weights, El, bias, y_got)
        if ex.perm is not None:
            y_got = y_got.index_select(0, ex.inverse)
        finish = ex.own_block.place(rows, lambda buf: comm.all_to_all(buf, y_got, ex.mesh, ex.axes, ex.send_splits,
                                                            ex.recv_splits, async_op=True))
        b = kernel.forward(x_own[ex.half:], ex.part_b, weights, El, bias, own[ex.half:])
        finish()
        ctx.ex, ctx.kernel, ctx.El, ctx.bias, ctx.consumed, ctx.n = ex, kernel, El, bias, False, flat.shape[0]
        ctx.n_saved = len(a)
        ctx.save_for_backward(x_own, x_got, *a, *r, *b, *params)
        return rows

    @staticmethod
    def backward(ctx, grad):
        _once(ctx)
        ex, El, kernel = ctx.ex, ctx.El, ctx.kernel
        x_own, x_got, *rest = ctx.saved_tensors
        k = ctx.n_saved
        a_saved, r_saved, b_saved = (tuple(rest[i * k:(i + 1) * k]) for i in range(3))
        params = rest[3 * k:]
        weights = cast_weights(params[:2 * El], x_own.dtype)
        grad = grad.contiguous()
        acc = WeightGrads(El, ctx.bias)
        g_got = grad.new_empty(x_got.shape[0], grad.shape[1])
        pending = comm.all_to_all(g_got, ex.own_block.others(grad), ex.mesh, ex.axes, ex.recv_splits, ex.send_splits,
                                  async_op=True)
        # the input's gradient (the own rows' here, the others' computed on their experts' ranks and sent
        # back) only when it wants one: every rank's input does or none's does, so all skip the second
        # exchange together
        want = ctx.needs_input_grad[0]
        g_own_out, g_own = ex.own_block.own(grad), torch.empty_like(x_own) if want else None
        h = ex.half
        kernel.backward(g_own_out[h:], x_own[h:], b_saved, ex.part_b, weights, El, acc,
                        g_own[h:] if want else None)
        pending.wait()
        if ex.perm is not None:
            g_got = g_got.index_select(0, ex.perm)
        g_x_got = torch.empty_like(x_got) if want else None
        kernel.backward(g_got, x_got, r_saved, ex.remote, weights, El, acc, g_x_got)
        if not want:
            kernel.backward(g_own_out[:h], x_own[:h], a_saved, ex.part_a, weights, El, acc, None)
            return (None, None, None, None, None, *acc.result(params, x_own))
        if ex.perm is not None:
            g_x_got = g_x_got.index_select(0, ex.inverse)
        g_back = g_x_got.new_empty(ex.total - ex.local, x_got.shape[1])
        pending = comm.all_to_all(g_back, g_x_got, ex.mesh, ex.axes, ex.send_splits, ex.recv_splits, async_op=True)
        kernel.backward(g_own_out[:h], x_own[:h], a_saved, ex.part_a, weights, El, acc, g_own[:h])
        g_flat = g_own.new_zeros(ctx.n, g_own.shape[1]).index_add_(0, ex.token_local, g_own)
        pending.wait()
        g_flat.index_add_(0, ex.token_remote, g_back)
        return (g_flat, None, None, None, None, *acc.result(params, x_own))


# ---------------------------------------------------------------------------------------------------
# the exchange with one row per (token, rank): DeepEP's dispatch and combine


#: how an expert-parallel MoE layer exchanges its tokens (``parallel.expert_dispatch``): ``"choice"``, one row per
#: kept (token, expert) choice, the outputs combined on the token's rank (GShard, DeepSpeed-MoE, Megatron-core's
#: alltoall dispatcher; :class:`ChoiceDispatch`); ``"rank"``, one row per (token, expert-parallel rank holding any
#: of its kept choices), the choices' outputs combined on that rank (DeepEP's dispatch and combine;
#: :class:`RankDispatch`); ``"node"``, one row per (token, node holding any of its kept choices) sent to the rank of
#: the same within-node index there, which forwards it per rank inside its node (DeepEP's internode dispatch and
#: combine, DeepSeek-V3 section 3.2.2; :class:`NodeDispatch`)
EXPERT_DISPATCHES = ("choice", "rank", "node")


def check_expert_dispatch(dispatch: str, width_split: bool = False) -> None:
    """One-line ValueErrors naming the key and the fix."""
    if dispatch not in EXPERT_DISPATCHES:
        raise ValueError(f"parallel.expert_dispatch={dispatch!r} is not one of {', '.join(EXPERT_DISPATCHES)}")
    problem = expert_dispatch_problem(dispatch, width_split)
    if problem:
        raise ValueError(problem)


class _RankExchange:
    """One layer's exchange with a row per (token, destination rank), fixed by the routing.

    The kept choices, sorted by global expert (so by destination rank, then local expert, then priority), are
    ``token`` and ``expert``.  A token with several choices on one rank is sent there once: the unique (rank,
    token) pairs, sorted by rank then token, are the rows this rank sends each rank (:attr:`token` lists their
    tokens), and each choice names its row by its index in its destination's block (:attr:`pair_row`).  The
    count exchange (one ``all_to_all_single`` of ep x (E/ep + 1) integers, entered by every rank whatever the
    routing) tells each rank how many choices it gets from each rank for each local expert and how many rows
    carry them; it is started here and awaited by :meth:`wait`, so the caller can run the shared expert
    meanwhile.  As with one row per choice (:class:`_Exchange`, :data:`MIN_SEGMENT_ROWS`), when the segments
    are long a rank's own rows and choices stay out of the exchanges (its own splits are 0) and run in two
    halves while they are in flight; otherwise they travel as its own split."""

    def __init__(self, mesh, axes: tuple[str, ...], El: int, token: torch.Tensor, expert: torch.Tensor,
                 counts: torch.Tensor, n_tokens: int):
        self.mesh, self.axes, self.El = mesh, axes, El
        n = mesh.size(*axes)
        self.choice_token = token
        #: the token of each row sent (by destination rank, then token), the rows a rank, and each kept choice's
        #: row in the block of rows sent to its destination rank
        self.token, rows, self.pair_row = _rows_once_a_destination(torch.div(expert, El, rounding_mode="floor"),
                                                                   token, n, n_tokens)
        self._send = torch.cat((counts.view(n, El), rows.view(n, 1)), 1)
        self._recv = torch.empty_like(self._send)
        self._pending = comm.all_to_all(self._recv.view(-1), self._send.reshape(-1).contiguous(), mesh, axes,
                                        async_op=True)

    def wait(self) -> None:
        """Finish the count exchange and lay out what arrives: rows and choices per source rank, the own rows'
        and choices' blocks and halves, the received choices' regrouping expert-major and their segments."""
        self._pending.wait()
        send, recv, El = self._send.tolist(), self._recv.tolist(), self.El
        me = self.mesh.local_rank(*self.axes)
        send_rows, recv_rows = [s[El] for s in send], [r[El] for r in recv]
        send_pairs, recv_pairs = [sum(s[:El]) for s in send], [sum(r[:El]) for r in recv]
        #: the choices this rank's experts run (every rank's for them, its own included)
        self.rows_in = sum(recv_pairs)
        self.overlap = overlap = overlaps_exchange(self.rows_in, len(send) * El)
        #: the own rows among the rows sent (and their outputs back), the own choices among the choices
        self.rows_block = _OwnBlock(sum(send_rows[:me]), send_rows[me] if overlap else 0, sum(send_rows))
        self.choices_block = _OwnBlock(sum(send_pairs[:me]), send_pairs[me] if overlap else 0, sum(send_pairs))
        if overlap:
            for split in (send_rows, recv_rows, send_pairs, recv_pairs):
                split[me] = 0
        #: rows (unique tokens) and choices sent to / received from each rank
        self.send_rows, self.recv_rows, self.send_pairs, self.recv_pairs = send_rows, recv_rows, send_pairs, recv_pairs
        #: the tokens of the rows that travel (all but the own block's)
        self.token_remote = self.rows_block.others(self.token)
        c = self.choices_block
        #: the own choices' tokens, rows in the own block, and their two halves' segments
        self.own_token, self.own_row = c.own(self.choice_token), c.own(self.pair_row)
        self.half = c.local // 2
        self.part_a, self.part_b = (_split_bounds(segment_bounds(enumerate(send[me][:El])), self.half) if overlap
                                    else ([], []))
        dev = self.token.device
        self.source_start = _source_starts(recv_rows, recv_pairs, dev)
        sources = [r[:El] for i, r in enumerate(recv) if i != me or not overlap]
        self.perm, self.inverse, segments = _expert_major(sources, dev)
        self.bounds = segment_bounds(segments)


def _rows_once_a_destination(dest: torch.Tensor, token: torch.Tensor, n_dest: int, n_tokens: int):
    """Kept choices (sorted by ``dest``, their destination, with their ``token`` s) -> one row per (destination,
    token): (the rows' tokens, sorted by destination then token; the rows each of ``n_dest`` destinations gets;
    each choice's row in its destination's block).  One ``unique`` over the pairs."""
    uniq, inverse = torch.unique(dest * n_tokens + token, sorted=True, return_inverse=True)
    rows = torch.bincount(torch.div(uniq, n_tokens, rounding_mode="floor"), minlength=n_dest)
    return uniq.remainder(n_tokens), rows, inverse - (torch.cumsum(rows, 0) - rows).index_select(0, dest)


def _source_starts(rows: list[int], choices: list[int], device) -> torch.Tensor:
    """For received choices laid out by source (``choices[s]`` from source ``s``), where their source's block of
    received rows (``rows[s]`` rows each) starts: a choice's row index in its block plus this is its row."""
    starts = torch.tensor(rows, dtype=torch.long).cumsum(0) - torch.tensor(rows, dtype=torch.long)
    return torch.repeat_interleave(starts, torch.tensor(choices, dtype=torch.long), output_size=sum(choices)).to(device)


class _RankDispatchFFN(torch.autograd.Function):
    """This rank's tokens ``flat`` and the gate values ``w`` of its kept choices (sorted by global expert) ->
    one output row per row :class:`_RankExchange` sends: the sum, over the token's choices on that rank, of
    gate value x expert output, computed there (DeepEP's dispatch and combine; DeepSeek-V3 section 3.2.2 sends
    a token once per node and shares it among that node's experts).  Per forward, after the count exchange,
    two ``all_to_all_single`` s: the rows with the choices in the same bytes (each choice its row index and gate
    value, two float64s: exact for indices below 2^53 and for fp32 gates; :func:`_pair_all_to_all`), and the
    combined rows back; per backward the output gradients out, and the gate values' gradients back with (when
    the input wants one) the input gradients, each a sum over the token's choices on that rank: as many
    collectives as the per-choice exchange's.  Every rank enters them in this order whatever the routing,
    empty splits included.  A rank's own choices, when the exchange keeps them out
    (:attr:`_RankExchange.overlap`), run in two halves while the exchanges are in flight, as
    :class:`_ExpertParallelFFN` runs its own rows.

    On the experts' rank, a choice's gradients are those of ``y_row += w e(x)``: ``d e = w g_row``,
    ``d w = <g_row, e(x)>``, ``d x_row += d x``; the expert outputs ``e`` are kept for the gate values'
    gradient, as the per-choice combine keeps them (:class:`ChoiceDispatch`)."""

    @staticmethod
    def forward(ctx, flat, w, ex: _RankExchange, kernel, El, bias, *params):
        weights = cast_weights(params, flat.dtype)
        D = weights[El].shape[1]
        mesh, axes, own_rows, own_choices, h = ex.mesh, ex.axes, ex.rows_block, ex.choices_block, ex.half
        choices = torch.stack((ex.pair_row.to(torch.float64), w.detach().to(torch.float64)), 1)
        arrive = _pair_all_to_all(flat.index_select(0, ex.token_remote), ex.send_rows, ex.recv_rows,
                                  own_choices.others(choices), ex.send_pairs, ex.recv_pairs, mesh, axes)
        x_own = flat.index_select(0, ex.own_token)
        e_own = flat.new_empty(x_own.shape[0], D)
        a = kernel.forward(x_own[:h], ex.part_a, weights, El, bias, e_own[:h]) if ex.overlap else ()
        got, got_choices = arrive()
        row = got_choices[:, 0].long() + ex.source_start           # each received choice's received row
        gate = got_choices[:, 1]
        if ex.perm is not None:                                    # expert-major
            row, gate = row.index_select(0, ex.perm), gate.index_select(0, ex.perm)
        x = got.index_select(0, row)
        e = flat.new_empty(x.shape[0], D)
        r = kernel.forward(x, ex.bounds, weights, El, bias, e)
        gate = gate.to(e.dtype)
        combined = e.new_zeros(got.shape[0], D).index_add_(0, row, e * gate.unsqueeze(1))
        back = flat.new_empty(ex.token.shape[0], D)
        finish = own_rows.place(back, lambda buf: comm.all_to_all(buf, combined, mesh, axes, ex.send_rows,
                                                                  ex.recv_rows, async_op=True))
        gate_own = own_choices.own(w.detach()).to(e.dtype)
        b = ()
        if ex.overlap:
            b = kernel.forward(x_own[h:], ex.part_b, weights, El, bias, e_own[h:])
            mine = own_rows.own(back)
            mine.zero_().index_add_(0, ex.own_row, e_own * gate_own.unsqueeze(1))
        finish()
        ctx.ex, ctx.kernel, ctx.El, ctx.bias, ctx.consumed = ex, kernel, El, bias, False
        ctx.n, ctx.n_got, ctx.w_dtype, ctx.n_saved = flat.shape[0], got.shape[0], w.dtype, (len(r), len(a), len(b))
        ctx.save_for_backward(x, e, row, gate, x_own, e_own, gate_own, *r, *a, *b, *params)
        return back

    @staticmethod
    def backward(ctx, grad):
        _once(ctx)
        ex, El, kernel, mesh, axes = ctx.ex, ctx.El, ctx.kernel, ctx.ex.mesh, ctx.ex.axes
        own_rows, own_choices, h = ex.rows_block, ex.choices_block, ex.half
        x, e, row, gate, x_own, e_own, gate_own, *rest = ctx.saved_tensors
        n_r, n_a, n_b = ctx.n_saved
        r, a, b = tuple(rest[:n_r]), tuple(rest[n_r:n_r + n_a]), tuple(rest[n_r + n_a:n_r + n_a + n_b])
        params = rest[n_r + n_a + n_b:]
        weights = cast_weights(params[:2 * El], x.dtype)
        grad = grad.contiguous()
        g_got = grad.new_empty(ctx.n_got, grad.shape[1])
        pending = comm.all_to_all(g_got, own_rows.others(grad), mesh, axes, ex.recv_rows, ex.send_rows,
                                  async_op=True)
        want = ctx.needs_input_grad[0]
        acc = WeightGrads(El, ctx.bias)
        g_x_own = torch.empty_like(x_own) if want else None
        # the own choices' gradients (the second half's backward while the output gradients travel)
        g_own = own_rows.own(grad).index_select(0, ex.own_row)
        d_gate_own = (g_own * e_own).sum(1).to(ctx.w_dtype)
        g_own.mul_(gate_own.unsqueeze(1))
        if ex.overlap:
            kernel.backward(g_own[h:], x_own[h:], b, ex.part_b, weights, El, acc, g_x_own[h:] if want else None)
        pending.wait()
        g = g_got.index_select(0, row)                             # each choice's row's gradient
        d_gate = (g * e).sum(1).to(ctx.w_dtype)
        if ex.perm is not None:                                    # back to the order the choices arrived in
            d_gate = d_gate.index_select(0, ex.inverse)
        g_x = torch.empty_like(x) if want else None
        kernel.backward(g.mul_(gate.unsqueeze(1)), x, r, ex.bounds, weights, El, acc, g_x)
        # the input gradients (when wanted: every rank's input does or none's does) and the gate gradients back
        # in one exchange, while the own rows' first half runs its backward
        g_rows = g_x.new_zeros(ctx.n_got, x.shape[1]).index_add_(0, row, g_x) if want else x.new_empty(0, x.shape[1])
        none = [0] * len(ex.recv_rows)
        arrive = _pair_all_to_all(g_rows, ex.recv_rows if want else none, ex.send_rows if want else none,
                                  d_gate.unsqueeze(1), ex.recv_pairs, ex.send_pairs, mesh, axes)
        if ex.overlap:
            kernel.backward(g_own[:h], x_own[:h], a, ex.part_a, weights, El, acc, g_x_own[:h] if want else None)
        g_flat = x.new_zeros(ctx.n, x.shape[1]).index_add_(0, ex.own_token, g_x_own) if want else None
        g_back, d_gate_back = arrive()
        if want:
            g_flat.index_add_(0, ex.token_remote, g_back)
        return (g_flat, own_choices.merge(d_gate_own, d_gate_back.squeeze(1)), None, None, None, None,
                *acc.result(params, x))


# ---------------------------------------------------------------------------------------------------
# expert tensor parallelism


def _gather_rows(x: torch.Tensor, mesh, sizes: list[int]) -> torch.Tensor:
    """Every tp rank's rows, ``sizes[t]`` from tp rank ``t``, concatenated in rank order (an all-gather of
    uneven pieces: one ``all_to_all_single`` that sends this rank's rows to every tp rank; gloo's list
    all-to-all refuses uneven sizes)."""
    n = len(sizes)
    out = x.new_empty((sum(sizes),) + tuple(x.shape[1:]))
    comm.all_to_all(out, x.contiguous().repeat((n,) + (1,) * (x.dim() - 1)), mesh, "tp", sizes, [x.shape[0]] * n)
    return out


def _reduce_scatter_rows(y: torch.Tensor, mesh, sizes: list[int]) -> torch.Tensor:
    """The inverse of :func:`_gather_rows`: ``y`` holds every tp rank's rows (``sizes[t]`` of tp rank ``t``,
    in rank order) and each tp rank gets its own back from every tp rank, summed (a reduce-scatter of uneven
    pieces: one ``all_to_all_single``, then a sum of the tp pieces in rank order)."""
    n, mine = len(sizes), sizes[mesh.local_rank("tp")]
    out = y.new_empty((n * mine,) + tuple(y.shape[1:]))
    comm.all_to_all(out, y.contiguous(), mesh, "tp", [mine] * n, sizes)
    return out.view((n, mine) + tuple(y.shape[1:])).sum(0)


class _GatherRowsTP(torch.autograd.Function):
    """:func:`_gather_rows` forward, :func:`_reduce_scatter_rows` backward (each row's gradient, computed on
    every tp rank's part of the experts, summed on the rank that owns the row)."""

    @staticmethod
    def forward(ctx, x, mesh, sizes):
        ctx.mesh, ctx.sizes = mesh, sizes
        return _gather_rows(x, mesh, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad, ctx.mesh, ctx.sizes), None, None


class _ReduceScatterRowsTP(torch.autograd.Function):
    """:func:`_reduce_scatter_rows` forward, :func:`_gather_rows` backward (the gradient of a row's summed
    output reaches every tp rank's partial output of it)."""

    @staticmethod
    def forward(ctx, y, mesh, sizes):
        ctx.mesh, ctx.sizes = mesh, sizes
        return _reduce_scatter_rows(y, mesh, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.mesh, ctx.sizes), None, None


def _width_part_weights(experts: list["Expert"], bias: bool, like: torch.Tensor) -> list:
    """The kernel's weights (:class:`ExpertKernel` order) of these experts' tp parts under :class:`WidthSplit`:
    ``w_fc``, ``w_proj`` and ``b_fc`` as held, and zeros standing in for ``b_proj``, which is added once after
    the partial outputs are summed over tp."""
    weights = [e.w_fc for e in experts] + [e.w_proj for e in experts]
    if bias:
        weights += [e.b_fc for e in experts] + [like.new_zeros(e.b_proj.shape) for e in experts]
    return weights


class WidthSplit:
    """Expert tensor parallelism: every expert's hidden width split over the mesh's tp ranks (Megatron-core's
    ``expert_tensor_parallel_size = tp``, its default, with the alltoall token dispatcher; the column/row
    split of a feed-forward is Shoeybi et al. 2019's, section 3).  Tp rank ``t`` holds, of each expert of
    its ep rank, ``w_fc``'s columns and ``b_fc``'s entries ``[t h/tp, (t+1) h/tp)`` and ``w_proj``'s same
    rows (:data:`WIDTH_LAYOUTS`), and ``b_proj`` whole.  Where experts are few and large (8 experts at
    tp 8 x ep 8) this is the layout that fits; MoE parallel folding (``fold_tp``) instead shards whole
    experts over ep x tp, which needs experts divisible by ep·tp and sends each row once over the ep x tp
    group rather than all-gathering the rows over tp and reduce-scattering their outputs (Liu et al. 2025
    compare the two).

    The tokens: each tp rank routes its own samples and exchanges them over its ep group as without the
    split; then :meth:`run` all-gathers the tp ranks' received rows over tp (counts first, then the rows,
    uneven pieces), regroups them expert-major, runs them through this rank's part of each expert (the
    kernels unchanged on the narrower weights, without ``b_proj``), reduce-scatters the partial outputs
    back to the tp rank that owns each row (a sum over tp), adds ``b_proj`` there once per row, and the ep
    exchange returns them as usual.  The backward mirrors it (:class:`_GatherRowsTP` and
    :class:`_ReduceScatterRowsTP` are each other's backward).  Every tp rank enters the same collectives in
    the same order whatever the routing (an all-gather of counts and two all-to-alls per forward, two per
    backward), zero rows included.  The exchange's overlap of a rank's own rows
    (:class:`_ExpertParallelFFN`) is not used: every tp rank's rows run together.  A shared expert is split
    the same way and runs every tp rank's tokens by :meth:`run_dense`.

    Gradients: a split tensor's gradient is whole on its holder (every row of the tp group passed through
    it), so it is tagged ``tensor_parallel`` (the global norm sums its squares over tp, as a tp shard's);
    ``b_proj``'s is partial (each tp rank adds it to its own rows) and summed over tp like the router's
    (``sequence_parallel``)."""

    def __init__(self, mesh):
        self.mesh, self.tp = mesh, mesh.size("tp")

    def run(self, experts: "Experts", x: torch.Tensor, sources: list[list[int]]) -> torch.Tensor:
        """:meth:`Experts.run_received` with the width split: ``x`` this tp rank's received rows laid out by
        source, then local expert (``sources[s][j]`` rows); returns their whole outputs, row for row."""
        El, n = experts.num_local, self.tp
        mine = torch.tensor(sources, dtype=torch.long).view(-1, El)
        every = torch.empty((n,) + tuple(mine.shape), dtype=torch.long, device=self.mesh.device)
        comm.all_gather(every.view(-1), mine.view(-1).to(self.mesh.device), self.mesh, "tp")
        every = every.cpu()
        sizes = every.view(n, -1).sum(1).tolist()
        rows = _GatherRowsTP.apply(x, self.mesh, sizes)        # by tp rank, then source, then local expert
        perm, inverse, segments = _expert_major(every.view(-1, El).tolist(), x.device)
        if perm is not None:
            rows = _PermuteRows.apply(rows, perm, inverse)
        ex = list(experts.values())
        y = _GroupedFFN.apply(rows, segments, experts.kernel_for_rows(rows), El, experts.bias,
                              *_width_part_weights(ex, experts.bias, x))
        if perm is not None:
            y = _PermuteRows.apply(y, inverse, perm)
        y = _ReduceScatterRowsTP.apply(y, self.mesh, sizes)
        if not experts.bias:
            return y
        expert_of_row = torch.arange(El).repeat(mine.shape[0]).repeat_interleave(mine.view(-1)).to(x.device)
        b_proj = torch.stack([e.b_proj for e in ex]).to(y.dtype)
        return y + b_proj.index_select(0, expert_of_row)

    def run_dense(self, expert: "Expert", x: torch.Tensor, kernel: ExpertKernel) -> torch.Tensor:
        """A dense feed-forward (the MoE layer's shared expert, :attr:`MoELayer.shared`) whose hidden width is
        split over tp as the routed experts' is, on every row of ``x``, this tp rank's tokens; returns their
        whole outputs, row for row.  Megatron-core's ``SharedExpertMLP`` is such a tensor-parallel MLP
        (column-parallel ``fc1``, row-parallel ``fc2``: Shoeybi et al. 2019, section 3).  Here each tp rank
        holds other samples (:meth:`MoELayer.forward`), so the rows of every tp rank are all-gathered over tp
        (:class:`_GatherRowsTP`), run through this rank's ``h/tp`` of the width, and the partial outputs
        reduce-scattered back to their tp rank (:class:`_ReduceScatterRowsTP`, a sum over tp), where ``b_proj``
        is added once: the same two collectives and the same gradient rule as :meth:`run` (the split tensors'
        gradients whole on their holder, ``b_proj``'s partial and summed over tp)."""
        sizes = [x.shape[0]] * self.tp          # every tp rank holds as many samples (MoELayer.forward)
        rows = _GatherRowsTP.apply(x, self.mesh, sizes)
        bias = expert.b_fc is not None
        y = _GroupedFFN.apply(rows, [(0, rows.shape[0])], kernel, 1, bias, *_width_part_weights([expert], bias, x))
        y = _ReduceScatterRowsTP.apply(y, self.mesh, sizes)
        return y + expert.b_proj.to(y.dtype) if bias else y


def _tp_all_to_all(x: torch.Tensor, mesh, split_dim: int, cat_dim: int) -> torch.Tensor:
    """``x`` cut into tp equal pieces along ``split_dim``, piece ``j`` sent to tp rank ``j``; the pieces
    received, in rank order, concatenated along ``cat_dim`` (one equal-split all-to-all over tp)."""
    n = mesh.size("tp")
    send = torch.stack(x.chunk(n, dim=split_dim)).contiguous()
    got = torch.empty_like(send)
    comm.all_to_all(got.view(-1), send.view(-1), mesh, "tp")
    return torch.cat(list(got.unbind(0)), dim=cat_dim)


class _TPAllToAll(torch.autograd.Function):
    """:func:`_tp_all_to_all` with its inverse as backward: (B, T/tp, ...) sequence shards -> (B/tp, T, ...)
    whole sequences of this rank's samples with ``split_dim=0, cat_dim=1``, and back with the dims swapped.
    Both directions move each element once, so nothing is summed: the gradient of every position reaches
    the one rank that holds it."""

    @staticmethod
    def forward(ctx, x, mesh, split_dim: int, cat_dim: int):
        ctx.mesh, ctx.split_dim, ctx.cat_dim = mesh, split_dim, cat_dim
        return _tp_all_to_all(x, mesh, split_dim=split_dim, cat_dim=cat_dim)

    @staticmethod
    def backward(ctx, grad):
        return _tp_all_to_all(grad, ctx.mesh, split_dim=ctx.cat_dim, cat_dim=ctx.split_dim), None, None, None


def _sequence_to_samples(x: torch.Tensor, mesh) -> torch.Tensor:
    """(B, T/tp, ...) sequence shards -> (B/tp, T, ...) whole sequences (an all-to-all over tp)."""
    return _TPAllToAll.apply(x, mesh, 0, 1)


def _samples_to_sequence(x: torch.Tensor, mesh) -> torch.Tensor:
    """The inverse of :func:`_sequence_to_samples`: (B/tp, T, ...) -> (B, T/tp, ...)."""
    return _TPAllToAll.apply(x, mesh, 1, 0)


@torch.no_grad()
def _gather_positions(x: torch.Tensor, mesh) -> torch.Tensor:
    """(B, T/tp, ...) -> (B, T, ...) on every tp rank (inference only: an all-gather, no backward)."""
    n = mesh.size("tp")
    parts = torch.empty((n,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(parts.view(-1), x.contiguous().view(-1), mesh, "tp")
    return torch.cat(list(parts.unbind(0)), dim=1)


def _segments(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenated ``arange(start, start + length)`` for each pair (no Python loop)."""
    total = int(lengths.sum())
    seg_start = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - seg_start, lengths, output_size=total) + \
        torch.arange(total, device=starts.device)


# ---------------------------------------------------------------------------------------------------
# the dispatchers: how an expert-parallel layer's choices reach their experts and come back


def _combine(r: Routing, token: torch.Tensor, rows: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """The kept choices' expert outputs ``rows`` (sorted by expert, the tokens ``token``) times their gate
    values, added onto their tokens (onto the shared expert's outputs when the layer has one)."""
    w = r.weight.reshape(-1).index_select(0, r.order).to(rows.dtype)
    y = rows.new_zeros(r.expert.shape[0], rows.shape[1]) if shared is None else shared
    return y.index_add_(0, token, rows * w.unsqueeze(1))


def _kept_choices(r: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept choices, sorted by global expert: (their tokens, experts, gate values)."""
    return (r.order // r.expert.shape[1], r.expert.reshape(-1).index_select(0, r.order),
            r.weight.reshape(-1).index_select(0, r.order))


class ExpertDispatch(Protocol):
    """How an expert-parallel MoE layer (ep > 1) sends its kept choices to their experts' ranks and gets their
    outputs back (Megatron-core's token dispatchers are such a seam)."""

    def __call__(self, layer: "MoELayer", inp: torch.Tensor, r: Routing) -> tuple[torch.Tensor, int]:
        """``inp`` (N, d), this rank's tokens in the experts' dtype, routed by ``r`` -> (their combined outputs
        (N, d), the shared expert's added when the layer has one; the rows this rank's experts ran).  Collective
        over the layer's :attr:`~MoELayer.expert_axes`: every rank enters the same collectives in the same order
        whatever the routing."""


class ChoiceDispatch:
    """One row per kept (token, expert) choice (GShard, section 3; DeepSpeed-MoE; Megatron-core's alltoall
    dispatcher): the count exchange, the rows (a rank's own overlapped with the exchange when the segments
    are long, :class:`_ExpertParallelFFN`, else regrouped with the rest), the outputs back, combined on the
    token's rank.  Three all-to-alls per forward, two per backward (one when the input wants no gradient)."""

    def __call__(self, layer: "MoELayer", inp: torch.Tensor, r: Routing) -> tuple[torch.Tensor, int]:
        token = r.order // r.expert.shape[1]                   # the kept choices' tokens, sorted by expert
        send = r.counts.view(layer.ep, layer.experts.num_local)
        recv = torch.empty_like(send)
        pending = comm.all_to_all(recv.view(-1), send.reshape(-1).contiguous(), layer.mesh, layer.expert_axes,
                                  async_op=True)
        shared = layer.shared_output(inp)                            # while the counts are in flight
        exchange = _Exchange(layer.mesh, layer.expert_axes, send.tolist(), recv, pending, token,
                             may_overlap=layer.experts.width is None)
        rows = layer.experts.forward_exchanged(inp, exchange)
        return _combine(r, token, rows, shared), exchange.rows_in


class RankDispatch:
    """One row per (token, expert-parallel rank that holds any of its kept choices), the choices' outputs
    combined there (DeepEP's dispatch and combine, DeepSeek-AI 2025; :class:`_RankDispatchFFN`): a token whose
    k choices fall on fewer than k ranks crosses the network fewer than k times each way, which is what
    node-limited routing (DeepSeek-V3 section 2.1.2, :class:`~podscale.parallel.moe.gate.Gating`'s groups laid
    over the ranks) buys.  Three all-to-alls per forward (counts, rows with their choices, outputs) and two per
    backward, as the per-choice dispatch's; a rank's own choices run while they are in flight, under the
    per-choice dispatch's rule (:data:`MIN_SEGMENT_ROWS`).  Not with the experts' width split over tp."""

    def __call__(self, layer: "MoELayer", inp: torch.Tensor, r: Routing) -> tuple[torch.Tensor, int]:
        token, expert, w = _kept_choices(r)
        exchange = self.start(layer, token, expert, r.counts, inp.shape[0])
        shared = layer.shared_output(inp)                      # while the counts are in flight
        exchange.wait()
        return self.run(layer, inp, w, exchange, shared), exchange.rows_in

    @staticmethod
    def start(layer: "MoELayer", token: torch.Tensor, expert: torch.Tensor, counts: torch.Tensor,
              n_tokens: int) -> _RankExchange:
        """The exchange of kept choices ``token``, ``expert`` (sorted by global expert; ``counts`` per expert) of
        ``n_tokens`` rows, its count exchange started (:meth:`_RankExchange.wait` finishes it)."""
        return _RankExchange(layer.mesh, layer.expert_axes, layer.experts.num_local, token, expert, counts, n_tokens)

    @staticmethod
    def run(layer: "MoELayer", rows: torch.Tensor, w: torch.Tensor, exchange: _RankExchange,
            onto: torch.Tensor | None) -> torch.Tensor:
        """``rows`` through the experts of their choices (gate values ``w``, in the exchange's order) wherever
        those live: each row's gated outputs summed, added onto ``onto`` when given (else zeros)."""
        ex = layer.experts
        back = _RankDispatchFFN.apply(rows, w, exchange, ex.kernel_for_rows(rows), ex.num_local, ex.bias,
                                      *ex.kernel_weights())
        y = back.new_zeros(rows.shape[0], back.shape[1]) if onto is None else onto
        return y.index_add_(0, exchange.token, back)


@dataclass(frozen=True)
class NodeGroups:
    """The expert group's ranks by node: ``per_node`` of them on each of ``nodes`` nodes, in group order (a rank's
    node is its global rank over ``ranks_per_node``, as torchrun and podscale's launcher number ranks node by
    node); this rank is the ``index``-th of its node's, and on node ``b`` its peer is group rank
    ``b * per_node + index``."""

    nodes: int
    per_node: int
    index: int

    @classmethod
    def of(cls, mesh, axes: tuple[str, ...], ranks_per_node: int) -> "NodeGroups":
        """The grouping of ``mesh``'s group over ``axes`` (a one-line ValueError when its nodes hold unequal
        shares of it)."""
        node = [g // ranks_per_node for g in mesh.group_ranks(*axes)]
        runs = [len(list(run)) for _, run in itertools.groupby(node)]
        if len(set(runs)) != 1 or len(runs) != len(set(node)):
            raise ValueError(f"parallel.expert_dispatch = 'node' needs every node to hold as many ranks of the "
                             f"expert-parallel group, in one run each; with {ranks_per_node} ranks a node they hold "
                             f"{runs}: use expert_dispatch = 'rank'")
        me = mesh.local_rank(*axes)
        return cls(len(runs), runs[0], me % runs[0])


class NodeDispatch:
    """One row per (token, node that holds any of its kept choices) between nodes, then one per (row, rank)
    inside the node (DeepEP's internode dispatch and combine, DeepSeek-AI 2025: a token crosses the slow
    network once to each of its nodes, to the rank with the sender's index there, which forwards it over the
    fast links to the node's ranks of its experts; DeepSeek-V3 section 3.2.2).  With node-limited routing (at
    most M nodes a token, DeepSeek-V3 section 2.1.2) a top-k token crosses between nodes at most M times each
    way.

    Stage 1, over the expert group with every split but the peers' empty: the counts (rows and choices a peer),
    then the rows with, in the same bytes, each choice's row index, global expert id and gate value (three
    float64s, differentiable in the gate; :class:`_PairAllToAll`); the peer then runs the rows through its
    node's experts with the per-rank dispatch (:meth:`RankDispatch.run`, whose splits all stay inside the
    node), and stage 1's rows come back summed.  Six all-to-alls per forward and four per backward (the
    per-rank dispatch's three and two, stage 1's three and two), every rank entering them in the same order
    whatever the routing."""

    def __init__(self, groups: NodeGroups):
        self.groups = groups

    def __call__(self, layer: "MoELayer", inp: torch.Tensor, r: Routing) -> tuple[torch.Tensor, int]:
        g, mesh, axes, El = self.groups, layer.mesh, layer.expert_axes, layer.experts.num_local
        n, N = layer.ep, inp.shape[0]
        token, expert, w = _kept_choices(r)
        node = torch.div(expert, El * g.per_node, rounding_mode="floor")
        uniq_token, rows, row = _rows_once_a_destination(node, token, g.nodes, N)
        pairs = torch.bincount(node, minlength=g.nodes)
        peers = torch.arange(g.nodes, device=rows.device) * g.per_node + g.index
        send = rows.new_zeros(n, 2).index_copy_(0, peers, torch.stack((rows, pairs), 1))
        recv = torch.empty_like(send)
        pending = comm.all_to_all(recv.view(-1), send.view(-1), mesh, axes, async_op=True)
        shared = layer.shared_output(inp)                      # while the counts are in flight
        pending.wait()
        (send_rows, send_pairs), (recv_rows, recv_pairs) = send.t().tolist(), recv.t().tolist()
        choices = torch.stack((row.to(torch.float64), expert.to(torch.float64), w.to(torch.float64)), 1)
        got, got_choices = _PairAllToAll.apply(inp.index_select(0, uniq_token), choices, mesh, axes, recv_rows,
                                               send_rows, recv_pairs, send_pairs)
        # the received choices (all for this node's experts), each source's by expert: sorted by expert
        got_expert = got_choices[:, 1].detach().long()
        by_expert = torch.sort(got_expert, stable=True).indices
        got_row = (got_choices[:, 0].detach().long() + _source_starts(recv_rows, recv_pairs, got.device)
                   ).index_select(0, by_expert)
        got_expert = got_expert.index_select(0, by_expert)
        counts = torch.bincount(got_expert, minlength=layer.num_experts)
        exchange = RankDispatch.start(layer, got_row, got_expert, counts, got.shape[0])
        exchange.wait()
        gate = got_choices[:, 2].index_select(0, by_expert).to(w.dtype)
        out = RankDispatch.run(layer, got, gate, exchange, None)
        back = _AllToAll.apply(out, mesh, axes, send_rows, recv_rows)
        y = back.new_zeros(N, back.shape[1]) if shared is None else shared
        return y.index_add_(0, uniq_token, back), exchange.rows_in


def make_dispatch(name: str, mesh, axes: tuple[str, ...], ranks_per_node: int | None = None,
                  top_k: int = 2) -> ExpertDispatch:
    """The dispatcher ``parallel.expert_dispatch = name`` names (:data:`EXPERT_DISPATCHES`) for the expert group
    over ``mesh``'s ``axes``; ``"node"`` on a group inside one node (or without a mesh) is ``"rank"``, and
    ``"rank"`` at ``top_k = 1`` is ``"choice"`` (a token's one choice is on one rank: the same rows, without the
    choices' metadata and the search for unique rows).  ``ranks_per_node``: global ranks a node (default: the
    launcher's local world size)."""
    if name == "choice" or (name == "rank" and top_k == 1):
        return ChoiceDispatch()
    if name == "node" and mesh is not None:
        groups = NodeGroups.of(mesh, axes, ranks_per_node or local_slot()[1])
        if groups.nodes > 1:
            return NodeDispatch(groups)
    return RankDispatch()


# ---------------------------------------------------------------------------------------------------
# the layer


@dataclass
class MoEOutput:
    """What a forward returns beside the output: ``loss`` (``aux_loss_coef * aux + z_loss_coef * z``, to
    add to the model's loss), the raw ``aux_loss`` and ``z_loss``, the routing and its statistics."""

    loss: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    routing: Routing
    stats: MoEStats


class MoELayer(nn.Module, StepState):
    """A sparsely gated mixture-of-experts feed-forward layer (GShard / Switch), expert-parallel over
    ``mesh``'s ep axis.

    ``experts`` global experts of width ``d_hidden``; ``top_k`` choices per token (1: Switch, 2: GShard);
    capacity ``ceil(capacity_factor * k * S / E)`` per group of S tokens in training and with
    ``eval_capacity_factor`` in evaluation, none when ``dropless``; ``random_routing``: GShard's random
    second choice (k = 2, training only; needs the tokens' ``keys``); ``aux_loss_coef`` and
    ``z_loss_coef`` weight the load-balancing loss and the z-loss in :attr:`MoEOutput.loss`;
    ``bias_balancing``: DeepSeek-V3's auxiliary-loss-free selection bias (update it with
    :meth:`update_balance_bias`); ``seed`` salts the random-routing draws (give each layer its own);
    ``sequence_parallel``: under tp > 1 the layer's input and output hold this rank's ``1/tp`` of the
    positions (Korthikanti et al. 2022), see :meth:`forward`; ``kernel``: how the experts run on their
    rows (:mod:`podscale.parallel.moe.kernels`; None: the kernel for the input's device and dtype);
    ``recompute_activation``: keep only the experts' pre-activation for the backward and evaluate the GELU
    again there (one rows x hidden tensor less per layer; ignored when ``kernel`` is given);
    ``shared_hidden`` > 0: a shared expert of that width, a dense feed-forward every token passes through
    beside its routed experts, its output added to theirs (DeepSeekMoE's shared experts, Dai et al. 2024,
    section 3.2, which isolates common knowledge there so the routed experts can specialise; DeepSpeed-MoE's
    residual MoE, Rajbhandari et al. 2022, section 4.1.2; Megatron-core's
    ``moe_shared_expert_intermediate_size``).  Its parameters are dense (replicated over dp×ep, reduced
    there; with ``expert_tensor_parallel`` its width is split over tp as the routed experts' are, as
    Megatron-core's ``SharedExpertMLP`` is a tensor-parallel MLP); it runs on the same kernel as the experts,
    under expert parallelism while the token counts are in flight (Megatron-core's
    ``moe_shared_expert_overlap``).  ``fold_tp``: under tp > 1, shard the
    experts over ep x tp instead of holding the same ones on every tp rank (MoE parallel folding, see
    :meth:`forward`).  ``expert_tensor_parallel``: under tp > 1, split each expert's hidden width over tp
    instead (Megatron-core's expert tensor parallelism, :class:`WidthSplit`; ``d_hidden`` a multiple of tp;
    not with ``fold_tp``).  ``gating``: the score function, group limit and gate scale
    (:class:`~podscale.parallel.moe.gate.Gating`: GShard's softmax by default, DeepSeek-V3's sigmoid
    affinities with node-limited routing as an option).  ``aux_loss_scope``: where the load-balancing loss
    counts its first-choice shares ``f_e``: ``"group"`` (Switch, GShard: each group's own tokens) or
    ``"global"`` (Qiu et al. 2025, "Demons in the Detail"; Megatron-core's ``moe_router_load_balancing_type =
    "global_aux_loss"``; Qwen3-MoE): over every token of the micro-batch on every rank that routes other
    tokens of the layer (dp x ep, and tp), an all-reduce of E + 1 integers per forward, ``P_e`` staying this
    rank's own (:func:`~podscale.parallel.moe.gate.first_choice_counts`); on one process, the whole batch; or
    ``"global_step"`` (Qiu et al. 2025's buffer for gradient accumulation): the same counts of every training
    micro-batch of the step so far added up (:class:`~podscale.parallel.moe.gate.StepCounts`), so micro-batch m's
    ``f_e`` is that of micro-batches 1..m of every rank, and the last one's the whole step's global batch; the
    sum is cleared by :meth:`start_step` (the engine calls it at each step's start), a forward recomputed in the
    backward reuses its first forward's sum without adding or communicating again, and a forward without
    autograd or in eval mode (evaluation, sampling) neither reads nor adds to it: it takes its own
    micro-batch's global counts, as ``"global"``.  ``expert_dispatch``: under expert parallelism, ``"choice"``
    exchanges a row per kept (token, expert) choice and combines the outputs on the token's rank
    (:class:`ChoiceDispatch`), ``"rank"`` a row per (token, rank holding any of its choices), combined on that
    rank (DeepEP's dispatch and combine, :class:`RankDispatch`), ``"node"`` a row per (token, node holding any of
    its choices), forwarded per rank inside the node (:class:`NodeDispatch`, ``ranks_per_node`` global ranks a
    node); the same outputs every way.  ``drop_policy``:
    which choices keep an over-full expert's slots, GShard's ``"position"`` (first choices first, in token order),
    V-MoE's Batch Prioritized Routing ``"priority"`` (first choices first, the tokens by their top score) or
    Megatron-core's ``"probs"`` (each expert its highest-scoring choices):
    :data:`~podscale.parallel.moe.gate.DROP_POLICIES`.
    """

    def __init__(self, d_model: int, d_hidden: int, experts: int, top_k: int = 2, capacity_factor: float = 1.25,
                 eval_capacity_factor: float = 2.0, dropless: bool = False, random_routing: bool = False,
                 aux_loss_coef: float = 1e-2, z_loss_coef: float = 1e-3, bias_balancing: bool = False,
                 bias_update_rate: float = 1e-3, mesh=None, seed: int = 0, bias: bool = True,
                 sequence_parallel: bool = False, kernel: ExpertKernel | None = None,
                 recompute_activation: bool = False, shared_hidden: int = 0, fold_tp: bool = False,
                 expert_tensor_parallel: bool = False, gating: Gating = Gating(), aux_loss_scope: str = "group",
                 expert_dispatch: str = "choice", drop_policy: str = "position", ranks_per_node: int | None = None):
        super().__init__()
        self.tp = mesh.sizes["tp"] if mesh is not None else 1
        #: the mesh axes the experts are sharded over and the tokens exchanged over: ``("ep",)``, or with
        #: ``fold_tp`` under tp > 1 ``("ep", "tp")`` (MoE parallel folding)
        folded = fold_tp and self.tp > 1
        split = expert_tensor_parallel and self.tp > 1
        self.expert_axes = ("ep", "tp") if folded else ("ep",)
        check_moe_args(experts, top_k, capacity_factor, eval_capacity_factor,
                       mesh.sizes["ep"] if mesh is not None else 1, self.tp if folded else 1,
                       self.tp if split else 1, d_hidden)
        gating.check(experts, top_k)
        check_expert_dispatch(expert_dispatch, split)
        check_drop_policy(drop_policy)
        #: which choices keep an over-full expert's slots (:data:`~podscale.parallel.moe.gate.DROP_POLICIES`)
        self.drop_policy = drop_policy
        #: how the choices reach their experts under expert parallelism (``"choice"``, ``"rank"`` or ``"node"``,
        #: :data:`EXPERT_DISPATCHES`)
        self.expert_dispatch = expert_dispatch
        self.dispatch: ExpertDispatch = make_dispatch(expert_dispatch, mesh, self.expert_axes, ranks_per_node, top_k)
        #: how the router's logits become choices and gate values (softmax / sigmoid scores, group limit)
        self.gating = gating
        ep = mesh.size(*self.expert_axes) if mesh is not None else 1
        if shared_hidden < 0:
            raise ValueError(f"shared_hidden={shared_hidden} must be >= 0 (0: no shared expert)")
        #: ``ep``: the size of the expert-parallel group (ep, or ep x tp when folded)
        self.mesh, self.ep = mesh, ep
        self.sequence_parallel = sequence_parallel and self.tp > 1
        self.num_experts, self.top_k = experts, top_k
        self.capacity_factor, self.eval_capacity_factor, self.dropless = capacity_factor, eval_capacity_factor, dropless
        self.random_routing, self.seed = random_routing, seed
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        check_aux_loss_scope(aux_loss_scope)
        #: ``"group"``, ``"global"`` or ``"global_step"``: the tokens the load-balancing loss's ``f_e`` is
        #: counted over
        self.aux_loss_scope = aux_loss_scope
        #: the first-choice counts of this step's training micro-batches so far (``"global_step"``)
        self.step_counts = StepCounts()
        self.router = Router(d_model, experts, bias_balancing, bias_update_rate)
        if split and shared_hidden % self.tp:
            raise ValueError(f"shared_hidden={shared_hidden} is not divisible by tp={self.tp} (expert_tensor_parallel "
                             f"splits the shared expert's width over tp too): make it a multiple of {self.tp} or "
                             "set expert_tensor_parallel = false")
        ep_rank = mesh.local_rank(*self.expert_axes) if mesh is not None else 0
        width = WidthSplit(mesh) if split else None
        self.experts = Experts(d_model, d_hidden, experts, ep, ep_rank, bias, kernel, recompute_activation, width)
        #: the shared expert (None without one): dense over dp x ep, every token through it; with the experts'
        #: width split over tp, its width split too (Megatron-core's SharedExpertMLP: a tensor-parallel MLP)
        self.shared = Expert(d_model, shared_hidden, bias, routed=False, width=width) if shared_hidden else None
        if self.tp > 1:
            # each tp rank routes its own share of the samples (see forward): the router's gradient is
            # partial over tp and summed there, as a sequence-parallel layer norm's is, and so are the
            # experts' when every tp rank holds them; folded, each tp rank holds other experts, whose
            # gradients are whole (every token routed to them came through the exchange), so the norm sums
            # their squares over tp as a tp shard's; with the width split, likewise each tp rank's part of
            # an expert, routed or shared (every row of the tp group runs through it), but not b_proj,
            # which each tp rank adds to its own rows
            own = {id(p) for p in self.parameters()
                   if tags(p).tp_layout is not None or (folded and tags(p).expert_parallel)}
            for p in self.parameters():
                tag(p, **({"tensor_parallel": True} if id(p) in own else {"sequence_parallel": True}))

    # routing -----------------------------------------------------------------------------------------
    def capacity(self, group_size: int) -> int | None:
        """Slots per expert and group for the current mode (None when dropless)."""
        if self.dropless:
            return None
        cf = self.capacity_factor if self.training else self.eval_capacity_factor
        return expert_capacity(cf, self.top_k, group_size, self.num_experts)

    def _route(self, x: torch.Tensor, keys: torch.Tensor | None):
        S, d = x.shape[-2], x.shape[-1]
        flat = x.reshape(-1, d)
        G = flat.shape[0] // S if S else 0
        logits = self.router(flat).view(G, S, self.num_experts)
        uniform = None
        if self.random_routing and self.training and self.top_k == 2:
            if keys is None:
                raise ValueError("random routing needs the tokens' keys: pass keys= (sequence_token_keys(idx)) "
                                 "or build the layer with random_routing=False")
            uniform = routing_uniform(keys.reshape(G, S), self.seed)
        r, probs = route(logits, self.top_k, self.capacity(S), uniform, self.router.selection_bias, self.gating,
                         self.drop_policy)
        counts = self._balance_counts(r.expert[:, 0])
        return flat, r, load_balancing_loss(probs, r.expert[:, 0], counts), router_z_loss(logits)

    def _balance_counts(self, first_choice: torch.Tensor) -> torch.Tensor | None:
        """The first-choice counts the load-balancing loss takes every group's ``f_e`` from (None: each group its
        own, ``"group"``).

        The global scopes count over every rank that routes other tokens (collective: every rank of those groups,
        once per forward, whatever its routing; without a mesh, this process's whole batch); ``"global_step"``
        adds a training forward's counts to the step's, and a recomputed one takes its first forward's sum
        again (every rank recomputes the same forwards, so skipping the all-reduce there keeps them in step)."""
        if self.aux_loss_scope == "group":
            return None
        accumulate = self.aux_loss_scope == "global_step" and self.training and torch.is_grad_enabled()
        if accumulate and recomputing():
            return self.step_counts.replay()
        counts = first_choice_counts(first_choice, self.num_experts, self.mesh)
        return self.step_counts.add(counts) if accumulate else counts

    def start_step(self) -> None:
        """A new optimizer step begins: forget the previous step's first-choice counts (``"global_step"``)."""
        self.step_counts.reset()

    def _output(self, r: Routing, aux: torch.Tensor, z: torch.Tensor, rows: int) -> "MoEOutput":
        """The losses and statistics of a forward whose experts ran ``rows`` rows on this rank."""
        loss = self.aux_loss_coef * aux + self.z_loss_coef * z
        return MoEOutput(loss, aux, z, r, MoEStats.of(r, aux, z, rows))

    # the training path ---------------------------------------------------------------------------------
    # (never traced by torch.compile: its shapes follow the routing, its exchanges and statistics run from
    # Python; a compiled block runs it eagerly between its compiled pieces, see podscale.train.compile)
    @torch.compiler.disable
    def forward(self, x: torch.Tensor, keys: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEOutput]:
        """``x`` (..., S, d): groups of S tokens.  Returns the output (same shape; for a token none of whose
        choices was dispatched, zero, or the shared expert's output when the layer has one) and the
        :class:`MoEOutput`.

        Under tensor parallelism (the mesh's tp > 1) every tp rank holds the same tokens.  Rather than
        route them all and run every expert tp times, each tp rank takes ``1/tp`` of the samples (dim 0:
        whole groups, so every routing decision is the single-process one), routes them and exchanges them
        over its own ep group, and the outputs are all-gathered over tp
        (:class:`~podscale.parallel.tensor.SplitBatchToTP` / :class:`~podscale.parallel.tensor.GatherBatchFromTP`).
        Megatron-core's MoE likewise gives its token dispatcher ``S/tp * B`` tokens per rank, but gets them
        from sequence parallelism, which it requires with tp; here whole sequences are split, since a
        sequence is a routing group (its capacity), so routing stays the one-process routing.

        Folded (``fold_tp``; MoE parallel folding, Liu et al. 2025, which Megatron-core runs with
        ``expert_tensor_parallel_size = 1`` and torchtitan with an expert-parallel group that borrows the tp
        ranks): the expert-parallel group is ep x tp ranks, and rank ``(e, t)`` holds the experts
        ``[(e * tp + t) * E/(ep·tp), ...)``.  The tp ranks' tokens are different samples already, so they
        simply join the exchange as more ranks: each expert is held once per dp replica instead of tp
        times, its gradient is whole where it lives (no tp sum), and the exchange spans ep·tp ranks,
        the tp ones the nearest.  Unfolded, every tp rank holds the ep rank's E/ep experts and runs them
        on its own share of the samples.  With ``expert_tensor_parallel`` every tp rank holds ``1/tp`` of
        the hidden width of each of the ep rank's experts, and the rows each tp rank received from its ep
        exchange run on every tp rank's part of them (all-gathered over tp, the partial outputs summed back:
        :class:`WidthSplit`).

        With sequence parallelism every tp rank holds ``1/tp`` of the positions of every sample, (B, T/tp,
        d): one all-to-all over tp turns that into ``1/tp`` of the samples at every position, (B/tp, T, d)
        (:func:`_sequence_to_samples`), the layer runs on those whole sequences as above, and the inverse
        all-to-all returns the outputs to the sequence shards (same bytes as the all-gather of the
        non-sequence-parallel path, each rank sending ``(tp - 1)/tp`` of its shard).

        The aux and z losses are means over groups and tokens, so the layer's loss is the tp-mean of the
        ranks' (``ReduceFromTP``: all-reduce forward, identity backward), and the router's and experts'
        gradients, partial per tp rank, are summed over tp by the strategy (they carry the
        ``sequence_parallel`` marker).  ``MoEOutput.aux_loss``/``z_loss``/``stats`` are this rank's.

        With ``aux_loss_scope = "global"`` or ``"global_step"`` the routing of every forward (training, evaluation
        and sampling alike; not a ``"global_step"`` forward recomputed in the backward) adds, before the
        exchanges, one all-reduce of E + 1 integers over dp x ep and one over tp (Qiu et al.
        2025: the first-choice counts of the global batch, :func:`~podscale.parallel.moe.gate.first_choice_counts`),
        which every rank of those groups enters whatever its routing; ranks that route the same tokens (a
        sample every rank routes whole) add the same counts, which leaves the shares as they are."""
        if self.tp == 1:
            return self._forward_local(x, keys)
        if x.dim() < 3 or x.shape[0] % self.tp:
            if not torch.is_grad_enabled():
                # inference on fewer samples than tp ranks (sampling one sequence): every tp rank routes
                # all of them, the same way (its result is the split one's)
                if not self.sequence_parallel:
                    return self._forward_local(x, keys)
                y, out = self._forward_local(_gather_positions(x, self.mesh), keys)
                return y.chunk(self.tp, dim=1)[self.mesh.local_rank("tp")].contiguous(), out
            raise ValueError(f"an MoE layer under tensor parallelism splits the samples over tp={self.tp}: "
                             f"{x.shape[0] if x.dim() >= 3 else 1} samples do not divide; make train.micro_batch "
                             f"a multiple of parallel.tp")
        if self.sequence_parallel:
            mine = _sequence_to_samples(x, self.mesh)
        else:
            mine = SplitBatchToTP.apply(x, self.mesh)
        if keys is not None:
            keys = keys.chunk(self.tp, dim=0)[self.mesh.local_rank("tp")]
        y, out = self._forward_local(mine, keys)
        loss = ReduceFromTP.apply(out.loss / self.tp, self.mesh)
        y = _samples_to_sequence(y, self.mesh) if self.sequence_parallel else GatherBatchFromTP.apply(y, self.mesh)
        return y, MoEOutput(loss, out.aux_loss, out.z_loss, out.routing, out.stats)

    def _forward_local(self, x: torch.Tensor, keys: torch.Tensor | None) -> tuple[torch.Tensor, MoEOutput]:
        """The layer on this rank's tokens (the sort/index fast path; ep exchange inside)."""
        flat, r, aux, z = self._route(x, keys)
        inp = flat.to(expert_dtype(flat))                      # the router took the fp32 tokens
        if self.ep == 1:
            token = r.order // r.expert.shape[1]               # the kept choices' tokens, sorted by expert
            # index_select (not ``flat[token]``): its backward is an index_add, not a sorting index_put
            counts = r.counts.tolist()
            rows = self.experts.run_received(inp.index_select(0, token), [counts])
            y, rows_in = _combine(r, token, rows, self.shared_output(inp)), sum(counts)
        else:
            y, rows_in = self.dispatch(self, inp, r)
        return y.view(x.shape), self._output(r, aux, z, rows_in)

    def shared_output(self, inp: torch.Tensor) -> torch.Tensor | None:
        """The shared expert on every token of ``inp`` (None without one), on the experts' kernel (with
        expert tensor parallelism, split over tp as they are: :meth:`WidthSplit.run_dense`)."""
        if self.shared is None:
            return None
        e = self.experts
        kernel = pick_kernel(e.kernel, inp, e.d_model, self.shared.w_fc.shape[1], e.recompute_activation)
        return self.shared.run(inp, kernel)

    # the reference -------------------------------------------------------------------------------------
    def forward_reference(self, x: torch.Tensor, keys: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, MoEOutput]:
        """GShard's einsum form with dispatch and combine tensors of shape (G, S, E, C); dropless uses
        C = S (an expert can get every token of a group at most once).  One process only (ep = 1)."""
        if self.ep != 1 or self.experts.width is not None:
            raise ValueError("forward_reference holds every expert whole: build the layer without an ep axis "
                             "and without expert_tensor_parallel")
        flat, r, aux, z = self._route(x, keys)
        out = self._output(r, aux, z, int(r.counts.sum()))
        G, S, E, k = r.groups, r.group_size, self.num_experts, self.top_k
        C = r.capacity if r.capacity is not None else S
        xg = flat.view(G, S, -1)
        token = torch.arange(G * S, device=x.device).repeat_interleave(k)
        kept = r.keep.reshape(-1)
        g, s = (token // S)[kept], (token % S)[kept]
        e, c = r.expert.reshape(-1)[kept], r.position.reshape(-1)[kept]
        dispatch = torch.zeros(G, S, E, C, dtype=x.dtype, device=x.device)
        dispatch[g, s, e, c] = 1.0
        combine = torch.zeros(G, S, E, C, dtype=r.weight.dtype, device=x.device)
        combine = combine.index_put((g, s, e, c), r.weight.reshape(-1)[kept])
        expert_in = torch.einsum("gsec,gsm->egcm", dispatch, xg)                  # (E, G, C, d)
        expert_out = self.experts.forward_padded(expert_in.reshape(E, G * C, -1)).view(E, G, C, -1)
        y = torch.einsum("gsec,egcm->gsm", combine.to(expert_out.dtype), expert_out)
        if self.shared is not None:
            y = y + self.shared.reference(xg)
        return y.reshape(x.shape), out

    # auxiliary-loss-free balancing ---------------------------------------------------------------------
    def update_balance_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's bias step from this step's global per-expert counts (see Router.update_bias)."""
        if self.router.selection_bias is None:
            raise ValueError("the layer was built without bias_balancing")
        self.router.update_bias(load)


__all__ = ["MoELayer", "MoEOutput", "Experts", "ExpertDispatch", "ChoiceDispatch", "RankDispatch", "EXPERT_DISPATCHES",
           "check_expert_dispatch", "Expert", "WidthSplit", "WIDTH_LAYOUTS", "expert_parameters", "dense_parameters", "expert_dtype",
           "reduce_gradients", "grad_norm",
           "check_moe_args"]
