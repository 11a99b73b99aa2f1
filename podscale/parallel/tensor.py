"""Megatron tensor parallelism (Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al. 2022).

Tensor parallelism splits each transformer layer over the ``tp`` axis of the mesh (Shoeybi et al. 2019,
section 3, Figure 3):

* the MLP's first linear and attention's qkv projection are *column-parallel*: each rank holds a slice of
  the output features (for qkv: this rank's heads of q, then of k, then of v), so GELU and attention run on
  local data;
* the MLP's second linear and attention's output projection are *row-parallel*: each rank holds the input
  features matching its columns and produces a partial sum;
* two conjugate autograd operators join them: **f** is the identity forward and an all-reduce backward
  (before a column-parallel layer), **g** is an all-reduce forward and the identity backward (after a
  row-parallel layer).  One f and one g per attention and per MLP: 4 all-reduces per layer and step;
* the input embedding and the output layer are *vocab-parallel* (section 3, "input embedding"): each rank
  holds ``vocab / tp`` rows of the tied weight; the cross-entropy is computed from the local logits with
  three all-reduces of (batch x sequence) scalars (max, sum of exponentials, target logit), so the full
  ``batch x sequence x vocab`` logits never exist on one rank.

The all-reduce of f's backward (the input gradient of a column-parallel layer) is launched asynchronously
and the weight gradient is computed while it is in flight (as Megatron-LM's "async tensor-model-parallel
all-reduce").

Sequence parallelism (Korthikanti et al. 2022, section 4.2.2, Figure 5) additionally shards the regions
between the tensor-parallel blocks (layer norms, dropout, residual adds) along the sequence: **g** becomes an
all-gather along the sequence (backward: reduce-scatter) in front of the column-parallel layers and **ḡ** a
reduce-scatter (backward: all-gather) after the row-parallel ones.  Same bytes as the all-reduces, but
activations between blocks take ``1/tp`` of the memory.  Parameters used on a sequence shard (layer norms,
position embedding, row-parallel biases) get partial gradients, summed over ``tp`` by the strategy.

Dropout on activations split over tp (each rank's attention heads; with sequence parallelism also the
regions between blocks) draws from a per-rank stream of the model-parallel RNG tracker, dropout on
replicated activations from a generator shared by the tp group (:mod:`podscale.parallel.rng`).

``apply_tensor_parallel(model, mesh)`` shards a plain single-process GPT in place, so the same seed gives
the same model in every layout.  All communication goes through :mod:`podscale.runtime.comm` on axis "tp".
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from podscale.config import tensor_parallel_split_problem
from podscale.models.gpt import Block
from podscale.parallel.param_tags import tag, tags
from podscale.parallel.sharded_state import ShardedCheckpointState, persistent_buffers
from podscale.parallel.strategy import DataParallelStrategy, LocalMicroBatches, Strategy
from podscale.parallel.rng import ForkedDropout, RNGTracker, rng_tracker
from podscale.runtime import comm

# ------------------------------------------------------------------------------------------------------
# collectives along the sequence dimension (dim 1 of B x T x H); comm works on flat rank-major buffers,
# so the sequence is moved to the front for the collective and back afterwards


def _gather_seq(x: torch.Tensor, mesh) -> torch.Tensor:
    n = mesh.size("tp")
    if n == 1:
        return x
    xt = x.transpose(0, 1).contiguous()
    out = torch.empty((n * xt.shape[0],) + tuple(xt.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, xt, mesh, "tp")
    return out.transpose(0, 1)


def _reduce_scatter_seq(x: torch.Tensor, mesh, async_op: bool = False):
    n = mesh.size("tp")
    xt = x.transpose(0, 1).contiguous()
    out = torch.empty((xt.shape[0] // n,) + tuple(xt.shape[1:]), dtype=x.dtype, device=x.device)
    h = comm.reduce_scatter(out, xt, mesh, "tp", async_op=async_op)
    return (out.transpose(0, 1), h) if async_op else out.transpose(0, 1)


def _split_seq(x: torch.Tensor, mesh) -> torch.Tensor:
    n = mesh.size("tp")
    return x if n == 1 else x.chunk(n, dim=1)[mesh.local_rank("tp")].contiguous()


# ------------------------------------------------------------------------------------------------------
# the conjugate operators (Shoeybi et al. 2019, Figure 3; Korthikanti et al. 2022, Figure 5)


class CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient over tp backward."""

    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, ctx.mesh, "tp")
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce over tp forward, identity backward."""

    @staticmethod
    def forward(ctx, x, mesh):
        out = x.contiguous().clone()
        comm.all_reduce(out, mesh, "tp")
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromSP(torch.autograd.Function):
    """Sequence-parallel g: all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return _gather_seq(x, mesh)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.mesh), None


