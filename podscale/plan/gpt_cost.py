"""Step time and memory of a (dense or MoE) GPT under a tp x pp x dp x ep layout.

The step of one pipeline rank is built from per-micro-batch pieces (Narayanan et al. SC'21, Sec. 2-3):

    T_r    = forward + backward (+ recompute) of rank r's layers, tensor-parallel collectives, MoE
             all-to-alls, pipeline sends, and the output layer on the last rank
    step   = m * max_r T_r + (sum_r T_r - max_r T_r) / v     (the slowest rank sets the pace; with equal
             T_r the bubble (p-1)/(v m) of 1F1B / interleaved / GPipe)
           + exposed data-parallel gradient reduction + optimizer step + gradient passes (global norm,
             clipping, zeroing) + offload traffic

A collective overlapped with compute is exposed by what the compute does not cover, and at least by the
device's measured ``overlap_exposed`` fraction of its own time (0 on GPUs; on a CPU the collective's work
takes the cores the compute uses). On a CPU system (``device_is_host``) "offload to the CPU" moves nothing:
the step runs as without offload plus podscale's copy of the updated partition into the compute buffers.

MoE layers are priced as podscale's MoELayer runs them (podscale/parallel/moe/layer.py), by default with whole
experts (``expert_tensor_parallel`` below prices Megatron's split ones): under tp each tp rank routes 1/tp of
the micro-batch's samples (whole sequences), exchanges them over its own ep group and runs them through whole
experts (width ffn), so a rank holds experts / ep whole experts and the whole router, their gradients partial
per tp rank and summed over tp each time they are reduced; the outputs are all-gathered over tp (with
sequence parallelism, one all-to-all over tp in and one out). The attention of an MoE block is tensor-parallel as a dense block's.

With ``fold_tp_into_ep`` (MoE parallel folding: Liu et al. 2025, "MoE Parallel Folding"; Megatron-core's
expert_tensor_parallel_size = 1 with the expert-parallel group spanning the tp ranks; torchtitan's ETP = 1)
the experts are not replicated over tp but sharded over ep x tp (``Layout.expert_group``): a rank holds
experts / (ep tp) whole experts, complete on their one holder (no gradient sum over tp; the router and the
shared experts, still on every tp rank, keep theirs), and the tokens are exchanged over those ep x tp
ranks. Each tp rank still routes its own 1/tp of the samples, and the tp all-gather (or all-to-alls) of
the outputs is unchanged; a rank runs the same expert rows as unfolded, on fewer experts with longer
segments.

With ``expert_tensor_parallel`` (expert tensor parallelism: Megatron-core's ``expert_tensor_parallel_size`` = tp
with its alltoall token dispatcher; the experts' MLPs split as Shoeybi et al. 2019 split a dense one) the
experts are sharded over ep as unfolded, but each tp rank holds 1/tp of every one of its E/ep experts' hidden
width (``w_fc`` columns, ``b_fc``, ``w_proj`` rows; ``b_proj`` whole, its gradient summed over tp). Each tp rank
routes its 1/tp of the samples and exchanges them over ep as unfolded; the tp ranks' received rows are then
all-gathered over tp, every tp rank runs all of them through its width slice, and the partial outputs are
reduce-scattered back over tp to their owners (the backward: an all-gather of the output gradients, a
reduce-scatter of the input gradients). A rank's expert work is all tp ranks' rows at width ffn / tp (the
FLOPs of the unsplit layout, on longer segments of narrower experts), its expert parameters, gradients and
optimizer states 1/tp of the unsplit ones, its own rows never overlap the exchange, and the sliced
parameters' gradients are whole on their holder (no tp sum). The shared experts are split the same way
(Megatron-core's SharedExpertMLP is a tensor-parallel MLP): 1/tp of their width on every tp rank, run on every
tp rank's tokens, which are all-gathered over tp before them and their partial outputs reduce-scattered
after, in each pass (``width_split_rows_time``, the experts' formula), only their ``b_proj`` summed over tp.

Beyond its GEMMs and exchanges an MoE layer pays, on every system: its routing, dispatch and combine
(``moe_routing_bytes``: the gate's softmax, top-k passes, sort and slot counting, the aux and z losses, the
gather of the kept choices' rows and their scaled index_add back, forward and backward), memory-bound passes
priced at the rate ``plan calibrate`` measures for those very kernels (``compute.routing_time``; on a CPU
they run far below the element-wise rate), else at the memory bandwidth; the count exchange that precedes
the token exchange (an all-to-all of E integers, exposed but for the shared experts it runs under, so its
latency), and with the global-batch load-balancing loss (``aux_loss_scope`` ``"global"`` or ``"global_step"``,
Qiu et al. 2025) the
all-reduce of E + 1 first-choice counts over dp x ep and tp beside it (``global_balance_time``); under tp the
all-reduce of its aux and z loss over tp; and its token all-to-alls overlapped with
its own rows' expert work as every overlapped collective is (``compute.overlapped_exposed``: at least the
measured fraction a CPU's cores do not hide).

With ``expert_dispatch = "rank"`` (DeepEP's dispatch and combine: DeepSeek-AI 2025, github.com/deepseek-ai/DeepEP,
as DeepSeek-V3 trains, Sec. 3.2.2 "Efficient Implementation of Cross-Node All-to-All Communication") a token
travels once to each expert-group rank that holds at least one of its kept choices, that rank sums its chosen
local experts' gated outputs, and one row per (token, rank) comes back: the token exchanges carry D rows a
token instead of top_k (``expected_ranks_per_token``), with the forward's metadata and the backward's
gate-value gradients of every kept choice in the same all-to-alls as the rows (``DISPATCH_METADATA_BYTES``,
``GATE_GRAD_BYTES``: bandwidth, no latency) and a larger count exchange (n x (E/n + 1) int64: 8 (E + n) bytes a rank); a rank's own
choices run while the token exchanges are in flight under the same rule as ``"choice"``'s own rows (the
metadata all-to-alls are priced exposed). The experts run the same rows,
and the weighted sum moves from the token's rank to the expert's: compute, memory and routing bytes are
priced as ``"choice"``'s.

With ``expert_dispatch = "node"`` (DeepEP's internode dispatch and combine: RDMA to the GPU of the same index on each
node, then NVLink forwarding; DeepSeek-V3, Sec. 3.2.2) an expert group spanning N nodes exchanges in two stages: a
token crosses the network once to each node of its kept choices (D_node rows a token, ``expected_ranks_per_token``
over the nodes, its metadata 24 bytes a choice: ``NODE_METADATA_BYTES``), exposed, and the receiving peer dispatches
it per rank inside its node as ``"rank"`` does over the node's ranks (``_node_exchanges``). Within one node it is
``"rank"``. Each dispatch's exchanges are priced by one small function (``_DISPATCH_PRICES``: ``TokenExchanges``).

Ranks hold the layers the trainer gives them (``stages.py``: its parameter-balanced split, or the layout's
``pipeline_layers``), so pipelines need not divide the layers.

FLOPs per layer and micro-batch of b sequences (forward; backward = 2 x forward):
    24 b s h^2 (ffn = 4h, dense) + 4 b s^2 h (attention scores and values)
and the vocabulary projection 2 b s h V on the last stage; with full recompute one more forward,
which yields Narayanan's 96 B s l h^2 (1 + s/6h + V/16lh) per iteration.

Memory-bound work per layer, forward, in bytes (fp16 activations), counted kernel by kernel as
Megatron-LM runs them (read inputs + write outputs):
    2 layer norms (4 sbh each) + 2 fused bias-dropout-add (7 sbh each)  = 22 sbh  (replicated over tp
                                                                                   without seq. par.)
    bias + GeLU (4 sb ffn), layout copies of Q/K/V/context (8 sbh)      / t
    fused scale-mask-softmax (4 a s^2 b) + attention dropout (5 a s^2 b) / t
backward moves about twice the forward bytes. These counts are fixed, not fitted. Each linear layer's
backward is costed as its two GEMMs with their own shapes (input and weight gradients), and on
devices that run kernels synchronously (CPUs) every kernel also pays a measured host overhead.

On a calibrated CPU (``plan calibrate``) three of these are measured on the kernels themselves rather than
derived: the fused attention kernel's forward and backward by shape (``compute.attention_time``; a CPU's
flash-attention loop runs far below its GEMM rate), the element-wise rate (a GPT layer's element-wise
kernels forward and backward, priced in ``layer_elementwise_bytes``, at several activation sizes:
``compute.elementwise_time`` reads it at the layer's own), and the host cost per kernel (the same layer at a
size where its kernels do no work); each weight gradient is read from the GEMM table at the shape autograd
issues (``compute.weight_grad_time``), and ZeRO's reduce-scatter and all-gather at their own measured
bandwidth (``network``). A layout with ``grad_accumulation_fusion`` off
(podscale's trainer: ``auto.as_trained``) also pays its strategy's passes to accumulate and scale the
gradients (``gradient_bookkeeping_bytes``).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import network as net
from .compute import (attention_time, elementwise_time, gemm_rate as _gemm_rate, gemm_time, grad_pass_time, linear_time,
                      optimizer_time, overlapped_exposed, routing_time, stream_time, weight_grad_time)
from .hardware import System
from .layout import Layout, LayoutError
from .memory import (activation_bytes_per_layer, pipeline_inflight_layers, precision_of, zero3_gathered_bytes,
                     zero_model_state_bytes)
from .models import GPT
from .prediction import Prediction
from .stages import pipeline_chunks, pipeline_message_time, pipeline_rank_layers
from podscale.parallel.moe.gate import DROP_POLICIES
from podscale.parallel.moe.layer import overlaps_exchange

ADAM_BYTES_PER_PARAM = 30      # fp32 master r/w, m r/w, v r/w, grad read, fp16 param write
CROSS_ENTROPY_BYTES = 36       # per logit, fwd + bwd: fp16 -> fp32 cast, max, exp, sum, grad
BWD_OVER_FWD = 2.0             # backward of attention and element-wise work: ~2x the forward
FUSED_ATTN_BWD_OVER_FWD = 2.5  # FlashAttention-2 backward: 5 GEMMs for the forward's 2 (Dao 2023, Sec. 3.1.2)
# Per-step passes over the gradients this rank holds: replicated (DataParallel) the global norm reads them
# (4 bytes per parameter), clipping scales them in place (read + write, 8) and zero_grad writes them (4);
# ZeRO folds the clipping coefficient into its fused step, leaving the norm and the zeroing.
GRAD_PASS_BYTES_REPLICATED = 16
GRAD_PASS_BYTES_ZERO = 8
# Without accumulation fusion (podscale's trainer: autograd's AccumulateGrad), each micro-batch's gradient
# is added into the buffer the strategy keeps (read both, write: 12 bytes per parameter), and the mean over
# the data-parallel ranks is taken in place before the reduction (read + write: 8); ZeRO-2/3 instead copy
# each gradient, scaled, into the reduce-scatter's staging buffer (8).
GRAD_ACCUMULATE_BYTES = 12
GRAD_SCALE_BYTES = 8
# Per-rank dispatch's bytes per kept (token, expert) choice beside the rows in each pass (after DeepEP's
# dispatch/combine, DeepSeek-AI 2025, github.com/deepseek-ai/DeepEP): the forward's metadata, the choice's row
# index and gate value as two float64; the backward's gate-value gradient, in the fp32 router's precision.
DISPATCH_METADATA_BYTES = 16
GATE_GRAD_BYTES = 4
# Per-node dispatch's first stage (DeepEP's internode dispatch/combine; DeepSeek-V3, Sec. 3.2.2), bytes per kept
# choice sent between nodes beside the rows: the forward's row index, global expert id and gate value as three
# float64, and the backward's metadata with the gate-value gradient back, the same 24 bytes.
NODE_METADATA_BYTES = 24
NODE_METADATA_GRAD_BYTES = 24
KERNELS_PER_LAYER = 20         # forward kernels of one layer (2 norms, 4 linears + biases, attention
                               # core, GeLU, dropouts, residual adds); host overhead counts on CPUs only


def check_gpt_layout(system: System, devices: int, model: GPT, layout: Layout, batch: int) -> int:
    """Validate the layout against model and system; return the number of micro-batches."""
    if layout.devices != devices:
        raise LayoutError(f"tp*pp*dp*ep = {layout.tp}*{layout.pp}*{layout.dp}*{layout.ep} = {layout.devices} "
                          f"but --devices is {devices}; make the product equal the device count")
    if model.heads % layout.tp:
        raise LayoutError(f"tp={layout.tp} does not divide the {model.heads} attention heads; "
                          f"choose tp among {[d for d in range(1, model.heads + 1) if model.heads % d == 0][:12]}")
    if layout.expert_tensor_parallel:
        if layout.fold_tp_into_ep:
            raise LayoutError("expert_tensor_parallel and fold_tp_into_ep exclude each other (an expert is either "
                              "split over the tp ranks or whole on one of them): set one of them false")
        if layout.tp == 1:
            raise LayoutError("expert_tensor_parallel needs tp > 1 (it splits each expert's hidden width over the "
                              "tp ranks): set tp > 1 or expert_tensor_parallel false")
        if model.experts == 1:
            raise LayoutError("expert_tensor_parallel needs an MoE model (experts > 1): set "
                              "expert_tensor_parallel false")
        if model.ffn % layout.tp:
            raise LayoutError(f"expert_tensor_parallel splits each expert's hidden width ({model.ffn}) over tp="
                              f"{layout.tp}, which does not divide it: choose tp among "
                              f"{[d for d in range(2, 65) if model.ffn % d == 0][:8]} or expert_tensor_parallel false")
    if model.ffn % layout.tp:
        raise LayoutError(f"tp={layout.tp} does not divide ffn={model.ffn}")
    pipeline_chunks(model, layout)       # raises LayoutError for a split that cannot exist
    if model.moe_layers and layout.tp > 1 and layout.microbatch % layout.tp:
        raise LayoutError(f"an MoE layer splits a micro-batch's samples over tp={layout.tp}: microbatch="
                          f"{layout.microbatch} must be a multiple of {layout.tp}")
    if layout.ep > 1 and (model.experts == 1 or model.experts % layout.ep):
        raise LayoutError(f"ep={layout.ep} needs an MoE model whose experts ({model.experts}) it divides")
    if layout.expert_dispatch != "choice" and (model.experts == 1 or layout.expert_group == 1):
        raise LayoutError(f"expert_dispatch {layout.expert_dispatch!r} needs an MoE model exchanging tokens over an "
                          f"expert group of more than one rank (experts {model.experts}, expert group "
                          f"{layout.expert_group}): set ep > 1 (or fold_tp_into_ep), or expert_dispatch 'choice'")
    if layout.fold_tp_into_ep and (model.experts == 1 or model.experts % layout.expert_group):
        raise LayoutError(f"fold_tp_into_ep needs an MoE model whose experts ({model.experts}) ep*tp = {layout.ep}*"
                          f"{layout.tp} = {layout.expert_group} divides (a rank holds experts / (ep*tp)): choose ep "
                          "and tp whose product divides the experts, or fold_tp_into_ep false")
    if system.data_parallel_only and (layout.tp, layout.pp, layout.ep) != (1, 1, 1):
        raise LayoutError(f"system {system.name} runs data parallelism only (weight streaming); "
                          "use tp=1, pp=1, ep=1")
    m = layout.num_microbatches(batch)
    if layout.pp > 1 and layout.schedule == "interleaved" and m % layout.pp:
        raise LayoutError(f"the interleaved schedule needs the number of micro-batches ({m}) to be a "
                          f"multiple of pp ({layout.pp})")
    return m


_LAYER_CACHE: dict = {}


def _layer_times(system: System, model: GPT, lay: Layout, moe: bool) -> dict:
    """Per-device seconds of one layer for one micro-batch: forward GEMMs, attention part,
    element-wise, tensor-parallel and expert-parallel communication per pass. Memoised on what they
    depend on (a search predicts thousands of layouts that share them)."""
    key = (system.topology, system.devices_per_node, system.device, system.intra, system.inter, system.ici,
           system.torus, system.stream, model, moe, lay.microbatch, lay.tp, lay.ep, lay.sequence_parallel,
           lay.fold_tp_into_ep, lay.expert_tensor_parallel, lay.expert_dispatch, lay.tp_overlap, lay.fused_attention,
           lay.parallel_block)
    hit = _LAYER_CACHE.get(key)
    if hit is None:
        if len(_LAYER_CACHE) > 50_000:
            _LAYER_CACHE.clear()
        hit = _LAYER_CACHE[key] = _layer_times_uncached(system, model, lay, moe)
    return hit


def _layer_times_uncached(system: System, model: GPT, lay: Layout, moe: bool) -> dict:
    dev = system.device
    b, s, h, a, f, t = lay.microbatch, model.seq, model.hidden, model.heads, model.ffn, lay.tp
    tokens = b * s
    group = lay.expert_group               # ranks the experts are sharded over and the tokens exchanged among
    scale = model.top_k * model.expert_load(group) if moe else 1.0
    e = dev.dtype_bytes
    gemms = [linear_time(dev, tokens, 3 * h / t, h, bytes_per_element=e),      # QKV
             linear_time(dev, tokens, h, h / t, bytes_per_element=e)]          # attention output
    hide = (0.0, 0.0)       # expert work each all-to-all of a forward / backward runs behind
    routing = (0.0, 0.0)    # the MoE layer's routing, dispatch and combine, forward and backward
    counts = 0.0            # its count exchanges, exposed
    # its token exchanges over the expert group as its dispatch runs them (none on one rank)
    exchanges = (_dispatch_exchanges(system, model, lay, tokens / t, scale, e * (tokens * h)) if moe and group > 1
                 else None)
    if moe:
        # podscale's MoE layer under tp: each tp rank routes 1/tp of the micro-batch's samples, exchanges
        # them over its expert group (its ep group; folded, ep x tp) and runs them through whole experts
        # (MoELayer.forward). Folding leaves a rank's rows as they are (own x scale): E/(ep tp) experts,
        # each on tp times the rows of an unfolded rank's E/ep. Expert tensor parallelism gathers the tp ranks'
        # received rows: E/ep experts on tp times the rows, each 1/tp of the width.
        own = tokens / t
        n_local = local_experts(model, lay)
        etp = lay.expert_tensor_parallel_size
        m_exp = etp * own * scale * group / model.experts    # rows each local expert runs (busiest rank)
        experts = _mlp_gemms(dev, m_exp, f / etp, h, e, batch=n_local)
        gemms += experts
        gemms.append(linear_time(dev, own, model.experts, h, bytes_per_element=e))   # router
        # the shared experts: one dense MLP on the rank's own tokens, whole; split as the experts are, on
        # every tp rank's tokens at 1/tp of its width (WidthSplit.run_dense)
        shared = _mlp_gemms(dev, etp * own, model.shared_ffn / etp, h, e) if model.shared_experts else []
        gemms += shared
        # a rank receives about own x top_k rows in (source rank, local expert) segments (TokenExchanges.segments)
        if exchanges and etp == 1 and overlaps_exchange(own * model.top_k, exchanges.segments):
            # the layer runs a rank's own rows (1/own_share of its experts' work) in two halves while the two
            # exchanges of each pass are in flight (podscale.parallel.moe.layer._ExpertParallelFFN)
            hide = tuple(sum(x[i] for x in experts) / (2 * exchanges.own_share) for i in (0, 1))
        # (a dispatch that sends a token once a destination adds its own index and row work: moe_routing_bytes)
        route_bytes = moe_routing_bytes(own, model.experts, model.top_k, h, e,
                                        own * model.top_k * exchanges.rows_per_choice if exchanges else None,
                                        exchanges.stages if exchanges else 0, model.drop_policy, s)
        routing = tuple(routing_time(dev, x, sum(route_bytes)) for x in route_bytes)
        if exchanges:
            # the count exchange before the tokens, while the shared experts run (MoELayer._forward_local), and
            # any that follows it
            counts = overlapped_exposed(dev, exchanges.counts, sum(x[0] for x in shared)) + exchanges.counts_exposed
    else:
        gemms += _mlp_gemms(dev, tokens, f / t, h, e)           # column- then row-parallel
    dense, dense_bwd = sum(g[0] for g in gemms), sum(g[1] for g in gemms)
    heads_local = b * a / t
    measured_attn = attention_time(dev, s, h / a, heads_local) if lay.fused_attention else None
    if measured_attn:
        # a calibrated CPU: the fused kernel's forward and backward as measured on this machine
        attn, attn_bwd_measured = measured_attn
    elif lay.fused_attention:
        # FlashAttention (Dao et al. 2022; torch's scaled_dot_product_attention): the score and value GEMMs
        # in one kernel that never writes the s x s matrix, so its time is their arithmetic only (the
        # GEMM model's rate with q, k, v, o as the only traffic), no softmax or dropout pass over memory.
        # A causal kernel skips the blocks above the diagonal: half of the s x s scores. On a calibrated CPU
        # (a measured element-wise rate) the softmax's exponentials inside the kernel cost that rate too.
        d = h / a
        scores = s * s / 2 * heads_local
        attn = max(4.0 * scores * d / _gemm_rate(dev, s, s, d, heads_local),
                   stream_time(dev, 4 * e * s * d * heads_local))
        if dev.elementwise_bw:
            attn += stream_time(dev, 2 * e * scores)
    else:
        attn = (gemm_time(dev, s, s, h / a, batch=heads_local, bytes_per_element=e)
                + gemm_time(dev, s, h / a, s, batch=heads_local, bytes_per_element=e))
    sbh = tokens * h
    softmax = 9 * a * s * s * b / t
    # the MLP's bias + GELU on every row it runs: the routed rows' (scale x tokens, width f) and the shared
    # experts' (tokens, width shared_ffn), split over tp like a dense MLP's
    mlp_width = f * scale + model.shared_ffn if moe else f
    ew = elementwise_time(dev, layer_elementwise_bytes(tokens, h, mlp_width, t, lay.sequence_parallel, e),
                          e * tokens * h)
    ew_attn = 0.0 if lay.fused_attention else stream_time(dev, softmax * e / 2)
    # model.expert_recompute: the experts' GELU evaluated again before their backward (its input read, its
    # output written: rows x f/t each)
    gelu_again = (elementwise_time(dev, 2 * e * tokens * scale * f / t, e * tokens * h)
                  if moe and model.expert_recompute else 0.0)
    act_bytes = e * sbh                                       # one [s, b, h] activation tensor
    tp_ar = net.all_reduce_time(system, act_bytes, t, 1) if t > 1 else 0.0
    a2a = exchanges.tokens if exchanges else 0.0
    unhidden = exchanges.tokens_exposed if exchanges else 0.0
    metadata = exchanges.metadata if exchanges else (0.0, 0.0)
    # Weight-gradient GEMMs of the column-parallel linears (QKV, and a dense block's MLP-in), which
    # Megatron's asynchronous tensor-parallel backward runs while the input gradient's collective is in flight.
    wgrad = [weight_grad_time(dev, tokens, 3 * h / t, h, bytes_per_element=e)]
    if moe:
        # the attention's collective in each pass (an MoE layer's output is whole, not partial: nothing to
        # fuse it with) and the MoE layer's own: the all-gather over tp of its samples' outputs in the
        # forward, and of their input gradients in the backward (SplitBatchToTP); with sequence parallelism
        # an all-to-all over tp from the sequence shards to whole samples and one back, in each pass
        if t == 1:
            moe_tp = 0.0
        elif lay.sequence_parallel:
            moe_tp = 2 * net.all_to_all_time(system, act_bytes / t, t, 1)
        else:
            moe_tp = net.all_gather_time(system, act_bytes, t, 1)
        # the layer's aux and z loss averaged over tp in its forward (ReduceFromTP: one float)
        loss_mean = net.all_reduce_time(system, 4, t, 1)
        if lay.expert_tensor_parallel:
            # the experts' exchanged rows (scale x a rank's tokens) and, with shared experts, the tokens
            # themselves, each gathered over tp before their split MLP and the partial outputs
            # reduce-scattered after
            moe_tp += width_split_rows_time(system, act_bytes * scale, t)
            if model.shared_experts:
                moe_tp += width_split_rows_time(system, act_bytes, t)
        tp_fwd = tp_ar + moe_tp + loss_mean
        tp_bwd = _tp_backward(lay, tp_ar, wgrad, dev, collectives=1) + moe_tp
    else:
        wgrad.append(weight_grad_time(dev, tokens, f / t, h, bytes_per_element=e))
        tp_fwd = _tp_collectives_per_pass(lay) * tp_ar
        tp_bwd = _tp_backward(lay, tp_ar, wgrad, dev)
    # backward of the attention core: twice its forward; fused, 2.5x (five GEMMs for the forward's two,
    # the scores recomputed: Dao 2023, FlashAttention-2, Sec. 3.1.2)
    attn_bwd = (attn_bwd_measured if measured_attn else
                (FUSED_ATTN_BWD_OVER_FWD if lay.fused_attention else BWD_OVER_FWD) * (attn + ew_attn))
    return {"gemm": dense, "gemm_bwd": dense_bwd, "attn": attn + ew_attn, "attn_bwd": attn_bwd, "ew": ew,
            "tp_fwd": tp_fwd, "tp_bwd": tp_bwd, "a2a": a2a, "expert_recompute": gelu_again,
            "a2a_exposed": tuple(overlapped_exposed(dev, a2a, x) + unhidden for x in hide), "counts": counts,
            "dispatch_metadata": metadata,
            "routing": routing[0], "routing_bwd": routing[1],
            "kernels": KERNELS_PER_LAYER * dev.kernel_overhead}


@dataclass(frozen=True)
class TokenExchanges:
    """Seconds of one MoE layer's exchanges over its expert group for one micro-batch, as its dispatch runs them
    (``Layout.expert_dispatch``; one small pricing function per dispatch: :data:`_DISPATCH_PRICES`).
    ``_layer_times`` hides ``tokens`` under the own rows (``overlaps_exchange`` with ``segments``; the own rows
    are 1/``own_share`` of a rank's expert work) and adds the rest exposed."""

    tokens: float                 # one token all-to-all (a pass has two: dispatch and combine, or their gradients)
                                  # that the own rows may run under
    segments: float               # (source rank, local expert) segments a rank receives those rows in
    own_share: int                # ranks that exchange spans, the own rank among them
    counts: float                 # the count exchange before the tokens (run under the shared experts)
    counts_exposed: float = 0.0   # count exchanges after it, exposed
    tokens_exposed: float = 0.0   # per token all-to-all, seconds of exchanges nothing hides
    metadata: tuple = (0.0, 0.0)  # the forward's / backward's choice bytes riding in the rows' exchanges, exposed
    stages: int = 0               # dispatch stages that send a token once a destination (moe_routing_bytes)
    rows_per_choice: float = 1.0  # rows those stages send per kept choice, on average over the stages


@dataclass(frozen=True)
class _Routed:
    """What one rank of an MoE layer exchanges in one micro-batch: ``own`` tokens it routes (its 1/tp of the
    samples), ``scale`` rows a token on the busiest rank (top_k x the expert load), ``act_bytes`` the micro-batch's
    [s, b, h] activation, over an expert ``group`` of ranks ``stride`` apart (``Layout.expert_group_stride``)."""

    own: float
    scale: float
    act_bytes: float
    tp: int
    group: int
    stride: int

    def rows_bytes(self, rows_per_choice: float) -> float:
        """Bytes of a rank's token rows when a kept choice costs ``rows_per_choice`` rows (1 per choice)."""
        return self.act_bytes * self.scale * rows_per_choice / self.tp

    def choice_bytes(self, per_choice: float) -> float:
        """Bytes of ``per_choice`` bytes for each of a rank's kept choices (metadata, gate gradients)."""
        return per_choice * self.own * self.scale


def _dispatch_exchanges(system: System, model: GPT, lay: Layout, own: float, scale: float,
                        act_bytes: float) -> TokenExchanges:
    """The token, count and metadata exchanges of one MoE layer over its expert group (> 1 rank) under the
    layout's ``expert_dispatch``: a rank exchanges the rows of its own 1/tp of the samples over its ep group
    (stride tp: the ranks of its tp index), or folded over its ep x tp group (stride 1)."""
    routed = _Routed(own, scale, act_bytes, lay.tp, lay.expert_group, lay.expert_group_stride)
    return _DISPATCH_PRICES[lay.expert_dispatch](system, model, routed)


def _choice_exchanges(system: System, model: GPT, r: _Routed) -> TokenExchanges:
    """Per choice (GShard's all-to-all): one row per kept choice each way, after a count exchange of E int64."""
    return TokenExchanges(tokens=net.all_to_all_time(system, r.rows_bytes(1.0), r.group, r.stride),
                          segments=model.experts, own_share=r.group,
                          counts=net.all_to_all_time(system, 8 * model.experts, r.group, r.stride))


def _rank_exchanges(system: System, model: GPT, r: _Routed) -> TokenExchanges:
    """Per rank (DeepEP's dispatch and combine: DeepSeek-AI 2025, github.com/deepseek-ai/DeepEP): D rows a token
    instead of top_k (:func:`expected_ranks_per_token`), over the whole expert group."""
    if model.top_k == 1:        # one choice is on one rank: the runtime sends per choice (layer.make_dispatch)
        return _choice_exchanges(system, model, r)
    rows_per_choice = expected_ranks_per_token(model.experts, model.top_k, r.group) / model.top_k
    return _per_rank_stage(system, r, rows_per_choice, model.experts, r.group, r.stride)


def _per_rank_stage(system: System, r: _Routed, rows_per_choice: float, held: int, members: int,
                    stride: int) -> TokenExchanges:
    """A per-rank exchange among ``members`` ranks ``stride`` apart holding ``held`` experts between them:
    ``rows_per_choice`` rows a kept choice each way, a count exchange of members x (held/members + 1) int64 (8
    (held + members) bytes a rank), and the forward's metadata (``DISPATCH_METADATA_BYTES`` a kept choice) and
    the backward's gate-value gradients (``GATE_GRAD_BYTES``), which travel in the same all-to-all as the rows
    out and the input gradients back (the runtime's ``_pair_all_to_all``): their bandwidth, no latency."""
    def a2a(nbytes: float) -> float:
        return net.all_to_all_time(system, nbytes, members, stride)
    rows = r.rows_bytes(rows_per_choice)
    return TokenExchanges(tokens=a2a(rows), segments=held, own_share=members, counts=a2a(8 * (held + members)),
                          metadata=tuple(a2a(rows + r.choice_bytes(x)) - a2a(rows)
                                         for x in (DISPATCH_METADATA_BYTES, GATE_GRAD_BYTES)),
                          stages=1, rows_per_choice=rows_per_choice)


def _node_exchanges(system: System, model: GPT, r: _Routed) -> TokenExchanges:
    """Per node (DeepEP's internode dispatch and combine: DeepSeek-AI 2025, github.com/deepseek-ai/DeepEP, RDMA
    to the GPU of the same index on each destination node, then NVLink forwarding; DeepSeek-V3, Sec. 3.2.2), over
    an expert group of n ranks on N nodes, L = n/N of them a node (``network.node_members``):

    1. between nodes, a token goes once to each node holding any of its kept choices, to its peer there (the rank
       of the same within-node index; on its own node, itself): D_node rows a token, D_node =
       :func:`expected_ranks_per_token` (E, k, N), the same formula with nodes for ranks; priced as N-member
       all-to-alls at stride L x the group's stride (inter-node links): the count exchange (2 int64 a
       destination: rows, choices; run under the shared experts as any first count exchange), the rows out and
       the combined rows back in the forward (the output and input gradients in the backward), and the kept
       choices' metadata (``NODE_METADATA_BYTES``; the backward's ``NODE_METADATA_GRAD_BYTES``), all exposed;
    2. inside the node, the peer dispatches the rows it received per rank over the node's L ranks (intra-node
       links), priced as ``"rank"`` is (:func:`_per_rank_stage`: its own-row hiding with E/N experts in the node,
       its exposed count exchange after stage 1's, its metadata and gate gradients). Its rows: a stage-1 row
       reaches on average D / D_node ranks of its node (D = expected_ranks_per_token(E, k, n)), which is exact in
       expectation under uniform routing and not an approximation: the ranks a token reaches are those it reaches
       on each node it reaches, and a node it misses holds none of them, so E[ranks] = D_node x E[ranks on a
       reached node]. A rank thus sends D rows a token inside its node, as many as ``"rank"`` sends over the group.

    When the group lies in one node (N = 1, or a torus) the runtime runs ``"rank"``, and so is it priced."""
    members = net.node_members(system, r.group, r.stride)
    nodes = r.group // members
    if nodes == 1:
        return _rank_exchanges(system, model, r)
    experts, k = model.experts, model.top_k
    inside = _per_rank_stage(system, r, expected_ranks_per_token(experts, k, r.group) / k, experts // nodes,
                             members, r.stride)

    def across(nbytes: float) -> float:     # to the peers: one rank a node, L x the group's stride apart
        return net.all_to_all_time(system, nbytes, nodes, members * r.stride)
    d_node = expected_ranks_per_token(experts, k, nodes)
    rows = r.rows_bytes(d_node / k)
    # the metadata with the rows out, its gradients with the input gradients back: bandwidth, no latency
    meta = tuple(across(rows + r.choice_bytes(x)) - across(rows) + m
                 for x, m in zip((NODE_METADATA_BYTES, NODE_METADATA_GRAD_BYTES), inside.metadata))
    return TokenExchanges(tokens=inside.tokens, segments=inside.segments, own_share=inside.own_share,
                          counts=across(16 * nodes), counts_exposed=inside.counts, tokens_exposed=across(rows),
                          metadata=meta, stages=2,
                          rows_per_choice=(d_node / k + inside.rows_per_choice) / 2)


#: how each ``expert_dispatch`` (layout.EXPERT_DISPATCHES) is priced
_DISPATCH_PRICES = {"choice": _choice_exchanges, "rank": _rank_exchanges, "node": _node_exchanges}


def expected_ranks_per_token(experts: int, top_k: int, group: int) -> float:
    """D: the expected number of distinct ranks among a token's ``top_k`` distinct expert choices when the
    ``experts`` are sharded evenly over ``group`` ranks (E/n each) and routing is uniform:

        E[D] = n (1 - C(E - E/n, k) / C(E, k))

    (a rank is missed when all k choices fall among the other E - E/n experts; 1 at k = 1 or n = 1). Per-rank
    dispatch (DeepEP: DeepSeek-AI 2025, github.com/deepseek-ai/DeepEP) sends a token D times where per-choice
    dispatch sends it k times, so its token exchanges carry D / k of the bytes. DeepSeek-V3's node-limited
    routing (Sec. 2.1.2; its all-to-all, Sec. 3.2.2) caps D by confining each token's choices to a few groups of
    experts (D <= min(k, groups x ranks per group) when a group is a set of ranks); the planner's GPT has no
    router groups (``models.GPT``: experts, top_k only), so this is the uniform value, an upper bound on D under
    such routing. Per-node dispatch (DeepEP's internode dispatch) reads it with nodes for ranks: D_node, the
    distinct nodes among a token's choices (``_node_exchanges``). The product form below is C(E - E/n, k) / C(E, k)
    without the large binomials."""
    if group <= 1 or top_k <= 1:
        return 1.0
    per_rank = experts / group
    missed = 1.0
    for i in range(top_k):
        missed *= (experts - per_rank - i) / (experts - i)
    return group * (1.0 - max(missed, 0.0))


def width_split_rows_time(system: System, nbytes: float, tp: int) -> float:
    """Seconds of one pass's tp collectives of an MLP whose hidden width is split over the ``tp`` neighbours
    while each tp rank holds other rows (expert tensor parallelism: the routed experts' exchanged rows, and
    the shared experts' tokens; podscale.parallel.moe.layer.WidthSplit): every tp rank's rows all-gathered
    before it and their partial outputs reduce-scattered after (the backward: output gradients gathered,
    input gradients reduce-scattered). ``nbytes``: the rows of the whole tp group, whole width."""
    return net.all_gather_time(system, nbytes, tp, 1) + net.reduce_scatter_time(system, nbytes, tp, 1)


def _mlp_gemms(dev, rows: float, width: float, hidden: int, dtype_bytes: int, batch: float = 1) -> list:
    """(forward, backward) seconds of a GELU MLP's two linears, hidden -> ``width`` -> hidden, on ``rows``
    rows (``batch`` such MLPs side by side: a rank's experts): a dense block's on its tp shard of the
    width, an expert's whole on its rows."""
    return [linear_time(dev, rows, width, hidden, batch=batch, bytes_per_element=dtype_bytes),
            linear_time(dev, rows, hidden, width, batch=batch, bytes_per_element=dtype_bytes)]


def local_experts(model: GPT, lay: Layout) -> int:
    """Experts of one MoE layer that a rank holds: experts / ep, replicated over tp (whole, or with
    ``expert_tensor_parallel`` 1/tp of each one's hidden width); with ``fold_tp_into_ep`` experts / (ep x tp),
    whole, each on one rank of its dp replica (Liu et al. 2025, "MoE Parallel Folding"; rank (ep_i, tp_j)
    holds the global ids from (ep_i tp + tp_j) x E / (ep tp))."""
    return model.experts // lay.expert_group


@dataclass(frozen=True)
class RankParams:
    """Parameters one rank holds, split by how podscale reduces and shards their gradients
    (podscale.parallel.moe.layer, "What a data-parallel strategy must do with an MoE model"): ``dense`` are
    replicated over dp x ep (gradients averaged, ZeRO-sharded over dp x ep), ``expert`` are this ep rank's
    experts (over ep x tp with ``fold_tp_into_ep``), replicated over dp only (gradients summed, ZeRO-sharded
    over dp). ``tp_summed``: of these, those that every tp rank holds whole and runs on its own share of the
    samples (an MoE layer's router and shared experts under tp > 1, and its experts unless folded), whose
    gradients are partial per tp rank and summed over tp every time they are reduced (they carry the
    ``sequence_parallel`` tag; a sequence-parallel layer norm's few h parameters do too, and are left
    out). Folded experts are on one tp rank only: their gradients are complete there; so are the width slices of
    expert tensor parallelism (the experts' and the shared experts'), whose whole output biases (``b_proj``, on
    every tp rank) are summed over tp."""

    dense: float
    expert: float
    tp_summed: float = 0.0

    @property
    def total(self) -> float:
        return self.dense + self.expert

    def __add__(self, other: "RankParams") -> "RankParams":
        return RankParams(self.dense + other.dense, self.expert + other.expert, self.tp_summed + other.tp_summed)

    def __mul__(self, k: float) -> "RankParams":
        return RankParams(self.dense * k, self.expert * k, self.tp_summed * k)

    __rmul__ = __mul__


def layer_rank_params(model: GPT, lay: Layout, moe: bool) -> RankParams:
    """One block's parameters on a rank of a tp x ep layout. A dense block is Megatron-sharded over tp (its
    layer norms and row-parallel biases counted as sharded too: a few h per block). An MoE block has no
    dense MLP: its attention and norms, sharded as a dense block's, and its MoE layer, which podscale does
    not shard over tp (podscale.parallel.moe.layer.MoELayer.forward: each tp rank runs 1/tp of the samples
    through whole experts): the router and the shared experts (dense: every ep and tp rank runs them, their
    gradients summed over tp) and the rank's :func:`local_experts` experts: ``experts / ep`` whole, the
    same on every tp rank and summed over tp; folded ``experts / (ep tp)`` whole, on this rank alone; or with
    ``expert_tensor_parallel`` ``experts / ep`` at 1/tp of their width (``w_fc``'s columns, ``b_fc``,
    ``w_proj``'s rows: Megatron-core's expert tensor parallelism) with the whole output bias ``b_proj``, of
    which only ``b_proj`` is summed over tp; the shared experts are then split the same way (dense still:
    replicated over dp x ep), only their ``b_proj`` summed over tp."""
    t, h = lay.tp, model.hidden
    if not moe:
        return RankParams(model.layer_params() / t, 0.0)
    n_local, w = local_experts(model, lay), lay.expert_tensor_parallel_size
    router = h * model.experts
    # a rank's part of each MLP: whole, or 1/w of its hidden width with its whole output bias
    shared = model.mlp_params(model.shared_ffn // w) if model.shared_experts else 0
    experts = n_local * model.mlp_params(model.ffn // w)
    dense = model.attention_params / t + router + shared
    if lay.expert_tensor_parallel:
        # the width slices' gradients are whole on their holders: only the router and the output biases
        return RankParams(dense, experts, router + (n_local + (1 if model.shared_experts else 0)) * h)
    summed = 0.0 if t == 1 else router + shared + (0.0 if lay.fold_tp_into_ep else experts)
    return RankParams(dense, experts, summed)


def rank_params(model: GPT, lay: Layout, rank: int = 0) -> RankParams:
    """Parameters of pipeline rank ``rank``: its blocks (the dense and MoE blocks in the model's proportion,
    as the step time counts them) and, on the end stages, the embeddings (pp = 1: word and position
    embeddings and the final layer norm; pp > 1: the tied word embedding of each end stage)."""
    p, t, h = lay.pp, lay.tp, model.hidden
    layers = pipeline_rank_layers(model, lay)[rank]
    moe_frac = model.moe_layers / model.layers
    blocks = layers * ((1 - moe_frac) * layer_rank_params(model, lay, False)
                       + moe_frac * layer_rank_params(model, lay, True))
    if p == 1:
        return blocks + RankParams((model.embedding_params + 2 * h) / t, 0.0)
    if rank in (0, p - 1):
        return blocks + RankParams(model.vocab * h / t, 0.0)
    return blocks


def reduces_every_micro_batch(lay: Layout) -> bool:
    """ZeRO-2/3 without a pipeline keep no full gradient buffer: every micro-batch's gradients are
    reduce-scattered under its backward and added into the shard (Rajbhandari et al. 2020, Sec. 5.2;
    DeepSpeed's stage 2; podscale's ZeroStrategy). A pipeline accumulates locally and reduces once a step."""
    return lay.zero_stage >= 2 and lay.pp == 1


def gradient_bookkeeping_bytes(lay: Layout, m: int) -> float:
    """Bytes per parameter of the rank's stage that podscale's strategies move per step to accumulate the
    ``m`` micro-batches' gradients and scale them for the reduction, beyond the norm/clip/zero passes
    (parallel/data.py, parallel/zero/strategy.py): data parallelism over buckets (``.grad`` views of a
    zeroed bucket, so every micro-batch is added in) and ZeRO-1 (the same, into its full gradient buffer,
    which it also zeroes) add 12 bytes per micro-batch and divide by the rank count in place; one replica
    keeps autograd's own gradients (the first micro-batch's is taken as is); ZeRO-2/3 copy each gradient,
    scaled, into a staging bucket for every micro-batch's reduce-scatter, or, in a pipeline, accumulate
    locally and copy once."""
    if lay.zero_stage == 0:
        if lay.data_parallel == 1:
            return GRAD_ACCUMULATE_BYTES * (m - 1)
        return GRAD_ACCUMULATE_BYTES * m + GRAD_SCALE_BYTES
    if lay.zero_stage == 1:
        return GRAD_ACCUMULATE_BYTES * m + GRAD_SCALE_BYTES + 4        # + zeroing the full buffer
    if not reduces_every_micro_batch(lay):
        return GRAD_ACCUMULATE_BYTES * (m - 1) + GRAD_SCALE_BYTES
    return GRAD_SCALE_BYTES * m


def layer_elementwise_bytes(tokens: float, hidden: float, ffn: float, tp: int = 1,
                            sequence_parallel: bool = False, dtype_bytes: int = 2) -> float:
    """Bytes the element-wise kernels of one layer's forward move outside the attention core (module
    docstring: 22 sbh replicated over tp without sequence parallelism, 4 sb ffn + 8 sbh split over tp,
    counted for 16-bit elements and rescaled to ``dtype_bytes``). ``plan calibrate`` prices these same bytes
    at the rate it measures for the same kernels, so the two stay one formula."""
    sbh = tokens * hidden
    replicated = 22 * sbh / (tp if sequence_parallel else 1)
    sharded = (4 * ffn / hidden + 8) * sbh / tp
    return (replicated + sharded) * dtype_bytes / 2


def stable_sort_bytes(n: int) -> float:
    """Bytes a stable sort of ``n`` fp32 keys with their int64 indices moves on a CPU, counted pass by pass as
    the kernel runs: torch's CPU sort (aten/src/ATen/native/cpu/SortingKernel.cpp: a float key takes neither the
    radix nor the unstable x86-simd sort) copies the keys into its output and fills the indices (16 bytes a
    key), then runs ``std::stable_sort`` on the keys zipped with the indices, which in libstdc++
    (``__stable_sort_adaptive``) sorts each half with ``__merge_sort_with_buffer`` (runs of 7 insertion-sorted in
    one pass, then merge passes in pairs, array to buffer and back, while the run is shorter than the half) and
    merges the halves (the first moved to the buffer, then merged: 1.5 passes). A pass reads and writes each
    (key, index) pair: 24 bytes a key (the buffer's padded tuples are not counted apart)."""
    if n < 2:
        return 0.0
    half, run, merges = (n + 1) // 2, 7, 0
    while run < half:
        merges, run = merges + 2, run * 4
    return n * (16 + 24 * (1 + merges + 1.5))


def drop_policy_bytes(tokens: float, top_k: int, group_size: int, drop_policy: str) -> float:
    """Forward bytes ``gate._listing`` (the order the choices claim capacity slots in, ``model.drop_policy``)
    and the two gathers through its listing in ``gate.route`` move beyond the default ``"position"``'s, on a rank
    routing ``tokens`` tokens in groups of ``group_size`` (a sequence), C = tokens x top_k choices; the position
    listing (for top_k > 1: an arange of C int64 and its transposed copy, 3 passes; the key and the ids gathered
    through it, 6 passes) is in ``moe_routing_bytes``'s 34 passes already:

    ``"priority"``  (V-MoE's batch-prioritized routing) each group's top scores sorted
                    (:func:`stable_sort_bytes` of ``group_size``, once a group), the ids gathered by that order (3
                    int64 passes over C); at top_k = 1, where position has no listing, also its arange (1) and the
                    two gathers through it (6)
    ``"probs"``     (Megatron-core's ``moe_token_drop_policy = "probs"``) one sort of all C gate values
                    (:func:`stable_sort_bytes` of C) in place of position's arange and transposed copy (- 3
                    passes); at top_k = 1 also the two gathers through it (6)

    Fixed counts, not fitted; priced at the routing rate ``plan calibrate`` measures (``compute.routing_time``)."""
    c = tokens * top_k
    if drop_policy == "position":
        return 0.0
    if drop_policy == "priority":
        if group_size < 1:
            raise ValueError("drop_policy 'priority' sorts each routing group: give its group_size (tokens, >= 1)")
        return stable_sort_bytes(group_size) * tokens / group_size + 8 * c * (3 + (7 if top_k == 1 else 0))
    if drop_policy == "probs":
        return stable_sort_bytes(round(c)) + 8 * c * (6 if top_k == 1 else -3)
    raise ValueError(f"drop_policy {drop_policy!r} is not one of {', '.join(DROP_POLICIES)}")


def moe_routing_bytes(tokens: float, experts: int, top_k: int, hidden: int, dtype_bytes: int,
                      rows_sent: float | None = None, stages: int = 0, drop_policy: str = "position",
                      group_size: int = 0) -> tuple[float, float]:
    """(forward, backward) bytes an MoE layer's routing, dispatch and combine move on a rank routing ``tokens``
    tokens, counted kernel by kernel as podscale runs them (podscale.parallel.moe.gate.route, the aux and z
    losses, MoELayer._forward_local), with every choice kept (C = tokens x top_k choices and rows, the planner's
    unit before the busiest rank's load). Probabilities are fp32 (the router's selective precision, Fedus et
    al. 2021, Sec. 2.4), indices int64, rows ``dtype_bytes`` x ``hidden``:

    forward   softmax (read + write the N x E probabilities), top_k max passes and the masked copy, the aux
              loss's mean and the z loss's logsumexp (2): (top_k + 7) passes over N x E; the choices' index
              work (keys, the stable sort and its permutation, bincount, slots, token-major ids, position
              scatter, kept selection, tokens of the kept choices): 34 int64 passes over C; the dispatch's
              gather of C rows (read + write), the combine's scaling (read + write) and index_add (read the rows,
              read + write the zeroed token rows): 5 C + 3 N rows
    backward  softmax's, the gates' gather's and the losses' gradients: 8 passes over N x E; the combine's
              row gradients gathered (2 C), both gradients of the scaling (4 C), the dispatch's index_add into
              zeroed token gradients (C + 3 N): 7 C + 3 N rows

    With ``stages`` > 0 the layer dispatches a token once a rank (``"rank"``: 1 stage; ``"node"``: 2, once a node
    and then once a rank inside it), ``rows_sent`` rows (U, one per token and destination) in place of C, and each
    stage adds (podscale.parallel.moe.layer._RankExchange, _RankDispatchFFN, NodeDispatch):

    forward   the choices' experts and gate values gathered, their destinations, keys, ``unique`` with its
              inverse, the rows' tokens and counts, each choice's row in its block, the choices' float64
              metadata packed and unpacked beside the rows, their rows and gates regrouped expert-major (the
              per-node dispatch's second stage: its sort of the received choices by expert too): 55 int64 passes
              over C; the U rows gathered instead of C (2 U - 2 C), packed and unpacked (4 U), the received rows
              gathered per choice (2 C), the choices combined into zeroed rows there (3 U) and the U rows added
              onto the tokens (U): 9 U rows
    backward  the gate gradients regrouped back (2 passes over C) and packed (2); the choices' input gradients
              added into zeroed rows (3 U), packed and unpacked (4 U), the U rows onto the tokens (U): 8 U rows

    A ``drop_policy`` other than ``"position"`` adds its listing's sort (:func:`drop_policy_bytes`, groups of
    ``group_size`` tokens) to the forward.

    These counts are fixed, not fitted; a calibrated CPU measures the rate of the layer's work beyond its GEMMs
    (these kernels and the layer's bookkeeping between them) in these bytes (``plan calibrate``:
    ``compute.routing_time``)."""
    n, c, row = tokens, tokens * top_k, dtype_bytes * hidden
    forward = (4 * (top_k + 7) * n * experts + 8 * 34 * c + row * (5 * c + 3 * n)
               + drop_policy_bytes(tokens, top_k, group_size, drop_policy))
    backward = 4 * 8 * n * experts + row * (7 * c + 3 * n)
    if stages:
        u = c if rows_sent is None else rows_sent
        forward += stages * (8 * 55 * c + row * 9 * u)
        backward += stages * (8 * 4 * c + row * 8 * u)
    return forward, backward


def global_balance_time(system: System, model: GPT, lay: Layout) -> float:
    """One MoE layer's forward's all-reduce of the global-batch load-balancing loss (``aux_loss_scope =
    "global"``: Qiu et al. 2025; Megatron-core's ``global_aux_loss``; ``"global_step"`` sums the same counts
    over the step's micro-batches, one all-reduce per forward as well): its experts + 1 first-choice counts
    (int64) summed over the dp x ep ranks (stride tp), then over tp, before the loss, nothing to hide behind
    (podscale.parallel.moe.gate.first_choice_counts); priced beside the count exchange, per forward.  0 for
    the group scope.  Under pipelines the groups are a stage's ranks, as the layout's dp, ep and tp are."""
    if model.aux_loss_scope == "group":
        return 0.0
    nbytes = 8 * (model.experts + 1)
    return net.all_reduce_time(system, nbytes, lay.dp * lay.ep, lay.tp) + net.all_reduce_time(system, nbytes, lay.tp, 1)


def balance_all_reduces(model: GPT, lay: Layout) -> int:
    """How many forwards of an MoE layer, per micro-batch, all-reduce the first-choice counts
    (:func:`global_balance_time`): none for the group scope; every forward for ``"global"`` (two under full
    recomputation); one for ``"global_step"``, whose forward recomputed in the backward takes its first forward's
    sum again without communicating (podscale.parallel.moe.MoELayer._balance_counts)."""
    if model.aux_loss_scope == "group":
        return 0
    return 1 if model.aux_loss_scope == "global_step" or lay.recompute != "full" else 2


def _tp_collectives_per_pass(lay: Layout) -> int:
    """Tensor-parallel all-reduces (or reduce-scatter/all-gather pairs) of one layer in one pass: two in
    Megatron's sequential block (after attention, after the MLP: Shoeybi et al. 2019, Fig. 3); one in the
    parallel formulation, whose attention and MLP outputs are summed before a single reduction
    (Chowdhery et al. 2022, PaLM, Sec. 2: "the MLP and attention ... can be fused"; Wang & Komatsuzaki's
    GPT-J)."""
    return 1 if lay.parallel_block else 2


def _tp_backward(lay: Layout, ar: float, wgrad: list, dev, collectives: int | None = None) -> float:
    """Exposed tensor-parallel communication of one layer's backward (Shoeybi et al. 2019, Fig. 3: one
    all-reduce of the input gradient per column-parallel linear, two per layer; with sequence parallelism
    a reduce-scatter each, plus the all-gather of the layer input that Korthikanti et al. 2022, Sec. 4.2.2,
    redo in the backward rather than keep). With ``tp_overlap`` (Megatron-LM's asynchronous tensor-parallel
    all-reduce, 2022) the input-gradient collective runs under the weight-gradient GEMM of the same linear,
    so only what exceeds it is exposed (at least the device's measured ``overlap_exposed`` fraction of it),
    plus the device's measured ``overlap_penalty`` per overlapped collective (a CPU, whose collective thread
    competes with the compute threads for the cores). ``collectives``: the layer's tensor-parallel
    collectives per pass (default :func:`_tp_collectives_per_pass`; an MoE block's attention alone: 1)."""
    if ar == 0.0:
        return 0.0
    sp = lay.sequence_parallel
    # the input-gradient collective of each column-parallel linear: an all-reduce, or (sp) a reduce-scatter
    collective = ar / 2 if sp else ar
    redo_gather = ar / 2 if sp else 0.0     # sp: all-gather the input again for the weight gradient
    k = _tp_collectives_per_pass(lay) if collectives is None else collectives
    if not lay.tp_overlap or not wgrad:
        return k * (collective + redo_gather) if sp else k * ar
    if k == 1:      # one collective (a parallel block's fused input gradient, or an MoE block's attention's)
        # under the weight-gradient GEMMs
        return redo_gather + overlapped_exposed(dev, collective, sum(wgrad)) + dev.overlap_penalty
    return sum(redo_gather + overlapped_exposed(dev, collective, w) + dev.overlap_penalty for w in wgrad)


def predict_gpt(system: System, devices: int, model: GPT, lay: Layout, batch: int) -> Prediction:
    """Step time and memory of one layout. Pipeline ranks may hold different numbers of layers
    (``stage_layers``: the trainer's split, or the layout's ``pipeline_layers``); rank 0 also holds the
    embeddings, the last rank the output layer and loss. With per-micro-batch times T_r of the p ranks,
    a 1F1B / GPipe / interleaved schedule takes m * max T_r for the bottleneck rank plus a fill and
    drain of (sum T_r - max T_r) / v (Narayanan et al. SC'21, Sec. 2.2; for equal T_r this is the
    familiar bubble (p - 1)/(v m)). Memory is that of the fullest rank."""
    m = check_gpt_layout(system, devices, model, lay, batch)
    if system.data_parallel_only:
        return predict_weight_streaming(system, devices, model, lay, batch, m)
    dev = system.device
    b, s, h, V, t, p, v = lay.microbatch, model.seq, model.hidden, model.vocab, lay.tp, lay.pp, lay.interleave
    L = model.layers
    rank_layers = pipeline_rank_layers(model, lay)
    moe_frac = model.moe_layers / L
    dense_t = _layer_times(system, model, lay, moe=False)
    moe_t = _layer_times(system, model, lay, moe=True) if model.moe_layers else dense_t

    def per_layer(key):  # average over dense and MoE layers
        return (1 - moe_frac) * dense_t[key] + moe_frac * moe_t[key]

    gemm, attn, ew = per_layer("gemm"), per_layer("attn"), per_layer("ew")
    launch, routing = per_layer("kernels"), per_layer("routing")
    fwd = gemm + attn + ew + launch + routing
    bwd = per_layer("gemm_bwd") + per_layer("attn_bwd") + BWD_OVER_FWD * (ew + launch) + per_layer("routing_bwd")
    # selective recompute re-runs the attention core's forward (fused or not) before its backward
    recompute = {"none": 0.0, "selective": attn, "full": fwd}[lay.recompute]
    # the experts' GELU evaluated again (model.expert_recompute; a full recompute re-runs it anyway)
    expert_rec = 0.0 if lay.recompute == "full" else moe_frac * moe_t["expert_recompute"]
    recompute += expert_rec
    n_fwd = 2 if lay.recompute == "full" else 1      # forward passes (incl. recompute's) and their collectives
    tp_comm = n_fwd * per_layer("tp_fwd") + per_layer("tp_bwd")
    # dispatch and combine in every forward (twice with full recompute) and backward, each less the own
    # rows' expert work it overlaps
    exposed_fwd, exposed_bwd = moe_t["a2a_exposed"]
    # (per-rank dispatch: and its metadata all-to-all in every forward, the gate gradients' in the backward)
    meta_fwd, meta_bwd = moe_t["dispatch_metadata"]
    ep_comm = 2 * moe_frac * (n_fwd * exposed_fwd + exposed_bwd) + moe_frac * (
        n_fwd * moe_t["counts"] + balance_all_reduces(model, lay) * global_balance_time(system, model, lay)
        + n_fwd * meta_fwd + meta_bwd)
    # Last stage: vocabulary projection and cross-entropy (Megatron places them there).
    logits_elems = b * s * V / t
    head_gemm = 3 * gemm_time(dev, b * s, V / t, h, bytes_per_element=dev.dtype_bytes)
    head_loss = stream_time(dev, CROSS_ENTROPY_BYTES * logits_elems)
    # The vocabulary-parallel embedding's and output layer's own tp collectives (Shoeybi et al. 2019, Sec. 3;
    # podscale.parallel.tensor.VocabParallelEmbedding, the head's ColumnParallelLinear): the embedding's partial
    # lookups summed in the forward (g: an all-reduce; under sequence parallelism a reduce-scatter, all-gathered
    # in the backward), on the first stage; the head's input through f (its gradient all-reduced in the
    # backward, under the head's weight gradient with tp_overlap; under sequence parallelism all-gathered in the
    # forward and its gradient reduce-scattered), on the last; and the vocab-parallel cross-entropy's two small
    # all-reduces there.
    act_full = dev.dtype_bytes * b * s * h              # one micro-batch's [s, b, h] activation
    embed_tp = head_tp = 0.0
    if t > 1:
        ar_full = net.all_reduce_time(system, act_full, t, 1)
        head_wgrad = weight_grad_time(dev, b * s, V / t, h, bytes_per_element=dev.dtype_bytes)
        head_tp = 2 * net.all_reduce_time(system, 4 * b * s, t, 1) + _tp_backward(lay, ar_full, [head_wgrad], dev,
                                                                                   collectives=1)
        if lay.sequence_parallel:
            embed_tp = net.reduce_scatter_time(system, act_full, t, 1) + net.all_gather_time(system, act_full, t, 1)
            head_tp += net.all_gather_time(system, act_full, t, 1)
        else:
            embed_tp = ar_full
    head = head_gemm + head_loss + head_tp
    # One micro-batch boundary between stages: Megatron's scatter-gather sends 1/t of it per tp rank
    # (Narayanan et al. SC'21, Sec. 4.1); DeepSpeed's pipeline engine sends the whole tensor from every rank.
    act_msg = act_full / (t if lay.pp_scatter_gather else 1)
    stride_pp = lay.dp * lay.ep * t

    per_layer_mb = fwd + bwd + recompute + tp_comm + ep_comm
    # Per-micro-batch time of each rank: its layers, the embedding's collectives on the first, the output layer
    # on the last; the slowest sets the step (on a tie the last, which holds the output layer).
    t_ranks = [n * per_layer_mb for n in rank_layers]
    t_ranks[0] += embed_tp
    t_ranks[-1] += head
    slow = max(range(p), key=lambda r: (t_ranks[r], r))
    slow_last, embed_slow = slow == p - 1, slow == 0
    n_slow, t_slow = rank_layers[slow], t_ranks[slow]
    comp_fwd, comp_bwd, comp_rec = n_slow * fwd, n_slow * bwd, n_slow * recompute
    bubble = (sum(t_ranks) - t_slow) / v
    # the step's messages between stages, as the schedule exposes them (the executor sends asynchronously);
    # an interleaved schedule hides them under the slowest rank's chunks: its per-micro-batch time over v, the
    # recompute counted with the backward and the rest split between forward and backward as their compute is
    t_fwd = (t_slow - comp_rec) * comp_fwd / (comp_fwd + comp_bwd)
    p2p = pipeline_message_time(lay.schedule, p, m, v, net.p2p_time(system, act_msg, stride_pp) if p > 1 else 0.0,
                                t_f=t_fwd / v, t_b=(t_slow - t_fwd) / v)

    # Ranks that can hold the most (parameters or activations): the two ends (embedding, head, logits)
    # and, per distinct layer count, the earliest rank with it (the most micro-batches in flight).
    candidates = sorted({0, p - 1} | {rank_layers.index(n) for n in set(rank_layers)})
    params = {r: rank_params(model, lay, r) for r in candidates}
    fullest = max(params.values(), key=lambda x: x.total)
    stage_dense, stage_expert = fullest.dense, fullest.expert
    dpe, dp_stride = lay.data_parallel, t
    grad_bytes = dev.dtype_bytes * stage_dense
    expert_grad_bytes = dev.dtype_bytes * stage_expert

    # Data-parallel gradient reduction: all-reduce (ZeRO 0), reduce-scatter + all-gather (1, 2),
    # reduce-scatter + per-micro-batch parameter all-gathers (3). Overlapped with the backward of
    # the last micro-batch when buckets are reduced as they fill.
    dp_red = net.all_reduce_time(system, grad_bytes, dpe, dp_stride)
    # ZeRO-1/2: the gradients are reduce-scattered under the backward, but the updated parameter shards are
    # all-gathered after the optimizer step, and the next forward waits for them: nothing to overlap with
    # (podscale's ZeroStrategy._publish_persistent / wait_params; DeepSpeed's stage 1/2 step, Rajbhandari et
    # al. 2020, Sec. 5). Stage 3 gathers per unit under compute (below).
    param_gather = 0.0
    if lay.zero_stage in (1, 2) and dpe > 1:
        # the reduce-scatter priced as itself, not as the all-reduce less the all-gather: the two halves of a
        # ring are equal, but a calibrated gloo runs each at its own measured bandwidth
        param_gather = net.all_gather_time(system, grad_bytes, dpe, dp_stride)
        dp_red = net.reduce_scatter_time(system, grad_bytes, dpe, dp_stride)
    if stage_expert and lay.dp > 1:
        dp_red += net.all_reduce_time(system, expert_grad_bytes, lay.dp, lay.ep * t)
    zero3_gather = 0.0
    if lay.zero_stage == 3:
        # Partitioned parameters are all-gathered for every pass of every micro-batch (ZeRO paper, Sec.
        # 7.2.3: 1.5x the all-reduce volume per step when m = 1). Without a pipeline gradients are
        # reduce-scattered after every backward; a pipeline accumulates them locally and reduce-scatters
        # once per step (podscale's pipeline ZeRO-2/3). Prefetching overlaps the collectives with compute;
        # what exceeds it is exposed.
        # The collectives run per unit, one per layer plus the root (embeddings, final norm), as podscale's
        # ZeRO-3 and FSDP wrap them (parallel/zero/layout.layer_units): each pays its own latency.
        gathers = 2 + (1 if lay.recompute == "full" else 0)
        units = n_slow + 1
        rs = units * net.reduce_scatter_time(system, grad_bytes / units, dpe, dp_stride)
        per_mb = (gathers * units * net.all_gather_time(system, grad_bytes / units, dpe, dp_stride)
                  + (rs if reduces_every_micro_batch(lay) else 0.0))
        zero3_gather = m * overlapped_exposed(dev, per_mb, comp_fwd + comp_bwd + comp_rec)
        dp_red -= net.all_reduce_time(system, grad_bytes, dpe, dp_stride)   # replaced by the above
        if not reduces_every_micro_batch(lay):
            dp_red += rs
    if p > 1:   # tied input/output embedding gradients between first and last stage
        dp_red += net.all_reduce_time(system, 2 * model.vocab * h / t, 2, (p - 1) * stride_pp)
    # ZeRO-2's reduce-scatter, m a step (ZeRO-3 pays its per-micro-batch one among its gathers above)
    reductions = m if lay.zero_stage == 2 and reduces_every_micro_batch(lay) and dpe > 1 else 1
    window = comp_bwd if lay.overlap_grad_reduce else 0.0
    last_bucket = dp_red / max(n_slow, 1)
    dp_exposed = reductions * (max(overlapped_exposed(dev, dp_red, window), last_bucket)
                               if lay.overlap_grad_reduce else dp_red) + zero3_gather + param_gather

    # The MoE layers' router and shared experts, and their experts unless folded, whole on every tp rank, have
    # partial gradients there, summed over tp in one all-reduce each time they are reduced (not overlapped:
    # after the data-parallel all-reduce, TensorParallelStrategy.finish_grad_sync; ZeRO before each
    # reduce-scatter, in the backward). Folded experts live on one rank: nothing to sum (RankParams.tp_summed).
    tp_grad_sum = 0.0
    if t > 1 and fullest.tp_summed:
        tp_grad_sum = ((m if reduces_every_micro_batch(lay) else 1)
                       * net.all_reduce_time(system, dev.dtype_bytes * fullest.tp_summed, t, 1))

    # ZeRO shards dense parameters over dp x ep, experts over dp (their replicas)
    local_params = stage_dense + stage_expert if lay.zero_stage == 0 else stage_dense / dpe + stage_expert / lay.dp
    # The device runs the optimizer unless it is offloaded to a host that is not the device itself.
    on_device = lay.offload_optimizer == "none" or (system.device_is_host and lay.offload_optimizer == "cpu")
    optimizer = optimizer_time(dev, ADAM_BYTES_PER_PARAM * local_params) if on_device else 0.0
    # the global norm, clipping and zeroing of the gradients this rank holds (all of them when replicated)
    grad_passes = grad_pass_time(dev, GRAD_PASS_BYTES_REPLICATED * (stage_dense + stage_expert)
                                 if lay.zero_stage == 0 else GRAD_PASS_BYTES_ZERO * local_params)
    if not lay.grad_accumulation_fusion:
        grad_passes += grad_pass_time(dev, gradient_bookkeeping_bytes(lay, m) * (stage_dense + stage_expert))
    offload = _offload_time(system, lay, local_params, stage_dense + stage_expert, m, comp_fwd + comp_bwd,
                            m * comp_fwd)

    breakdown = {
        "forward": m * comp_fwd, "backward": m * comp_bwd, "recompute": m * comp_rec,
        "tp_communication": m * n_slow * tp_comm + tp_grad_sum + (m * embed_tp if embed_slow else 0.0),
        "ep_communication": m * n_slow * ep_comm,
        "output_layer": m * head if slow_last else 0.0, "pp_p2p": p2p, "pipeline_bubble": bubble,
        "dp_communication": dp_exposed, "optimizer": optimizer, "grad_passes": grad_passes, "offload": offload,
    }
    step = sum(breakdown.values())
    # The same step split by kind of work, to set beside a profile (bench/plan_profile_step.py).
    nl = m * n_slow
    fwd_c = {"gemm": gemm, "attention": attn, "elementwise": ew, "host": launch, "routing": routing}
    bwd_c = {"gemm": per_layer("gemm_bwd"), "attention": per_layer("attn_bwd"),
             "elementwise": BWD_OVER_FWD * ew, "host": BWD_OVER_FWD * launch, "routing": per_layer("routing_bwd")}
    rec_c = dict({"none": {}, "selective": {"attention": attn}, "full": fwd_c}[lay.recompute])
    rec_c["elementwise"] = rec_c.get("elementwise", 0.0) + expert_rec
    components = {k: nl * (fwd_c[k] + bwd_c[k] + rec_c.get(k, 0.0)) for k in fwd_c}
    head_m = m if slow_last else 0
    components["gemm"] += head_m * head_gemm
    components["loss"] = head_m * head_loss
    components["collective"] = (breakdown["tp_communication"] + breakdown["ep_communication"] + head_m * head_tp
                                + breakdown["pp_p2p"] + dp_exposed)
    components.update(optimizer=optimizer, grad_passes=grad_passes, pipeline_bubble=bubble, offload=offload)

    # Memory of every pipeline rank; the fullest one is reported.
    mlp_scale = model.top_k * model.expert_load(lay.expert_group) if model.moe_layers else 1.0
    moe_kw = dict(mlp_scale=mlp_scale, shared_ffn=model.shared_ffn,
                  expert_rows_gathered=lay.expert_tensor_parallel_size)
    act_kw = dict(seq=s, microbatch=b, hidden=h, heads=model.heads, tp=t,
                  sequence_parallel=lay.sequence_parallel, ffn=model.ffn)
    # a fused attention kernel keeps no s x s tensors for its backward, as selective recompute does
    kept = "selective" if lay.fused_attention and lay.recompute == "none" else lay.recompute
    act_layer = ((1 - moe_frac) * activation_bytes_per_layer(recompute=kept, **act_kw)
                 + moe_frac * activation_bytes_per_layer(recompute=kept, gelu_recompute=model.expert_recompute,
                                                         **moe_kw, **act_kw))
    working = 0.0
    if lay.recompute == "full":   # one layer re-materialised during its backward (a fused attention kernel
        # keeps no s x s tensors then either)
        working = activation_bytes_per_layer(recompute="selective" if lay.fused_attention else "none",
                                             **moe_kw, **act_kw)
    prec = precision_of(dev.dtype_bytes)
    if lay.zero_stage == 3:   # current + prefetched block: the largest block as a rank holds it
        gathered = zero3_gathered_bytes(max(layer_rank_params(model, lay, moe).total
                                            for moe in {False, model.moe_layers > 0}), prec)
    else:
        gathered = 0.0
    logits_buf = 6 * logits_elems          # fp16 logits + fp32 softmax of the vocab-parallel loss
    memory, states, total_mem = {}, None, -1.0
    for r in candidates:
        dense_r, expert_r = params[r].dense, params[r].expert
        st = zero_model_state_bytes(dense_r, dpe, lay.zero_stage, lay.offload_optimizer, lay.offload_param, prec)
        if expert_r:
            es = zero_model_state_bytes(expert_r, lay.dp, lay.zero_stage, lay.offload_optimizer,
                                        lay.offload_param, prec)
            st = type(st)(st.device + es.device, st.host + es.host, st.nvme + es.nvme)
        if system.device_is_host:   # host memory is the device's: what is "offloaded to the CPU" stays in it
            st = type(st)(st.device + st.host, 0.0, st.nvme)
        # ZeRO-2/3 on a pipeline: the stage's full 16-bit gradient is accumulated over the micro-batches
        # before its one reduce-scatter, experts' (over dp) included (the partitioned gradient in ``st`` is
        # what outlives the step)
        pipeline_grads = (dev.dtype_bytes * (dense_r * (1 - 1 / dpe) + expert_r * (1 - 1 / lay.dp))
                          if lay.zero_stage >= 2 and p > 1 else 0.0)
        logits = logits_buf if r == p - 1 else 0.0
        acts = act_layer * pipeline_inflight_layers(rank_layers[r], p, m, lay.schedule, v, rank=r) + working
        mem = {"model_states": st.device, "activations": acts, "logits": logits, "zero3_gathered": gathered,
               "pipeline_grads": pipeline_grads, "reserved": dev.reserved_bytes}
        if sum(mem.values()) > total_mem:
            memory, states, total_mem = mem, st, sum(mem.values())

    # ZeRO-3 on a CPU gives its heap back to the OS at the end of every step (ZeroStrategy calls
    # hostmem.trim_heap: what keeps its peak RSS at FSDP2's), so each step writes its activations and gathered
    # blocks into pages the OS faults in again, at the calibrated first-touch rate.
    if lay.zero_stage == 3 and system.device_is_host and dev.first_touch_bw:
        refault = (memory["activations"] + memory["logits"] + memory["zero3_gathered"]) / dev.first_touch_bw
        breakdown["first_touch"] = components["first_touch"] = refault
        step += refault
    tokens = batch * s
    model_flops, extra = _flops(model, lay, tokens)
    notes = []
    if total_mem > dev.memory_bytes:
        notes.append(f"does not fit: needs {total_mem / 2**30:.1f} GiB of {dev.memory_bytes / 2**30:.1f} GiB")
    if model.moe_layers and model.dropless and lay.expert_group > 1:
        notes.append(f"dropless MoE: the busiest ep rank priced at {model.expert_load(lay.expert_group):g}x the mean "
                     "expert rows (dropless_peak_load; a training run logs the measured peak_rank_load)")
    layout = lay.to_dict()
    if p > 1:
        layout["pipeline_layers"] = list(pipeline_chunks(model, lay))
    return Prediction(
        system=system.name, devices=devices, batch=batch, model=model.name, layout=layout,
        step_time_s=step, time_breakdown_s=breakdown, memory_per_device_bytes=total_mem,
        memory_breakdown_bytes=memory, memory_capacity_bytes=dev.memory_bytes,
        host_memory_per_device_bytes=states.host, hardware_flops_per_step=model_flops + extra,
        model_flops_per_step=model_flops, tokens_per_step=tokens, peak_flops_per_device=dev.peak_flops,
        notes=notes, components_s=components)


def step_components(system: System, devices: int, model: GPT, lay: Layout, batch: int) -> dict:
    """Seconds of one step by kind of work (GEMMs, fused attention, element-wise, loss, per-kernel host
    overhead, exposed collectives, optimizer, pipeline bubble, offload); they sum to the step time."""
    return predict_gpt(system, devices, model, lay, batch).components_s


def _flops(model: GPT, lay: Layout, tokens: float) -> tuple[float, float]:
    """(model FLOPs, recompute FLOPs) of one step: per layer 8 T h^2 (QKV, output), 4 T s h (scores,
    values), 4 T h ffn (MLP; in MoE, ``GPT.active_ffn``: top_k experts and the shared experts per token),
    x3 for forward and backward, plus the vocabulary projection 6 T h V (Narayanan et al. SC'21, Sec. 5.1)."""
    h, s, L = model.hidden, model.seq, model.layers
    moe_frac = model.moe_layers / L
    mlp_fwd = 4 * tokens * h * ((1 - moe_frac) * model.active_ffn() + moe_frac * model.active_ffn(moe=True))
    layer_fwd_flops = 8 * tokens * h * h + 4 * tokens * s * h + mlp_fwd
    model_flops = 3 * L * layer_fwd_flops + 6 * tokens * h * model.vocab
    extra = {"none": 0.0, "selective": L * 4 * tokens * s * h, "full": L * layer_fwd_flops}[lay.recompute]
    return model_flops, extra


def _offload_time(system: System, lay: Layout, local_params: float, stage_params: float, m: int,
                  compute_per_mb: float, forward: float = 0.0) -> float:
    """ZeRO-Offload / ZeRO-Infinity traffic that the step waits for (Ren et al. 2021; Rajbhandari et al.
    2021): the optimizer partition's gradients go down and parameters come back over PCIe, CPU Adam
    streams its state through host memory (shared by the node's devices), NVMe adds a read and a write
    of the 12-byte state; offloaded parameters are fetched every pass, hidden behind compute if fast.
    At ZeRO-3 podscale streams the NVMe optimizer step under the next step's ``forward`` (each layer
    waits only for its own update: ``zero.nvme_overlap_step``), so only the excess over it is exposed."""
    host, per_node = system.host, system.devices_per_node
    t = 0.0
    if system.device_is_host and lay.offload_optimizer == "cpu":
        # The device is the host CPU: nothing moves, the device's own optimizer step runs (priced as
        # ``optimizer``), and what remains is podscale's copy of the updated fp32 partition into the
        # separate buffer the forward reads (the master is never aliased to compute buffers under
        # offload: parallel/zero/flat_state.py), 4 bytes read and written per local parameter.
        t += 2 * 4 * local_params / (system.device.memory_bw * system.device.memory_efficiency)
    elif lay.offload_optimizer != "none":
        opt = 4 * local_params / max(host.pcie_bw, 1.0)
        opt += ADAM_BYTES_PER_PARAM * local_params / max(host.memory_bw / per_node, 1.0)
        if lay.offload_optimizer == "nvme":
            opt += 2 * 12 * local_params / max(host.nvme_bw / per_node, 1.0)
            if lay.zero_stage == 3:
                opt = max(0.0, opt - forward)
        t += opt
    if lay.offload_param != "none":
        bw = host.pcie_bw if lay.offload_param == "cpu" else min(host.pcie_bw, host.nvme_bw / per_node)
        fetch = 2 * 2 * stage_params / lay.data_parallel / max(bw, 1.0)
        t += m * max(0.0, fetch - compute_per_mb)
    return t


def predict_weight_streaming(system: System, devices: int, model: GPT, lay: Layout, batch: int,
                             m: int) -> Prediction:
    """A Cerebras CS-2 cluster in weight-streaming mode (Lie, "Cerebras Architecture Deep Dive", Hot Chips
    34, 2022; Hot Chips 33, 2021): every wafer runs the whole model, layer by layer, on its share of the
    batch (data parallelism only). Weights live in MemoryX, which also keeps the optimizer state and runs
    the update; for each micro-batch every layer's 16-bit weights stream in for the forward and again for
    the backward, and its 16-bit gradients stream out, SwarmX broadcasting the weights to and reducing
    the gradients of all wafers in a tree on the way (so the reduction costs no extra wafer I/O).
    Streaming of layer i+1 overlaps the compute of layer i, so a layer takes the longer of the two:

        micro-batch = sum over layers of max(compute_layer, 3 x 2 bytes x layer params / I/O bandwidth)
        step        = m x micro-batch + output layer + MemoryX's optimizer pass over the 16-byte state

    The wafer's SRAM holds the micro-batch's activations and the streamed layer (current and next, weights
    and gradients); it holds no model states. The micro-batch is the wafer's batch per pass: larger ones
    amortise the streamed weights."""
    dev = system.device
    b, s, h, V = lay.microbatch, model.seq, model.hidden, model.vocab
    L = model.layers
    moe_frac = model.moe_layers / L
    dense_t = _layer_times(system, model, lay, moe=False)
    moe_t = _layer_times(system, model, lay, moe=True) if model.moe_layers else dense_t

    def per_layer(key):
        return (1 - moe_frac) * dense_t[key] + moe_frac * moe_t[key]

    attn, ew = per_layer("attn"), per_layer("ew")
    fwd = per_layer("gemm") + attn + ew
    bwd = per_layer("gemm_bwd") + per_layer("attn_bwd") + BWD_OVER_FWD * ew
    rec = {"none": 0.0, "selective": attn, "full": fwd}[lay.recompute]
    layer_params = (1 - moe_frac) * model.layer_params(moe=False) + moe_frac * model.layer_params(moe=True)
    io = system.stream.effective
    stream_layer = 3 * dev.dtype_bytes * layer_params / io + system.stream.latency * _tree_depth(devices)
    compute_layer = fwd + bwd + rec
    exposed = max(0.0, stream_layer - compute_layer)
    head = (3 * gemm_time(dev, b * s, V, h, bytes_per_element=dev.dtype_bytes)
            + stream_time(dev, CROSS_ENTROPY_BYTES * b * s * V))
    head_stream = max(0.0, 3 * dev.dtype_bytes * V * h / io - head)     # the (tied) embedding streams too
    optimizer = ADAM_BYTES_PER_PARAM * model.params / max(system.host.memory_bw, 1.0)
    breakdown = {"forward": m * L * fwd, "backward": m * L * bwd, "recompute": m * L * rec,
                 "tp_communication": 0.0, "output_layer": m * head,
                 "weight_streaming": m * (L * exposed + head_stream), "dp_communication": 0.0,
                 "optimizer": optimizer}
    step = sum(breakdown.values())

    act_kw = dict(seq=s, microbatch=b, hidden=h, heads=model.heads, tp=1, ffn=model.ffn)
    kept = "selective" if lay.fused_attention and lay.recompute == "none" else lay.recompute
    act = L * activation_bytes_per_layer(recompute=kept, **act_kw)
    if lay.recompute == "full":
        act += activation_bytes_per_layer(recompute="selective" if lay.fused_attention else "none", **act_kw)
    largest = max(model.layer_params(moe=model.moe_layers > 0), V * h)
    memory = {"activations": act, "logits": 6 * b * s * V,
              "streamed_layers": 2 * 2 * dev.dtype_bytes * largest,     # current + next, weights + gradients
              "model_states": 0.0, "reserved": dev.reserved_bytes}
    total_mem = sum(memory.values())
    model_flops, extra = _flops(model, lay, batch * s)
    notes = []
    if total_mem > dev.memory_bytes:
        notes.append(f"does not fit: needs {total_mem / 2**30:.1f} GiB of {dev.memory_bytes / 2**30:.1f} GiB "
                     "of wafer memory; use a smaller micro-batch or recompute")
    memx = 16 * model.params                                    # weights + Adam state in MemoryX
    return Prediction(
        system=system.name, devices=devices, batch=batch, model=model.name, layout=lay.to_dict(),
        step_time_s=step, time_breakdown_s=breakdown, memory_per_device_bytes=total_mem,
        memory_breakdown_bytes=memory, memory_capacity_bytes=dev.memory_bytes,
        host_memory_per_device_bytes=memx / devices, hardware_flops_per_step=model_flops + extra,
        model_flops_per_step=model_flops, tokens_per_step=batch * s, peak_flops_per_device=dev.peak_flops,
        notes=notes)


def _tree_depth(n: int) -> int:
    """Levels of SwarmX's broadcast/reduce tree over n wafers (binary fan-out)."""
    depth = 0
    while (1 << depth) < n:
        depth += 1
    return depth