class ReduceScatterToSP(torch.autograd.Function):
    """Sequence-parallel ḡ: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return _reduce_scatter_seq(x, mesh)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.mesh), None


def _gather_batch(x: torch.Tensor, mesh) -> torch.Tensor:
    out = torch.empty((mesh.size("tp") * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x.contiguous(), mesh, "tp")  # rank-major along dim 0
    return out


def _split_batch(x: torch.Tensor, mesh) -> torch.Tensor:
    return x.chunk(mesh.size("tp"), dim=0)[mesh.local_rank("tp")].contiguous()


class SplitBatchToTP(torch.autograd.Function):
    """This rank's ``1/tp`` of the samples (dim 0) of an activation every tp rank holds whole; backward:
    all-gather of the gradient.  With :class:`GatherBatchFromTP` it brackets a region whose work is split
    by samples instead of by weights (the mixture-of-experts layer under tensor parallelism), as Megatron-
    core's MoE splits tokens over tp ranks before its dispatcher and gathers them after."""

    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return _split_batch(x, mesh)

    @staticmethod
    def backward(ctx, grad):
        return _gather_batch(grad, ctx.mesh), None


class GatherBatchFromTP(torch.autograd.Function):
    """All-gather over tp along the samples (dim 0); backward: this rank's part of the gradient (which
    every tp rank holds whole and identical, downstream of the gather)."""

    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return _gather_batch(x, mesh)

    @staticmethod
    def backward(ctx, grad):
        return _split_batch(grad, ctx.mesh), None


def _collective(fn: type[torch.autograd.Function], *args):
    """``fn.apply(*args)`` for the operators above that communicate, kept out of ``torch.compile``'s graphs:
    under ``train.compile`` (:mod:`podscale.train.compile`) a compiled block breaks its graph here, runs the
    collective eagerly through :mod:`podscale.runtime.comm` and compiles the pieces between collectives.  (An
    eager forward calls ``apply`` directly: the disabled wrapper costs a few microseconds a call.)"""
    if torch.compiler.is_compiling():
        return _outside_graph(fn, *args)
    return fn.apply(*args)


@torch.compiler.disable
def _outside_graph(fn: type[torch.autograd.Function], *args):
    return fn.apply(*args)


class _ColumnParallelLinearFn(torch.autograd.Function):
    """``f`` (or sequence-parallel ``g``) fused with the linear layer, so that backward overlaps the
    input gradient's all-reduce (reduce-scatter) with the weight gradient's matmul."""

    @staticmethod
    def forward(ctx, x, weight, bias, mesh, sequence_parallel):
        ctx.mesh, ctx.sp, ctx.has_bias = mesh, sequence_parallel, bias is not None
        ctx.save_for_backward(x, weight)  # with sequence parallelism: the shard, gathered again backward
        total = _gather_seq(x, mesh) if sequence_parallel else x
        return F.linear(total, weight.to(total.dtype) if total.dtype != weight.dtype else weight,
                        None if bias is None else bias.to(total.dtype))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        mesh, n = ctx.mesh, ctx.mesh.size("tp")
        total = _gather_seq(x, mesh) if ctx.sp else x
        grad_input = (grad @ weight.to(grad.dtype)).to(x.dtype)
        handle = None
        if n > 1:
            if ctx.sp:
                grad_input, handle = _reduce_scatter_seq(grad_input, mesh, async_op=True)
            else:
                handle = comm.all_reduce(grad_input, mesh, "tp", async_op=True)
        # weight gradient while the input gradient is on the wire
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_weight = (g2.t() @ total.reshape(-1, total.shape[-1]).to(g2.dtype)).to(weight.dtype)
        grad_bias = g2.sum(0).to(weight.dtype) if ctx.has_bias else None
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None


# ------------------------------------------------------------------------------------------------------
# layers


class ColumnParallelLinear(nn.Module):
    """Linear layer holding ``out_features / tp`` output features; the output stays sharded.

    Its input passes f (or sequence-parallel g).  ``overlap`` (default) fuses that operator with the
    layer so the input gradient's collective runs while the weight gradient is computed; without it the
    plain operator is applied and then the linear layer (same result, no overlap).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mesh, sequence_parallel: bool,
                 overlap: bool = True):
        super().__init__()
        self.mesh, self.sequence_parallel, self.overlap = mesh, sequence_parallel, overlap
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        tag(self.weight, tensor_parallel=True)
        self.bias = None if bias is None else tag(nn.Parameter(bias), tensor_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.overlap:
            return _collective(_ColumnParallelLinearFn, x, self.weight, self.bias, self.mesh, self.sequence_parallel)
        x = _collective(GatherFromSP, x, self.mesh) if self.sequence_parallel else _collective(CopyToTP, x, self.mesh)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Linear layer holding ``in_features / tp`` input features; its partial sums are reduced by g (or ḡ)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mesh, sequence_parallel: bool):
        super().__init__()
        self.mesh, self.sequence_parallel = mesh, sequence_parallel
        self.weight = tag(nn.Parameter(weight), tensor_parallel=True)
        self.bias = None if bias is None else tag(nn.Parameter(bias), sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = _collective(ReduceScatterToSP if self.sequence_parallel else ReduceFromTP, y, self.mesh)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding holding rows ``[start, start + rows)`` of the (padded) vocabulary; ids outside give zeros
    and the partial results are summed by g (or reduce-scattered along the sequence by ḡ)."""

    def __init__(self, weight: torch.Tensor, start: int, mesh, sequence_parallel: bool):
        super().__init__()
        self.mesh, self.sequence_parallel, self.start = mesh, sequence_parallel, start
        self.weight = tag(nn.Parameter(weight), tensor_parallel=True)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight) * (~outside).unsqueeze(-1)
        return ReduceScatterToSP.apply(out, self.mesh) if self.sequence_parallel \
            else ReduceFromTP.apply(out, self.mesh)


class SequenceParallelPositionEmbedding(nn.Embedding):
    """The (replicated) position embedding, looked up only for this rank's part of the sequence."""

    def __init__(self, weight: torch.Tensor, mesh):
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight)
        self.mesh = mesh
        tag(self.weight, sequence_parallel=True)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return super().forward(pos.chunk(self.mesh.size("tp"))[self.mesh.local_rank("tp")])


class _VocabParallelCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, mesh, start, vocab_size):
        ctx.dtype = logits.dtype
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # 16-bit up to fp32; fp64 kept
        targets = targets.reshape(-1)
        rows = logits.shape[1]
        pad = start + rows - vocab_size  # padded columns of the last shard take no probability
        if pad > 0:
            logits = logits.clone()
            logits[:, rows - pad:] = float("-inf")
        m = logits.max(dim=1).values
        comm.all_reduce(m, mesh, "tp", op=dist.ReduceOp.MAX)
        shifted = logits - m.unsqueeze(1)
        local = targets - start
        mine = (local >= 0) & (local < rows)
        local = local.masked_fill(~mine, 0)
        target_logit = shifted.gather(1, local.unsqueeze(1)).squeeze(1) * mine
        exp = shifted.exp()
        sum_exp = exp.sum(dim=1)
        both = torch.stack([target_logit, sum_exp])  # one all-reduce for both
        comm.all_reduce(both, mesh, "tp")
        target_logit, sum_exp = both[0], both[1]
        loss = torch.log(sum_exp) - target_logit
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(1)), local, mine)
        return loss.mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        g = softmax
        g[torch.arange(g.shape[0], device=g.device), local] -= mine.to(g.dtype)
        g.mul_(grad / g.shape[0])
        return g.to(ctx.dtype), None, None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """Mean cross-entropy from vocab-sharded logits (B, T, V / tp) without gathering them."""

    def __init__(self, mesh, start: int, vocab_size: int):
        super().__init__()
        self.mesh, self.start, self.vocab_size = mesh, start, vocab_size

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        return _VocabParallelCrossEntropyFn.apply(flat, targets, self.mesh, self.start, self.vocab_size)


def gather_vocab_logits(local: torch.Tensor, mesh, vocab_size: int) -> torch.Tensor:
    """The full (B, vocab) logits on every tp rank from each rank's vocab shard (B, padded vocab / tp): an
    all-gather of one position's logits, for sampling (training never gathers them)."""
    n = mesh.size("tp")
    if n == 1:
        return local[:, :vocab_size]
    parts = torch.empty((n * local.shape[0],) + tuple(local.shape[1:]), dtype=local.dtype, device=local.device)
    comm.all_gather(parts, local.contiguous(), mesh, "tp")
    return torch.cat(list(parts.view((n,) + tuple(local.shape))), dim=-1)[:, :vocab_size]


def pad_to_shards(idx: torch.Tensor, mesh, sequence_parallel: bool) -> torch.Tensor:
    """``idx`` (B, T) padded on the right to a multiple of tp, which sequence parallelism needs; a causal
    model's logits at positions < T do not depend on the padding."""
    n = mesh.size("tp")
    pad = -idx.shape[1] % n if sequence_parallel else 0
    return F.pad(idx, (0, pad)) if pad else idx


# ------------------------------------------------------------------------------------------------------
# applying it to the GPT


class TensorParallelError(ValueError):
    """A model that cannot be split over this tp size; the message names the fix."""


def check_tensor_parallel(n_embd: int, n_head: int, tp: int) -> None:
    """Raise :class:`TensorParallelError` when the GPT cannot be split over ``tp`` ranks (the rule the config
    check applies too: :func:`podscale.config.tensor_parallel_split_problem`)."""
    problem = tensor_parallel_split_problem(n_head, n_embd, tp)
    if problem:
        raise TensorParallelError(problem)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp (Megatron pads it likewise; padded ids never occur
    and the cross-entropy gives their logits no probability)."""
    return -(-vocab_size // tp) * tp


def shard(full: torch.Tensor, layout: str, mesh, vocab: int | None = None) -> torch.Tensor:
    """This tp rank's shard of the single-process tensor ``full`` (a copy).

    ``rows``: output features (column-parallel); ``cols``: input features (row-parallel); ``qkv``: this
    rank's rows of each of q, k and v, in that order; ``vocab``: rows of the vocabulary padded to tp.
    """
    n, r = mesh.size("tp"), mesh.local_rank("tp")
    full = full.detach()
    if layout == "qkv":
        return torch.cat([t.chunk(n, dim=0)[r] for t in full.chunk(3, dim=0)]).clone()
    if layout == "cols":
        return full.chunk(n, dim=1)[r].clone()
    if layout == "vocab":
        vp = padded_vocab(vocab, n)
        if vp > full.shape[0]:
            full = torch.cat([full, full.new_zeros((vp - full.shape[0],) + tuple(full.shape[1:]))])
    return full.chunk(n, dim=0)[r].clone()


def unshard(local: torch.Tensor, layout, mesh) -> torch.Tensor:
    """The single-process tensor from every tp rank's ``local`` shard (an all-gather over tp)."""
    n = mesh.size("tp")
    kind, vocab = (layout, None) if isinstance(layout, str) else layout
    parts = torch.empty((n * local.shape[0],) + tuple(local.shape[1:]), dtype=local.dtype, device=local.device)
    comm.all_gather(parts, local.contiguous(), mesh, "tp")
    parts = parts.view((n,) + tuple(local.shape))
    if kind == "qkv":
        return torch.cat([torch.cat([p.chunk(3, dim=0)[i] for p in parts]) for i in range(3)])
    if kind == "cols":
        return torch.cat(list(parts), dim=1)
    full = torch.cat(list(parts), dim=0)
    return full[:vocab] if kind == "vocab" else full


def _layout(layer: nn.Module, kind: str) -> None:
    tag(layer.weight, tp_layout=kind)
    if layer.bias is not None and kind != "cols":
        tag(layer.bias, tp_layout=kind)


def apply_tensor_parallel(model: nn.Module, mesh, sequence_parallel: bool = False) -> nn.Module:
    """Shard a single-process :class:`~podscale.models.gpt.GPT` over ``mesh``'s tp axis, in place.

    Works on a whole GPT or a pipeline stage of one (missing ``wte`` / ``lm_head`` are skipped).  With
    tp == 1 and no sequence parallelism the model is returned unchanged.
    """
    n, r = mesh.size("tp"), mesh.local_rank("tp")
    if n == 1 and not sequence_parallel:
        return model
    cfg = model.cfg
    check_tensor_parallel(cfg.n_embd, cfg.n_head, n)
    sp = sequence_parallel

    def full(name: str, p: torch.Tensor | None) -> torch.Tensor | None:
        """The single-process value of parameter ``name``: ``p`` itself, or, for a model built on the meta
        device, its initial value made for this one parameter (so no rank ever holds the whole model)."""
        if p is None or not p.is_meta:
            return p
        t = torch.empty(p.shape, dtype=p.dtype, device=mesh.device)
        model.init_parameter(name, t)
        return t

    with torch.no_grad():
        for key, block in model.blocks.items():
            a = block.attn
            pre = f"blocks.{key}."
            # qkv rows are [q; k; v]: this rank takes its heads of each, in that order
            qkv_bias = full(pre + "attn.qkv.bias", a.qkv.bias)
            a.qkv = ColumnParallelLinear(shard(full(pre + "attn.qkv.weight", a.qkv.weight), "qkv", mesh),
                                         None if qkv_bias is None else shard(qkv_bias, "qkv", mesh), mesh, sp)
            _layout(a.qkv, "qkv")
            proj_bias = full(pre + "attn.proj.bias", a.proj.bias)
            a.proj = RowParallelLinear(shard(full(pre + "attn.proj.weight", a.proj.weight), "cols", mesh),
                                       None if proj_bias is None else proj_bias.clone(), mesh, sp)
            _layout(a.proj, "cols")
            if sp:
                for ln in (block.ln_1, block.ln_2):
                    for p in ln.parameters():
                        tag(p, sequence_parallel=True)
            if not isinstance(block, Block):
                # a mixture-of-experts block: its layer, built with the mesh (and told of sequence
                # parallelism), splits its tokens over tp itself (podscale.parallel.moe.layer); its router
                # and experts stay whole on every tp rank
                continue
            m = block.mlp
            fc_bias = full(pre + "mlp.fc.bias", m.fc.bias)
            m.fc = ColumnParallelLinear(shard(full(pre + "mlp.fc.weight", m.fc.weight), "rows", mesh),
                                        None if fc_bias is None else shard(fc_bias, "rows", mesh), mesh, sp)
            _layout(m.fc, "rows")
            proj_bias = full(pre + "mlp.proj.bias", m.proj.bias)
            m.proj = RowParallelLinear(shard(full(pre + "mlp.proj.weight", m.proj.weight), "cols", mesh),
                                       None if proj_bias is None else proj_bias.clone(), mesh, sp)
            _layout(m.proj, "cols")
        vocab = cfg.vocab_size
        vp = padded_vocab(vocab, n)
        start = r * (vp // n)
        emb = None
        if model.wte is not None:
            model.wte = VocabParallelEmbedding(shard(full("wte.weight", model.wte.weight), "vocab", mesh, vocab),
                                               start, mesh, sp)
            emb = model.wte.weight
            tag(emb, tp_layout=("vocab", vocab))
            if sp:
                model.wpe = SequenceParallelPositionEmbedding(full("wpe.weight", model.wpe.weight).detach().clone(),
                                                              mesh)
        if model.lm_head is not None:
            if emb is None:  # a last pipeline stage without the input embedding holds its own copy
                dup = tags(model.lm_head.weight).pipeline_duplicate
                emb = nn.Parameter(shard(full("lm_head.weight", model.lm_head.weight), "vocab", mesh, vocab))
                tag(emb, tp_layout=("vocab", vocab), pipeline_duplicate=dup)
            model.lm_head = ColumnParallelLinear(emb, None, mesh, sp)
            model.loss_fn = VocabParallelCrossEntropy(mesh, start, vocab)
            if sp:
                for p in model.ln_f.parameters():
                    tag(p, sequence_parallel=True)
        # dropout: this rank's heads draw from its own stream; with sequence parallelism so do the regions
        # between the blocks, which then hold this rank's part of the sequence (podscale.parallel.rng)
        tracker = rng_tracker(mesh)
        for block in model.blocks.values():
            block.attn.heads_rng = tracker.fork
            if sp:
                block.attn.resid_drop = ForkedDropout(block.attn.resid_drop.p, tracker)
            if sp and isinstance(block, Block):
                block.mlp.drop = ForkedDropout(block.mlp.drop.p, tracker)
        if sp and model.drop is not None:
            model.drop = ForkedDropout(model.drop.p, tracker)
    return model


def tensor_parallel_rng(mesh, sequence_parallel: bool) -> RNGTracker | None:
    """The RNG tracker whose streams the dropout of a model sharded by :func:`apply_tensor_parallel` draws
    from (for :func:`apply_recompute`); None where that leaves the model unchanged (tp = 1 without sequence
    parallelism)."""
    return rng_tracker(mesh) if mesh.size("tp") > 1 or sequence_parallel else None


def apply_recompute(model: nn.Module, mode: str, tracker: RNGTracker | None = None) -> nn.Module:
    """Activation recomputation (Korthikanti et al. 2022, section 5): ``full`` keeps only each block's
    input and recomputes the block in backward; ``selective`` recomputes only the attention core
    (softmax(QK^T)V, large and cheap to recompute).  Parameters and their names are unchanged.

    ``tracker``: the model-parallel RNG tracker the model's dropout draws from under tensor or sequence
    parallelism (:func:`~podscale.parallel.rng.rng_tracker` of the mesh; None without them): its streams
    are replayed at the recomputation as they were at the forward (torch restores the default one)."""
    from torch.utils.checkpoint import checkpoint

    if mode == "none":
        return model
    if mode not in ("selective", "full"):
        raise ValueError(f"unknown recompute mode '{mode}': use none, selective or full")

    def rng_context():
        return tracker.recompute_context() if tracker is not None else (nullcontext(), nullcontext())

    def recomputed(fn):
        return lambda *args: checkpoint(fn, *args, use_reentrant=False, context_fn=rng_context)

    for block in model.blocks.values():
        if mode == "full":
            block.forward = recomputed(block.forward)
        else:
            block.attn.core = recomputed(block.attn.core)
    return model


# ------------------------------------------------------------------------------------------------------
# gradient bookkeeping shared by the model-parallel strategies


def sync_sequence_parallel_grads(params, mesh) -> None:
    """Sum over tp the gradients of parameters used on a sequence shard (layer norms, position embedding,
    row-parallel biases), so every tp rank holds the full gradient (Korthikanti et al. 2022, 4.2.2); also
    those used on a share of the samples (a mixture-of-experts layer's router and experts under tp, which
    carry the same ``sequence_parallel`` marker)."""
    if mesh.size("tp") == 1:
        return
    grads = [p.grad for p in params if tags(p).sequence_parallel and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, mesh, "tp")
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


NORM_ROW = 4096      # elements per fp32 partial norm in :func:`sum_of_squares`


def sum_of_squares(g: torch.Tensor) -> torch.Tensor:
    """The fp64 sum of squares of ``g``, without an fp64 copy of it. An fp32 gradient is cut into rows of
    NORM_ROW elements whose norms are taken in fp32 (relative error ~1e-7, the size of the fp32 result's
    own rounding) and summed in fp64; a 16-bit one goes through one fp32 copy. ``g.double().pow(2).sum()``
    allocated two fp64 copies of every gradient every step, whose first-touch page faults cost a CPU more
    than the step's attention (BENCHMARKS.md, the planner against local runs); ``vector_norm(g,
    dtype=float64)`` still casts a whole copy."""
    if g.dtype == torch.float64:
        return torch.linalg.vector_norm(g).square()
    # the sum does not depend on the order: read a transposed gradient (autograd's weight gradient of
    # a linear layer) through its contiguous transpose
    flat = (g.t() if g.dim() == 2 and not g.is_contiguous() and g.t().is_contiguous() else g).reshape(-1)
    whole = flat.numel() - flat.numel() % NORM_ROW
    total = torch.zeros((), dtype=torch.float64, device=g.device)
    if whole:
        total += torch.linalg.vector_norm(flat[:whole].view(-1, NORM_ROW).float(), dim=1).double().square().sum()
    if whole < flat.numel():
        total += torch.linalg.vector_norm(flat[whole:].float()).double().square()
    return total


def global_grad_norm(pieces, mesh, dp_sharded: bool = False) -> torch.Tensor:
    """The L2 norm of the gradient of the whole (unsharded, single-copy) model.

    ``pieces`` are (parameter, gradient part held here).  tp-sharded parameters contribute their squared
    norm summed over tp, tp-replicated ones once; over pp every stage's contribution is summed, except
    parameters marked ``pipeline_duplicate`` (the last stage's copy of the tied embedding), which the first
    stage counts; with ZeRO (``dp_sharded``) the disjoint slices are summed over the data ranks (dp x ep)
    too.  Parameters marked ``expert_parallel`` (a mixture-of-experts layer's experts, each ep rank holding
    others) are summed over ep, and over tp too when they are also marked ``tensor_parallel`` (experts
    folded over ep x tp, each tp rank holding others; otherwise every tp rank holds the same ones).
    """
    dev = mesh.device
    # squares summed in fp64 (three scalars), returned in fp32 unless a gradient is fp64: an fp64 model's
    # clipping coefficient is then the one-process run's to fp64 precision
    # [tp-sharded, tp-replicated, experts (tp-replicated), experts folded over tp (a tp rank's own)]
    sq = torch.zeros(4, dtype=torch.float64, device=dev)
    out_dtype = torch.float32
    seen = set()
    for p, g in pieces:
        t = tags(p)
        if g is None or t.pipeline_duplicate or (not dp_sharded and id(p) in seen):
            continue
        seen.add(id(p))
        kind = (3 if t.tensor_parallel else 2) if t.expert_parallel else 0 if t.tensor_parallel else 1
        sq[kind] += sum_of_squares(g).to(dev)
        if g.dtype == torch.float64:
            out_dtype = torch.float64
    if dp_sharded:
        # ZeRO: dense slices are disjoint over the data ranks (dp x ep), experts' over dp and each ep rank
        # holds other experts, so every square is summed over dp x ep once
        comm.all_reduce(sq, mesh, ("dp", "ep"))
    elif mesh.size("ep") > 1:
        # replicas of dense parameters count once; each ep rank holds other experts (expert parallelism)
        experts = sq[2:].clone()
        comm.all_reduce(experts, mesh, "ep")
        sq[2:] = experts
    sharded = sq[0::3].clone()           # what each tp rank holds its own of: tp shards, folded experts
    comm.all_reduce(sharded, mesh, "tp")
    total = (sharded.sum() + sq[1] + sq[2]).reshape(1)
    comm.all_reduce(total, mesh, "pp")
    return total.sqrt()[0].to(out_dtype)


# ------------------------------------------------------------------------------------------------------
# the strategy around a data-parallel one


class WrapsDataParallel(Strategy):
    """A model-parallel strategy wrapped around a data-parallel one (``self.inner``: replicated or ZeRO).
    What the wrapper adds nothing to is the inner strategy's, each method delegated by name."""

    inner: DataParallelStrategy

    def no_sync(self):
        return self.inner.no_sync()

    def grads(self) -> list[torch.Tensor]:
        return self.inner.grads()

    def scale_grads(self, coef) -> None:
        self.inner.scale_grads(coef)

    def found_inf(self) -> torch.Tensor:
        return self.inner.found_inf()

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def step(self, lr: float) -> None:
        self.inner.step(lr)

    def close(self) -> None:
        self.inner.close()

    def grad_norm(self) -> torch.Tensor:
        """The model's true global norm: the pieces the inner strategy holds, summed over tp and pp."""
        pieces, dp_sharded = self.inner.grad_pieces(self.params)
        return global_grad_norm(pieces, self.mesh, dp_sharded) * abs(self.inner.pending_grad_scale())


class TensorParallelStrategy(LocalMicroBatches, ShardedCheckpointState, WrapsDataParallel):
    """Wraps a data-parallel strategy (replicated :class:`DataParallel` or ZeRO over dp) for a model with
    tensor- and/or sequence-parallel layers: sequence-parallel gradients are summed over tp and the
    gradient norm is the model's true global norm.  ``sequence_parallel``: ``module`` was sharded with it
    (:func:`apply_tensor_parallel`), so its inputs are padded to a multiple of tp."""

    def __init__(self, inner, module: nn.Module, mesh, precision: str = "fp32", sequence_parallel: bool = False):
        self.inner, self.module, self.mesh, self.precision = inner, module, mesh, precision
        self.sequence_parallel = sequence_parallel
        self.params = [p for p in module.parameters() if p.requires_grad]
        # Sums over tp commute with the replicated strategy's dp all-reduce (a mean), so its all-reduce
        # overlaps backward and the tp sums follow.  A sharding strategy (ZeRO) needs the full sums before
        # its reduce-scatter: it adds them itself, unit by unit, inside backward.
        self.reduce_first = inner.reduce_commutes
        if not self.reduce_first and not inner.sums_sequence_parallel:
            raise TypeError(f"{type(inner).__name__} neither commutes with the tp sums nor sums the "
                            "sequence-parallel gradients itself")

    def named_parameters(self, remove_duplicate: bool = True):
        return self.module.named_parameters(remove_duplicate=remove_duplicate)

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return persistent_buffers(self.module)

    def finish_grad_sync(self) -> None:
        self.inner.finish_grad_sync()
        if self.reduce_first:
            sync_sequence_parallel_grads(self.params, self.mesh)

    @torch.no_grad()
    def next_logits(self, idx: torch.Tensor) -> torch.Tensor:
        """The (B, vocab) logits of the last position of ``idx`` on every rank (vocab shards gathered)."""
        T = idx.shape[1]
        logits, _ = self.module(pad_to_shards(idx.to(self.mesh.device), self.mesh, self.sequence_parallel))
        return gather_vocab_logits(logits[:, T - 1, :], self.mesh, self.module.cfg.vocab_size)
