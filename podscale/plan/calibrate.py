"""``podscale plan calibrate``: measure this machine and write the ``local`` system file.

What is measured, with ``ranks`` worker processes running *at the same time* (as ``podscale train``
runs them, so they share cores, caches and memory bandwidth), each with cores/ranks torch threads:
  - matmul FLOP/s by shape (float32, torch on CPU): squares and transformer-like rectangles, each in the
    three forms a linear layer runs (forward addmm with the transposed weight, input and weight gradients),
    outputs allocated as autograd allocates them, operands cycled through COLD_BYTES of copies (a step's GEMMs
    find theirs outside the core's L2); the grid is measured in GEMM_PASSES whole passes and each
    shape keeps its median pass (a slow spell of a shared machine hits neighbouring shapes of one pass);
  - fused causal attention (scaled_dot_product_attention) forward and backward by sequence and head size:
    on a CPU it runs far below the matmul rate, so it is measured, not derived from GEMMs;
  - memory bandwidth: a large tensor copy (bytes read + written per second) per rank, and the rate of
    a GPT layer's element-wise kernels forward and backward through autograd (on a CPU they are
    compute-bound, below the copy rate) at several activation sizes (faster while the activations stay in
    cache), and the host cost per kernel of the same layer run at a size where its kernels do no work;
  - gloo all-reduce time by message size over ``ranks`` processes; a least-squares fit of the ring
    model t(S) = 2(n-1) alpha + 2(n-1)/n * S / B (Thakur et al. 2005) gives latency alpha and bandwidth B;
  - the cost of a collective issued *between compute kernels*, as the trainer issues its tensor-parallel
    all-reduces (several per layer): each rank multiplies, then all ranks all-reduce a tensor-parallel-sized
    message. The ranks reach the collective at different moments and each waits for the last one; and on
    gloo a collective's time is two-valued (:func:`expected_time`: its thread hand-offs now and then wait for
    a scheduler tick), so a step with tens of collectives pays their *mean*, which low percentiles of
    back-to-back timings after a barrier never see. The mean pair less the mean multiply, beyond the ring
    model's t(S), is each link's ``sync_wait_us``, which every collective and message of a step pays once
    (``System.collective_wait``); and the same all-reduce issued
    asynchronously under a matmul, as the tensor-parallel backward overlaps the input gradient's
    all-reduce with the weight gradient: what it costs beyond the longer of the two is the device's
    ``overlap_penalty_us`` (the collective's thread competes with the compute threads for the cores);
    and a bucket-sized (8 MiB) all-reduce under matmuls that outlast it: the fraction of its own time the
    overlapped pair still adds (``overlap_exposed``), which the data-parallel gradient reduction, ZeRO-3's
    prefetched gathers and the tensor-parallel backward pay instead of assuming the overlap hides it;
  - the optimizer step as podscale runs it (torch's fused AdamW) and the gradient passes of every step
    (global norm, clipping, zeroing): memory-bound streams with their own rates (``optimizer_gbps``,
    ``grad_pass_gbps``), which the element-wise (compute-bound on a CPU) rate misprices.
The rendezvous store listens on 127.0.0.1 only and gloo is pinned to the loopback interface.
"""
from __future__ import annotations

import datetime as _dt
import itertools
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path

from .hardware import GB, GiB, local_system_path

# A log-spaced grid of (m, n, k) covering what a GPT trained on a CPU multiplies: forward (tokens x out x in),
# input gradients and weight gradients (in x out x tokens), attention (seq x seq x head_dim).
GRID_M = (64, 256, 1024, 4096)
# Steps of 2 from 128 up: a CPU core's rate falls by about half once a GEMM's operands outgrow its L2 cache
# (here 4 MiB: a 1024 x 1024 fp32 weight), and a log-space interpolation across a 4x step (512 -> 2048)
# put that cliff in the wrong place for the widths in between (a 640-wide model's 640 x 2560 weights).
GRID_NK = (32, 128, 256, 512, 1024, 2048)
# Passes over the whole grid; each shape keeps its median pass (:func:`gemm_table_from_passes`).
GEMM_PASSES = 3
# Interleaved rounds of the overlapped-all-reduce measurement (:func:`overlap_exposed`).
OVERLAP_ROUNDS = 5
# Iterations per round of the collective-between-kernels timings (pooled over the rounds: 300 samples).
SYNC_REPS = 60
QUICK_M, QUICK_NK = (256, 2048), (128, 1024)
ALLREDUCE_BYTES = (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
SYNC_BYTES = 1 << 19          # a tensor-parallel activation on a CPU: 8 x 128 tokens x 128 wide, float32
BUCKET_BYTES = 1 << 23        # a gradient bucket / ZeRO-3 gather unit of a small model: 8 MiB
SYNC_GEMM = 384               # the multiply between two collectives (~0.1 GFLOP: one layer's linear)


def low_percentile(times, q: float = 0.2) -> float:
    """The q-quantile of repeated timings. On a shared machine other work only ever slows a run down,
    so a low percentile estimates the uncontended time better than the median or the mean; the bench
    that compares predictions with `podscale train` uses the same statistic."""
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _timeit(fn, budget: float, min_reps: int = 5) -> float:
    """Low-percentile seconds of ``fn`` over repetitions filling about ``budget`` seconds (after a warm-up)."""
    fn()
    times, start = [], time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < budget:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) > 200:
            break
    return low_percentile(times)


def _worker(rank: int, ranks: int, port: int, quick: bool, out_path: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    threads = max(1, (os.cpu_count() or 1) // ranks)
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, world_size=ranks, is_master=False,
                          timeout=_dt.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks,
                            timeout=_dt.timedelta(seconds=120))   # fail rather than hang
    budget = 0.01 if quick else 0.04
    ms, nks = (QUICK_M, QUICK_NK) if quick else (GRID_M, GRID_NK)
    shapes = [(m, n, k) for m in ms for n in nks for k in nks]
    passes = []
    for _ in range(1 if quick else GEMM_PASSES):
        seconds = []
        for m, n, k in shapes:
            dist.barrier()
            seconds.append(_linear_gemm_seconds(torch, m, n, k, budget))
        passes.append(seconds)
    table = gemm_table_from_passes(shapes, passes)
    attention = _attention_table(dist, torch, budget, quick)
    n_el = (4 if quick else 16) * 1024 * 1024          # 16 / 64 MiB float32 per buffer
    src, dst = torch.randn(n_el), torch.empty(n_el)
    dist.barrier()
    sec = _timeit(lambda: dst.copy_(src), budget * 4)
    mem_bw = 2 * 4 * n_el / sec
    optimizer_bw, grad_pass_bw = _optimizer_and_grad_passes(dist, torch, n_el // 4, budget * 4)
    dist.barrier()
    elementwise_table, kernel_overhead = _layer_elementwise_and_host(
        torch, budget * 4, ELEMENTWISE_SIZES[:2] if quick else ELEMENTWISE_SIZES)
    ref = 4 * ELEMENTWISE_REFERENCE[0] * ELEMENTWISE_REFERENCE[1]
    elementwise_bw = next(r for b, r in elementwise_table if b == ref)
    dist.barrier()
    routing_table = moe_routing_table(torch, budget * 4, ROUTING_SIZES[::2] if quick else ROUTING_SIZES)
    sizes = ALLREDUCE_BYTES[::2] if quick else ALLREDUCE_BYTES
    ar = []
    for nbytes in sizes:
        buf = torch.ones(nbytes // 4)
        # A collective must run the same number of times on every rank, so the repetitions are fixed
        # by size rather than by each rank's own clock (which would deadlock).
        reps = 30 if nbytes <= 1 << 16 else 10 if nbytes <= 1 << 20 else 4
        dist.all_reduce(buf)
        dist.barrier()
        times = []
        for _ in range(reps // (2 if quick else 1)):
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t0)
        ar.append([nbytes, low_percentile(times)])
    sharded = _sharded_collectives(torch, ranks, SHARDED_BYTES[::2] if quick else SHARDED_BYTES, quick)
    sync = _sync_wait(dist, torch, 10 if quick else SYNC_REPS)
    dist.barrier()
    first_touch_bw = _first_touch(torch, budget * 4)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"matmul": table, "attention": attention, "memory_bw": mem_bw, "elementwise_bw": elementwise_bw,
                       "elementwise": elementwise_table, "routing": routing_table,
                       "kernel_overhead": kernel_overhead, "allreduce": ar, "threads": threads,
                       "optimizer_bw": optimizer_bw, "grad_pass_bw": grad_pass_bw, "first_touch_bw": first_touch_bw,
                       "sync": sync, **sharded}, f)
    dist.barrier()
    dist.destroy_process_group()


def gemm_table_from_passes(shapes, passes) -> list:
    """[m, n, k, FLOP/s] rows from ``passes`` (lists of seconds, one per shape, in ``shapes``' order): each
    shape's median pass. The grid is measured in whole passes rather than shape by shape with more
    repetitions because what slows a measurement on a shared machine (another process, the other rank's
    gloo thread, a frequency change) lasts longer than one shape's few milliseconds: within one pass it hits
    a run of neighbouring shapes, which a log-space interpolation then passes on to every GEMM near them
    (one pass gave 78 GFLOP/s at (256, 128, 128) and 110 at (1024, 128, 128), which priced the GEMMs of two
    micro-batches of 4 sequences at 1.4x those of one of 8; measured again, the two come out alike). A spell
    that hits one pass is out-voted by the others. The median, not the fastest pass: the trainer's GEMMs
    run beside the other rank's and its gloo thread and do not get the best pass (with the fastest of three
    passes, the table priced a 640-wide layer's twelve GEMMs at 0.87 of their time on two ranks in the
    trainer's order and forms, ``bench/plan_gemm_sequence.py``)."""
    return [[m, n, k, 2.0 * m * n * k / statistics.median(p[i] for p in passes)]
            for i, (m, n, k) in enumerate(shapes)]


# Bytes of operands each GEMM shape cycles through: in a training step a GEMM's operands were written by other
# kernels since their last use (the rest of the layer, the other layers) and come from the shared L3 or
# memory, not from the core's L2 (0.5-2 MiB a core); one set reused back to back stays in L2. Measured on
# this CPU with one thread: a 128-wide layer's GEMMs (1024 x 384 x 128 ... 512 x 128 x 1024) ran 5-12 % slower
# cycling 24 sets than reusing one, and a profiled step of a 4 x 128 GPT on 2 ranks ran its GEMMs 11 % over
# the table of hot operands; a 640-wide layer's (whose operands outgrow L2 anyway) run alike either way.
COLD_BYTES = 8 << 20


def gemm_operand_sets(m: int, n: int, k: int) -> int:
    """How many operand sets of an (m x k) @ (k x n) linear layer's three forms add up to COLD_BYTES (at
    least one)."""
    set_bytes = 4 * (2 * m * k + 2 * n * k + n)
    return max(1, -(-COLD_BYTES // set_bytes))


def _linear_gemm_seconds(torch, m: int, n: int, k: int, budget: float) -> float:
    """Mean seconds of an (m x k) @ (k x n) product in the three forms a linear layer runs it (torch's
    nn.Linear and its autograd): the forward's addmm with a bias and the transposed weight, the input
    gradient's plain product, the weight gradient's product with a transposed first operand; each
    allocates its output, as autograd does, and reads its operands from the next of
    :func:`gemm_operand_sets` sets, as a training step's GEMMs find theirs outside the core's cache. A product
    of two contiguous operands into a preallocated output, the simplest thing to time, runs 5-20 % faster on
    a CPU than these."""
    sets = [(torch.randn(m, k), torch.randn(n, k), torch.randn(n), torch.randn(k, n), torch.randn(k, m))
            for _ in range(gemm_operand_sets(m, n, k))]
    forms = (lambda x, w, bias, b, xt: torch.addmm(bias, x, w.t()),
             lambda x, w, bias, b, xt: torch.mm(x, b),
             lambda x, w, bias, b, xt: torch.mm(xt.t(), b))

    def cycling(form):
        turn = itertools.count()
        return lambda: form(*sets[next(turn) % len(sets)])
    return sum(_timeit(cycling(f), budget / len(forms), min_reps=3) for f in forms) / len(forms)


ATTENTION_SEQ = (64, 128, 256, 512)
ATTENTION_HEAD_DIM = (32, 64, 128)
ATTENTION_HEADS = 16           # batch x heads of one measurement; time scales linearly in it


def _attention_table(dist, torch, budget: float, quick: bool) -> list:
    """[seq, head_dim, forward FLOP/s, backward FLOP/s] of torch's fused causal attention
    (``scaled_dot_product_attention(is_causal=True)``, what podscale's GPT calls) on inputs that record
    autograd, the backward timed on its own; both rates count the forward's 2 s^2 d FLOPs per head
    (:func:`podscale.plan.compute.attention_time`)."""
    import torch.nn.functional as F
    rows = []
    for s in (ATTENTION_SEQ[1:3] if quick else ATTENTION_SEQ):
        for d in (ATTENTION_HEAD_DIM[:2] if quick else ATTENTION_HEAD_DIM):
            q, k, v = (torch.randn(1, ATTENTION_HEADS, s, d, requires_grad=True) for _ in range(3))
            grad = torch.randn(1, ATTENTION_HEADS, s, d)

            def forward():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            dist.barrier()
            fwd = _timeit(forward, budget)
            bwd = []
            for _ in range(5 if quick else 10):
                y = forward()
                t0 = time.perf_counter()
                torch.autograd.grad(y, (q, k, v), grad)
                bwd.append(time.perf_counter() - t0)
            bwd = low_percentile(bwd)
            flops = 2.0 * s * s * d * ATTENTION_HEADS
            rows.append([s, d, flops / fwd, flops / bwd])
    return rows


def _gpt_layer(torch, tokens: int, hidden: int, seq: int, full: bool):
    """One pre-norm GPT layer's kernels as podscale's model runs them, forward then backward through
    autograd. ``full``: the whole layer (layer norms, QKV, causal scaled_dot_product_attention, output
    projection, residual adds, tanh-GELU MLP); otherwise only its element-wise and layout kernels outside
    the GEMMs and the attention core (layer norm, the attention context's heads back into rows (a copy),
    residual add, layer norm, GELU, residual add), each GEMM's or attention's output a leaf. Returns a
    function that runs the forward and backward once."""
    import torch.nn.functional as F
    h, heads = hidden, max(1, hidden // 64)
    seqs = tokens // seq

    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)
    x, w1, b1, w2, b2 = leaf(tokens, h), leaf(h), leaf(h), leaf(h), leaf(h)
    if full:
        weights = (leaf(3 * h, h), leaf(3 * h), leaf(h, h), leaf(h), leaf(4 * h, h), leaf(4 * h), leaf(h, 4 * h),
                   leaf(h))
        leaves = (x, w1, b1, w2, b2) + weights
    else:
        attn_proj, fc, mlp_proj = leaf(tokens, h), leaf(tokens, 4 * h), leaf(tokens, h)
        context = leaf(seqs, heads, seq, h // heads)             # attention's output, heads first
        leaves = (x, w1, b1, w2, b2, attn_proj, fc, mlp_proj, context)

    def run():
        n1 = F.layer_norm(x, (h,), w1, b1)
        outs = []
        if full:
            wq, bq, wo, bo, wf, bf, wp, bp = weights
            q, k, v = (t.view(seqs, seq, heads, h // heads).transpose(1, 2)
                       for t in F.linear(n1, wq, bq).chunk(3, dim=1))
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            r1 = x + F.linear(ctx.transpose(1, 2).reshape(tokens, h), wo, bo)
            n2 = F.layer_norm(r1, (h,), w2, b2)
            out = r1 + F.linear(F.gelu(F.linear(n2, wf, bf), approximate="tanh"), wp, bp)
        else:
            outs.append(context.transpose(1, 2).reshape(tokens, h))
            r1 = x + attn_proj
            n2 = F.layer_norm(r1, (h,), w2, b2)
            outs += [n1, n2, F.gelu(fc, approximate="tanh")]
            out = r1 + mlp_proj
        outs.append(out)
        torch.autograd.grad(outs, leaves, grad_outputs=[torch.ones_like(o) for o in outs])
    return run


# (tokens, hidden) at which a GPT layer's element-wise kernels are timed: activations of 96 KiB to 8 MiB,
# from inside a core's L2 (4 MiB here) to beyond it. The rate depends on that size (a small micro-batch's
# activations stay in cache between kernels), so the planner interpolates by the layer's activation size
# instead of applying one rate to all. The sizes are none of the benchmarks' models (bench/plan_*.py), so
# that those measure the interpolation, not a copy of a calibrated point. The reference size is the one
# ``elementwise_gbps`` reports.
ELEMENTWISE_SIZES = ((256, 96), (768, 192), (1536, 384), (4096, 512))
ELEMENTWISE_REFERENCE = (768, 192)


def _layer_elementwise_and_host(torch, budget: float, sizes=ELEMENTWISE_SIZES) -> tuple[list, float]:
    """([[activation bytes, element-wise bytes/s], ...], host seconds per kernel) from one GPT layer
    (:func:`_gpt_layer`), forward and backward. The element-wise and layout kernels alone are timed at each
    of ``sizes`` (tokens x hidden; the activation bytes are those of one fp32 tokens x hidden tensor) and at a
    size where they do no work (8 x 8); the difference is their work, priced in the planner's own byte count
    of it (``gpt_cost.layer_elementwise_bytes``, forward + BWD_OVER_FWD x forward).
    The whole layer at the small size is the host cost of a layer's kernels (Python, dispatcher, autograd's
    engine), spread over the planner's KERNELS_PER_LAYER forward kernels and their backward. The rates of
    single forward kernels on a large tensor (GELU, layer norm, softmax) and of one small forward op, which
    these replace, missed the backward's kernels, the tanh GELU, the layout copy and autograd's engine
    between them (a profiled step: element-wise work 1.5-2x the planner's term, host cost 2-4x)."""
    from .gpt_cost import BWD_OVER_FWD, KERNELS_PER_LAYER, layer_elementwise_bytes
    small = _timeit(_gpt_layer(torch, 8, 8, 8, full=False), budget)
    host = _timeit(_gpt_layer(torch, 8, 8, 8, full=True), budget)
    rows = []
    for tokens, hidden in sizes:
        big = _timeit(_gpt_layer(torch, tokens, hidden, 128, full=False), budget)
        nbytes = (1 + BWD_OVER_FWD) * layer_elementwise_bytes(tokens, hidden, 4 * hidden, dtype_bytes=4)
        rows.append([4 * tokens * hidden, nbytes / max(big - small, 1e-9)])
    return rows, host / (KERNELS_PER_LAYER * (1 + BWD_OVER_FWD))


# (tokens, experts, hidden) at which an MoE layer's work beyond its GEMMs is timed (top-2, capacity 1.25,
# groups of 128 tokens): none of the benchmarks' models (bench/plan_local_vs_train.py's GPT-MoE routes 1,024 or
# 512 tokens a rank over 8 experts, 128 wide), so that those measure the interpolation, not a calibrated point.
ROUTING_SIZES = ((256, 16, 256), (2048, 16, 256), (8192, 32, 384))


def moe_routing_table(torch, budget: float, sizes=ROUTING_SIZES) -> list:
    """[[bytes, bytes/s], ...]: an MoE layer's work beyond its GEMMs, at each of ``sizes``: podscale's layer itself
    (``MoELayer`` on one rank, top-2, capacity 1.25, groups of 128 tokens, experts as wide as the model), forward
    and backward of its output and losses, less its experts run alone on the rows it dispatched (``Experts``, as
    the layer calls them) and its router's linear alone: the routing, the aux and z losses, the dispatch and
    combine, and the layer's own bookkeeping and autograd nodes between them, which a copy of the routing kernels
    alone missed (BENCHMARKS.md, the GPT-MoE's price taken apart). The bytes are the planner's count of the
    routing, dispatch and combine kernels (``gpt_cost.moe_routing_bytes``, forward + backward), so the planner
    prices that work at the rate measured here (the experts and the router are priced as GEMMs). On a CPU these
    many small sorting, counting and indexing kernels run far below the element-wise rate, and faster per byte
    the larger they are, so the rate is a table by size."""
    from podscale.parallel.moe import MoELayer
    from .gpt_cost import moe_routing_bytes
    rows, k, seq = [], 2, 128
    for tokens, experts, hidden in sizes:
        torch.manual_seed(0)
        layer = MoELayer(hidden, hidden, experts, top_k=k, capacity_factor=1.25, random_routing=False)
        x = torch.randn(tokens // seq, seq, hidden, requires_grad=True)
        gy, one = torch.randn(tokens // seq, seq, hidden), torch.ones(())
        _, out = layer(x, None)
        segments = list(enumerate(out.routing.counts.tolist()))
        dispatched = torch.randn(sum(n for _, n in segments), hidden, requires_grad=True)
        g_rows = torch.randn(dispatched.shape)
        flat = x.detach().reshape(tokens, hidden).requires_grad_()

        def whole():
            y, o = layer(x, None)
            torch.autograd.backward([y, o.loss], [gy, one])

        def experts_alone():
            layer.experts(dispatched, segments).backward(g_rows)

        def router_alone():
            layer.router(flat).sum().backward()

        def timed(fn):
            def step():
                layer.zero_grad(set_to_none=True)
                x.grad = dispatched.grad = flat.grad = None
                fn()
            return _timeit(step, budget)
        total = timed(whole)
        rest = total - timed(experts_alone) - timed(router_alone)
        if rest <= 0:
            raise RuntimeError(f"MoE routing calibration at {tokens} tokens: the layer ({total * 1e3:.2f} ms) timed no "
                               "slower than its experts and router alone; the machine is busy: calibrate again "
                               "when it is idle")
        nbytes = sum(moe_routing_bytes(tokens, experts, k, hidden, 4))
        rows.append([nbytes, nbytes / rest])
    return rows


def _optimizer_and_grad_passes(dist, torch, n: int, budget: float) -> tuple[float, float]:
    """Bytes/s of the per-step work on parameters and gradients as the trainer runs it, over ``n`` fp32
    parameters in 16 tensors: torch's fused AdamW step (what podscale's replicated and ZeRO optimizers call,
    ``torch._fused_adamw_``), counted as the planner's ADAM_BYTES_PER_PARAM per parameter; and the
    gradient passes of every replicated step (the global norm of ``torch.nn.utils.get_total_norm``,
    clipping by ``_foreach_mul_``, zeroing), counted as GRAD_PASS_BYTES_REPLICATED per parameter. Both
    are memory-bound streams whose rate differs from that of the compute-bound element-wise kernels."""
    from .gpt_cost import ADAM_BYTES_PER_PARAM, GRAD_PASS_BYTES_REPLICATED
    params = [torch.nn.Parameter(torch.randn(n // 16)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    dist.barrier()
    opt_s = _timeit(opt.step, budget)
    grads = [p.grad for p in params]

    def passes():
        torch.nn.utils.get_total_norm(grads, foreach=True)
        torch._foreach_mul_(grads, 1.0)
        torch._foreach_zero_(grads)
    dist.barrier()
    pass_s = _timeit(passes, budget)
    total = 16 * (n // 16)
    return ADAM_BYTES_PER_PARAM * total / opt_s, GRAD_PASS_BYTES_REPLICATED * total / pass_s


FIRST_TOUCH_BYTES = 16 << 20   # a buffer of the size ZeRO-3 gathers and activations come in on a CPU


def _first_touch(torch, budget: float) -> float:
    """Bytes/s of filling memory whose pages the process gave back to the OS, as ZeRO-3 on a CPU leaves its
    heap at the end of every step (``ZeroStrategy`` fixes glibc's mmap threshold and calls
    :func:`podscale.runtime.hostmem.trim_heap` once a step, so the next step faults its gathered blocks and
    activations back in): with ZeRO-3's malloc settings, a FIRST_TOUCH_BYTES buffer released, the heap
    trimmed, the buffer regrown and filled. Runs last (it changes this process's malloc settings). A probe of
    the 12 x 640 GPT's ZeRO-3 step: 30,000-47,000 page faults a step with the trim, 1,800-4,800 without,
    2.85 against 2.68 s."""
    from podscale.runtime import hostmem
    hostmem.set_mmap_threshold(hostmem.DEFAULT_MMAP_THRESHOLD)
    src = torch.ones(FIRST_TOUCH_BYTES // 4)
    buf = torch.empty_like(src)

    def refill():
        buf.untyped_storage().resize_(0)
        hostmem.trim_heap()
        buf.untyped_storage().resize_(FIRST_TOUCH_BYTES)
        t0 = time.perf_counter()
        buf.copy_(src)
        return time.perf_counter() - t0
    refill()
    times, start = [], time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < budget:
        times.append(refill())
    return FIRST_TOUCH_BYTES / low_percentile(times)


SHARDED_BYTES = (1 << 20, 1 << 22, 1 << 24)     # ZeRO's gradient buckets and parameter blocks on a CPU


def _sharded_collectives(torch, ranks: int, sizes, quick: bool) -> dict:
    """[[bytes, seconds], ...] of ZeRO's reduce-scatter and all-gather over all ranks as the trainer issues
    them (:mod:`podscale.runtime.comm` on a ``dp`` mesh axis; ``bytes`` is the full, unsharded buffer). They are
    not the halves of the ring all-reduce that the planner's network model assumes everywhere else: on gloo
    comm issues one reduce (broadcast) per rank onto (from) its slice, and under load on this 2-core machine
    the reduce-scatter of 4-64 MiB took 0.8-1.2x a whole all-reduce of the same buffer, the all-gather
    0.35-0.6x (A/B in one process), where the ring model says 0.5x both."""
    import torch.distributed as dist
    from podscale.runtime import comm
    from podscale.runtime.mesh import Mesh
    mesh = Mesh.build(dp=ranks)
    out = {"reduce_scatter": [], "all_gather": []}
    for nbytes in sizes:
        full = torch.ones(nbytes // 4, device=mesh.device)
        shard = torch.empty(full.numel() // ranks, device=mesh.device)
        ops = {"reduce_scatter": lambda: comm.reduce_scatter(shard, full, mesh, "dp", scratch_input=True),
               "all_gather": lambda: comm.all_gather(full, shard, mesh, "dp")}
        reps = (10 if nbytes <= 1 << 20 else 4) // (2 if quick else 1)
        for name, op in ops.items():
            op()
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                op()
                times.append(time.perf_counter() - t0)
            out[name].append([nbytes, low_percentile(times)])
    return out


def sharded_bandwidth(data: dict, name: str, ranks: int) -> float:
    """Bandwidth B of the measured ``name`` collective (``reduce_scatter`` or ``all_gather``) in the half-ring
    model the planner prices it with, t(S) = (n-1) alpha + (n-1)/n * S / B, alpha the all-reduce's (back to
    back): the fastest over the samples of at least 4 MiB, where the bandwidth term dominates (two or three
    samples are too few to fit both parameters under noise). 0 when not measured (files from before this
    measurement: the planner then prices the ring)."""
    samples = data.get(name)
    if not samples:
        return 0.0
    alpha = fit_ring(data["allreduce"], ranks)[0]
    large = [(s, t) for s, t in samples if s >= 1 << 22] or samples
    return max((ranks - 1) / ranks * s / max(t - (ranks - 1) * alpha, 1e-9) for s, t in large)


def expected_time(times) -> float:
    """The mean of repeated timings of a collective, the slowest 2 % left out (a stall of another process).
    Not a low percentile: on gloo a collective's time is two-valued. Its hand-offs between the caller, the
    process group's worker thread and the transport's I/O thread now and then wait for a scheduler tick: on
    the 2-core VM a 64 KiB-4 MiB all-reduce took 0.3-0.7 ms in most calls and about 4 ms in 20-50 % of
    them (a plain TCP ping-pong of the same size over the same loopback: 0.16 ms, no such mode). A step with
    tens of collectives pays their mean; a low percentile or a median sees one mode or the other, which is
    how two calibrations of one idle machine measured a wait of 1,086 and of 0 us."""
    ordered = sorted(times)
    kept = ordered[:max(1, len(ordered) - len(ordered) // 50)]
    return sum(kept) / len(kept)


def _sync_wait(dist, torch, reps: int) -> dict:
    """Expected seconds (:func:`expected_time`) per iteration of (multiply; all-reduce SYNC_BYTES), of the
    multiply alone, of the all-reduce alone back to back, and of the all-reduce issued asynchronously under
    the multiply (the same fixed number of collectives on every rank). The pair less the multiply is what a
    collective between kernels costs; beyond the ring model's time (fitted to low percentiles of
    back-to-back collectives: the transfer) it is the wait the planner adds to every collective
    (:func:`sync_wait`). The four are timed in OVERLAP_ROUNDS interleaved rounds of ``reps`` iterations each
    and pooled, so a slow spell of the machine falls on all of them."""
    a, b = torch.randn(SYNC_GEMM, SYNC_GEMM), torch.randn(SYNC_GEMM, SYNC_GEMM)
    c, buf = torch.empty(SYNC_GEMM, SYNC_GEMM), torch.ones(SYNC_BYTES // 4)

    def timings(body) -> list:
        times = []
        dist.barrier()
        for _ in range(reps):
            t0 = time.perf_counter()
            body()
            times.append(time.perf_counter() - t0)
        return times

    def run(body) -> float:
        return sorted(timings(body))[reps // 2]

    def both():
        torch.mm(a, b, out=c)
        dist.all_reduce(buf)

    def overlapped():          # what the tensor-parallel backward does: input gradient under weight gradient
        handle = dist.all_reduce(buf, async_op=True)
        torch.mm(a, b, out=c)
        handle.wait()

    pooled = {"mm": [], "allreduce": [], "pair": [], "overlapped": []}
    bodies = {"mm": lambda: torch.mm(a, b, out=c), "allreduce": lambda: dist.all_reduce(buf), "pair": both,
              "overlapped": overlapped}
    for _ in range(OVERLAP_ROUNDS):
        for key, body in bodies.items():
            pooled[key] += timings(body)
    mm, alone, pair, over = (expected_time(pooled[k]) for k in ("mm", "allreduce", "pair", "overlapped"))
    # A bucket-sized all-reduce (a data-parallel gradient bucket, a ZeRO-3 gather) under matmuls that take
    # longer than it: what the overlapped pair costs beyond the matmuls, as a fraction of the all-reduce.
    # The fraction is a difference of two times over a third, so a slow spell in any one of them moves it
    # (two calibrations of one idle machine gave 1.29 and 0.29): the three are measured in OVERLAP_ROUNDS
    # interleaved rounds and the planner takes the median round's fraction.
    big = torch.ones(BUCKET_BYTES // 4)
    big_alone = run(lambda: dist.all_reduce(big))
    n_mm = max(1, int(2 * big_alone / max(mm, 1e-6)) + 1)

    def mms():
        for _ in range(n_mm):
            torch.mm(a, b, out=c)

    def big_overlapped():
        handle = dist.all_reduce(big, async_op=True)
        mms()
        handle.wait()
    rounds = []
    for _ in range(OVERLAP_ROUNDS):
        rounds.append([run(lambda: dist.all_reduce(big)), run(mms), run(big_overlapped)])
    ba, ms_, bo = (statistics.median(r[i] for r in rounds) for i in range(3))
    return {"bytes": SYNC_BYTES, "pair_s": pair, "mm_s": mm, "allreduce_s": alone, "overlapped_s": over,
            "bucket_bytes": BUCKET_BYTES, "bucket_allreduce_s": ba, "bucket_mm_s": ms_,
            "bucket_overlapped_s": bo, "bucket_rounds": rounds}


def overlap_penalty(data: dict) -> float:
    """Seconds an all-reduce overlapped with a matmul costs beyond the longer of the two, the all-reduce
    taken at what it costs between kernels (the pair less the matmul); >= 0."""
    s = data.get("sync")
    if not s or "overlapped_s" not in s:
        return 0.0
    return max(0.0, s["overlapped_s"] - max(s["mm_s"], s["pair_s"] - s["mm_s"]))


def overlap_exposed(data: dict) -> float:
    """Fraction of a bucket-sized all-reduce's own time that overlapping it with longer compute still adds
    (>= 0; 0 = fully hidden, 1 = no better than running the two one after the other)."""
    s = data.get("sync")
    if not s or "bucket_overlapped_s" not in s:
        return 0.0
    rounds = s.get("bucket_rounds") or [[s["bucket_allreduce_s"], s["bucket_mm_s"], s["bucket_overlapped_s"]]]
    return max(0.0, statistics.median((over - mms) / alone for alone, mms, over in rounds))


def sync_wait(data: dict, ranks: int) -> float:
    """Seconds a collective issued between compute kernels costs beyond the ring model's time for its size,
    fitted to the back-to-back samples (>= 0): the expected pair less the expected matmul, less t(S)."""
    s = data.get("sync")
    if not s:
        return 0.0
    alpha, bw = fit_ring(data["allreduce"], ranks)
    ring = 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * s["bytes"] / bw
    return max(0.0, s["pair_s"] - s["mm_s"] - ring)


def fit_ring(samples, ranks: int) -> tuple[float, float]:
    """(alpha, bandwidth) of t = 2(n-1) alpha + 2(n-1)/n S / B over (S, t) samples, by least squares
    on *relative* error (weights 1/t^2), so microsecond-scale small messages weigh as much as the
    large ones that set the bandwidth."""
    xs = [2 * (ranks - 1) / ranks * s for s, _ in samples]
    ys = [t for _, t in samples]
    ws = [1.0 / (y * y) for y in ys]
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    bandwidth = 1.0 / slope if slope > 0 else float("inf")
    alpha = max(intercept, 0.0) / (2 * (ranks - 1))
    return alpha, bandwidth


def _loopback_store():
    """TCPStore server bound to 127.0.0.1 only (a plain TCPStore binds every interface)."""
    import torch.distributed as dist
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, is_master=True, master_listen_fd=sock.detach(),
                         wait_for_workers=False), port


def measure(ranks: int = 2, quick: bool = False) -> dict:
    import torch.multiprocessing as mp
    store, port = _loopback_store()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "calibration.json")
        mp.start_processes(_worker, args=(ranks, port, quick, out), nprocs=ranks, start_method="spawn")
        with open(out) as f:
            data = json.load(f)
    del store
    return data


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _total_memory() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * GiB


def routing_line(rows) -> str:
    """The ``moe_routing_table`` line of a system file's [device] section (:func:`moe_routing_table`)."""
    if not rows:
        return "# moe_routing_table: not measured"
    table = ", ".join(f"[{b:.0f}, {r / GB:.6g}]" for b, r in rows)
    return (f"moe_routing_table = [{table}]      # [bytes, GB/s]: an MoE layer less its experts and router "
            "(routing, dispatch, combine, bookkeeping), fwd + bwd, planner's bytes")


def _routing_worker(barrier, queue, quick: bool) -> None:
    import torch
    torch.set_num_threads(1)
    barrier.wait()                       # start together: the ranks share the cores while they measure
    try:
        queue.put(moe_routing_table(torch, 0.04 if quick else 0.16, ROUTING_SIZES[::2] if quick else ROUTING_SIZES))
    except Exception as e:  # (reported by the parent, one line)
        queue.put(f"{type(e).__name__}: {e}")


def calibrate_moe_routing(path: str | None = None, quick: bool = False, ranks: int = 2, log=print) -> Path:
    """Measure the MoE routing rates alone (:func:`moe_routing_table`, in ``ranks`` processes at once, one
    torch thread each, as the full calibration runs it; the mean rate over the ranks) and write them into an
    existing system file (default the ``local`` one), replacing its ``moe_routing_table`` line:
    ``podscale plan calibrate --moe-routing-only``."""
    import re
    p = Path(path) if path else local_system_path()
    if not p.is_file():
        raise ValueError(f"no system file at {p}: run `podscale plan calibrate` first")
    start = time.perf_counter()
    results = _concurrently(_routing_worker, (quick,), ranks, "MoE routing microbenchmark")
    rows = [[results[0][i][0], sum(r[i][1] for r in results) / ranks] for i in range(len(results[0]))]
    text = re.sub(r"\n(# )?moe_routing_table[^\n]*", "", p.read_text())
    text = re.sub(r"(\nelementwise_table = [^\n]*)", lambda m: m.group(1) + "\n" + routing_line(rows), text, count=1)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, p)
    log(f"MoE routing rates ({', '.join(f'{r / GB:.2f}' for _, r in rows)} GB/s) written to {p} in "
        f"{time.perf_counter() - start:.1f} s")
    return p


def _rate_line(key: str, value, what: str) -> str:
    return f"{key} = {value / GB:.6g}      # {what}" if value else f"# {key}: not measured"


def system_toml(data: dict, ranks: int, quick: bool) -> str:
    """Render the measured numbers in the catalog's TOML schema; one 'device' is one rank."""
    alpha, bw = fit_ring(data["allreduce"], ranks)
    wait = sync_wait(data, ranks)
    peak = max(f for *_, f in data["matmul"])
    cores = os.cpu_count() or 1
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows = ",\n".join(f"  [{m}, {n}, {k}, {f:.6g}]" for m, n, k, f in data["matmul"])
    attention = ",\n".join(f"  [{s}, {d}, {f:.6g}, {b:.6g}]" for s, d, f, b in data.get("attention", ()))
    elementwise = ", ".join(f"[{a:.0f}, {r / GB:.6g}]" for a, r in data.get("elementwise", ()))
    ar = ", ".join(f"[{s}, {t:.6g}]" for s, t in data["allreduce"])
    sharded = "".join(f"{key} = {b / GB:.6g}\n" for key, b in
                      (("reduce_scatter_gbps", sharded_bandwidth(data, "reduce_scatter", ranks)),
                       ("all_gather_gbps", sharded_bandwidth(data, "all_gather", ranks))) if b)
    mem = _total_memory()
    return f'''# Written by `podscale plan calibrate` on {when}{" (quick mode)" if quick else ""}.
# {ranks} concurrent ranks x {data["threads"]} torch threads on {cores} cores of: {_cpu_name()}
# One device = one rank. Numbers are measured (float32 torch on CPU), not datasheet values.
name = "local"
description = "this machine: {ranks} ranks on {cores} CPU cores, measured {when}"
topology = "host"
devices_per_node = {max(cores, ranks)}
max_devices = {max(cores, ranks)}

[device]
name = "{_cpu_name()} / rank"
peak_tflops = {peak / 1e12:.6g}           # best measured matmul rate of one rank
memory_gib = {mem / ranks / GiB:.4g}            # RAM / ranks
memory_bw_gbps = {data["memory_bw"] / GB:.6g}        # tensor copy, bytes read + written per s, per rank
elementwise_gbps = {data["elementwise_bw"] / GB:.6g}      # a GPT layer's element-wise kernels, fwd + bwd, planner's bytes / s
# [bytes of one tokens x hidden activation, GB/s] of the same kernels at several sizes; the planner
# interpolates by the layer's activation size (log space)
elementwise_table = [{elementwise}]
{routing_line(data.get("routing", ()))}
kernel_overhead_us = {data["kernel_overhead"] * 1e6:.4g}      # host cost per kernel: a tiny GPT layer, fwd + bwd, per planner kernel
overlap_penalty_us = {overlap_penalty(data) * 1e6:.4g}      # all-reduce under a matmul, beyond the longer of them
overlap_exposed = {overlap_exposed(data):.4g}      # of an 8 MiB all-reduce under longer matmuls: what overlap still costs
{_rate_line("optimizer_gbps", data.get("optimizer_bw"), "torch fused AdamW, planner's bytes per parameter / s")}
{_rate_line("grad_pass_gbps", data.get("grad_pass_bw"), "gradient norm + clip + zero, bytes per parameter / s")}
{_rate_line("first_touch_gbps", data.get("first_touch_bw"), "filling pages the heap gave back (ZeRO-3's per-step trim)")}
matmul_efficiency = 1.0
memory_efficiency = 1.0
reserved_gib = 0.5
dtype_bytes = 4                     # CPU training runs in float32
# Measured [m, n, k, FLOP/s] of one rank while the others multiply too; the planner interpolates
# between the nearest measured shapes (log space).
matmul_table = [
{rows}
]
# Measured [seq, head_dim, forward FLOP/s, backward FLOP/s] of torch's fused causal attention, both rates in
# the forward's 2 s^2 d FLOPs per head; the planner interpolates between the nearest (log space).
attention_table = [
{attention}
]

[intra_node]
# gloo all-reduce over loopback, least-squares fit of the ring model to the samples below (latency per
# ring step, back to back), and the measured wait of a collective between compute kernels, which every
# collective and message pays once. ZeRO's reduce-scatter and all-gather as podscale issues them on gloo
# (a reduce / broadcast per rank), fitted to half the ring model.
bandwidth_gbps = {bw / GB:.6g}
efficiency = 1.0
latency_us = {alpha * 1e6:.4g}
sync_wait_us = {wait * 1e6:.4g}
{sharded}
[inter_node]
bandwidth_gbps = {bw / GB:.6g}
efficiency = 1.0
latency_us = {alpha * 1e6:.4g}
sync_wait_us = {wait * 1e6:.4g}
{sharded}
[host]
memory_gib = {mem / GiB:.4g}
memory_bw_gbps = {data["memory_bw"] * ranks / GB:.6g}
pcie_gbps = {data["memory_bw"] / GB:.6g}
nvme_gbps = {data.get("nvme_bw", GB) / GB:.6g}            # O_DIRECT sequential, the slower of read and write

[calibration]
ranks = {ranks}
threads_per_rank = {data["threads"]}
allreduce_bytes_seconds = [{ar}]
sync_wait_us = {wait * 1e6:.4g}
'''


def measure_swap_disk(folder: str | None, quick: bool) -> float:
    """Sequential O_DIRECT bandwidth of the disk holding ``folder`` (default: the temporary directory's),
    through the same I/O path as ZeRO-Infinity's swap files: the slower of write and read, bytes/s."""
    from podscale.storage.aio import measure_sequential_bandwidth
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        m = measure_sequential_bandwidth(tmp, (64 if quick else 512) << 20, threads=8)
    return min(m["write_Bps"], m["read_Bps"])


def calibrate(out: str | None = None, quick: bool = False, ranks: int = 2, log=print,
              swap_dir: str | None = None) -> Path:
    """Measure and write the system file (default ``$PODSCALE_CACHE/local.toml``); return its path."""
    if ranks < 2:
        raise ValueError("--ranks must be >= 2 to measure collectives")
    if swap_dir is not None and not Path(swap_dir).is_dir():
        raise ValueError(f"--swap-dir '{swap_dir}' is not an existing folder: point it at the disk you would "
                         "give zero.nvme_path")
    start = time.perf_counter()
    data = measure(ranks, quick)
    data["nvme_bw"] = measure_swap_disk(swap_dir, quick)
    path = Path(out) if out else local_system_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(system_toml(data, ranks, quick) + table_toml(measure_table_rates_concurrently(quick, ranks, swap_dir)))
    alpha, bw = fit_ring(data["allreduce"], ranks)
    wait = sync_wait(data, ranks)
    log(f"matmul: best {max(f for *_, f in data['matmul']) / 1e9:.1f} GFLOP/s per rank "
        f"({len(data['matmul'])} shapes); memory copy {data['memory_bw'] / GB:.2f} GB/s, element-wise "
        f"{data['elementwise_bw'] / GB:.2f} GB/s per rank; kernel {data['kernel_overhead'] * 1e6:.1f} us; "
        f"attention {len(data.get('attention', ()))} shapes; "
        f"gloo all-reduce ({ranks} ranks): latency {alpha * 1e6:.0f} us, bandwidth {bw / GB:.2f} GB/s, "
        f"wait between kernels {wait * 1e6:.0f} us, overlap penalty {overlap_penalty(data) * 1e6:.0f} us, "
        f"8 MiB all-reduce under matmuls exposed {overlap_exposed(data):.2f}; fused AdamW "
        f"{data['optimizer_bw'] / GB:.2f} GB/s, gradient passes {data['grad_pass_bw'] / GB:.2f} GB/s, "
        f"first touch {data['first_touch_bw'] / GB:.2f} GB/s; "
        f"swap disk {data['nvme_bw'] / GB:.2f} GB/s; "
        f"{time.perf_counter() - start:.1f} s")
    return path


# ---------------------------------------------------------------------------------------------------------
# GPU: the GEMM shape model's parameters from microbenchmarks (podscale plan calibrate --gpu)

# Square GEMMs, transformer GEMMs (tokens x 3h/t x h, tokens x h x 4h/t, ...) and shapes that are not tile
# multiples, so that both the per-SM rate e_mm and the per-tile fill/drain k0 are identifiable.
GPU_GEMM_SHAPES = tuple(
    [(n, n, n) for n in (512, 1024, 2048, 4096, 8192)]
    + [(t, n, k) for t in (2048, 8192) for n, k in ((3 * 768, 6144), (6144, 768), (3072, 6144), (6144, 3072),
                                                    (9600, 25600), (25600, 3200))]
    + [(4096, 4096, k) for k in (64, 128, 256, 512, 1024, 16384)]
    + [(m, 4096, 4096) for m in (1000, 1500, 3000, 5000)]
)
GPU_TILES = ((256, 128), (128, 128), (128, 64), (64, 64))
# Dense 16-bit tensor-core peaks by device name (NVIDIA datasheets), the rate e_mm is a fraction of.
GPU_PEAK_TFLOPS = {"A100": 312, "H100": 989, "H200": 989, "H800": 989, "A800": 312, "L40S": 362, "B200": 2250}


def measure_gpu_gemms(shapes=GPU_GEMM_SHAPES, dtype: str = "bf16", reps: int = 10) -> list:
    """[(m, n, k, seconds)] of torch.matmul on the current CUDA device, timed with CUDA events (median)."""
    import torch
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=dt)
        b = torch.randn(k, n, device="cuda", dtype=dt)
        for _ in range(3):
            torch.matmul(a, b)
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(a, b)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out.append((m, n, k, sorted(times)[len(times) // 2]))
    return out


def fit_gemm_shape_model(samples, device, e_grid=None, k0_grid=None) -> tuple[float, float, float]:
    """(e_mm, k0, mean |log(predicted / measured)|) of the tile/wave-quantised roofline
    (:func:`podscale.plan.compute.tiled_gemm_time`) over measured (m, n, k, seconds), by grid search on
    the relative (log) error, so small and large GEMMs weigh alike."""
    import math as _m
    from .compute import tiled_gemm_time
    e_grid = e_grid or [i / 100 for i in range(30, 121)]
    k0_grid = k0_grid or list(range(0, 513, 16))
    mem = device.memory_bw * device.memory_efficiency
    best = (_m.inf, 0.0, 0.0)
    for e in e_grid:
        for k0 in k0_grid:
            err = 0.0
            for m, n, k, sec in samples:
                pred = max(tiled_gemm_time(device, m, n, k, 1.0, e, k0), 2 * (m * k + k * n + m * n) / mem)
                err += abs(_m.log(pred / sec))
            if err < best[0]:
                best = (err, e, float(k0))
    return best[1], best[2], best[0] / len(samples)


def calibrate_gpu(out: str | None = None, log=print) -> Path:
    """Measure the current CUDA device's GEMMs and memory bandwidth, fit the GEMM shape model, and write a
    ``local`` system whose devices are this machine's GPUs. Collectives are not measured here: the links
    are nominal NVLink / InfiniBand figures (edit them, or use a catalog system for multi-node plans)."""
    import dataclasses
    import torch
    from .hardware import Device
    if not torch.cuda.is_available():
        raise ValueError("plan calibrate --gpu needs a CUDA device (torch.cuda.is_available() is False): "
                         "run it on the GPU machine, or calibrate this CPU without --gpu")
    props = torch.cuda.get_device_properties(0)
    name = props.name
    peak = next((v for k, v in GPU_PEAK_TFLOPS.items() if k in name), None)
    n_el = 256 * 1024 * 1024
    src, dst = torch.empty(n_el, device="cuda", dtype=torch.uint8), torch.empty(n_el, device="cuda",
                                                                               dtype=torch.uint8)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize()
    mem_bw = 2 * n_el * 20 / (time.perf_counter() - t0)
    samples = measure_gpu_gemms()
    best_rate = max(2 * m * n * k / s for m, n, k, s in samples)
    peak_flops = peak * 1e12 if peak else best_rate
    dev = Device(name=name, peak_flops=peak_flops, memory_bytes=props.total_memory, memory_bw=mem_bw,
                 matmul_efficiency=1.0, memory_efficiency=1.0, reserved_bytes=2 * GiB,
                 sm_count=props.multi_processor_count, gemm_tiles=GPU_TILES, gemm_tile_k=32)
    e_mm, k0, err = fit_gemm_shape_model(samples, dev)
    dev = dataclasses.replace(dev, matmul_efficiency=e_mm, gemm_tile_overhead_k=k0)
    gpus = torch.cuda.device_count()
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows = ",\n".join(f"  [{m}, {n}, {k}, {s:.6g}]" for m, n, k, s in samples)
    text = f'''# Written by `podscale plan calibrate --gpu` on {when}: {gpus} x {name}.
# GEMM shape model fitted to the bf16 torch.matmul times below (mean |log error| {err:.3f}); memory bandwidth
# from a device-to-device copy. The links are NOT measured (nominal NVLink / 400 Gb/s per GPU).
name = "local"
description = "this machine: {gpus} x {name}, GEMMs measured {when}"
topology = "switch"
devices_per_node = {gpus}
max_devices = {gpus}

[device]
name = "{name}"
peak_tflops = {peak_flops / 1e12:.6g}      # {"datasheet dense 16-bit peak" if peak else "best measured GEMM rate"}
memory_gib = {props.total_memory / GiB:.4g}
memory_bw_gbps = {mem_bw / GB:.6g}
matmul_efficiency = {e_mm:.3g}           # fitted, per SM on a full tile
memory_efficiency = 1.0
reserved_gib = 2
sm_count = {props.multi_processor_count}
gemm_tiles = {[list(t) for t in GPU_TILES]}
gemm_tile_k = 32
gemm_tile_overhead_k = {k0:g}            # fitted
# measured [m, n, k, seconds]
gemm_samples = [
{rows}
]

[intra_node]
bandwidth_gbps = 300
efficiency = 0.77
latency_us = 10

[inter_node]
bandwidth_gbps = 50
efficiency = 0.9
latency_us = 6

[host]
memory_gib = {_total_memory() / GiB:.4g}
memory_bw_gbps = 200
pcie_gbps = 25
nvme_gbps = 5
'''
    path = Path(out) if out else local_system_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    log(f"{gpus} x {name}: GEMM model e_mm {e_mm:.2f}, k0 {k0:g} (mean |log error| {err:.3f} over "
        f"{len(samples)} shapes); best GEMM {best_rate / 1e12:.0f} TFLOP/s; copy {mem_bw / GB:.0f} GB/s")
    return path


# ---------------------------------------------------------------------------------------------------------
# Sharded tables: the host cost of each operation a table step runs (the DLRM cost model's [table] rates)

TABLE_SIZES = (256, 4096)        # keys (or ids) per call
QUICK_TABLE_SIZES = (64, 1024)
TABLE_WIDTHS = (18, 130)         # floats per stored row: dim 16 / 128 + row-wise Adagrad's state + last use


def _fit_op(make, budget: float, sizes=TABLE_SIZES, widths=TABLE_WIDTHS) -> list:
    """[call_s, per_item_s, per_float_s] of an operation: non-negative least squares of
    ``t = call + n * per_item + n * w * per_float`` over calls of ``n`` items of ``w`` floats
    (``make(n, w)`` returns the call to time; ``widths=(0,)`` for operations on ids alone)."""
    import numpy as np
    from scipy.optimize import nnls
    rows, ts = [], []
    for n in sizes:
        for w in widths:
            ts.append(_timeit(make(n, w), budget))
            rows.append([1.0, n, n * w])
    a, t = np.array(rows), np.array(ts)
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    coef = nnls(a / scale / t[:, None], np.ones(len(t)))[0] / scale   # relative error: small calls count
    return [float(c) for c in coef]


def measure_table_rates(quick: bool = False, ranks: int = 2, folder: str | None = None) -> dict:
    """Time, on synthetic keys and rows, the operations of a sharded table's step (podscale/table/embedding.py)
    with the torch threads one of ``ranks`` training processes gets: deduplication (:class:`Dedup`), a
    shard's store read and write -- the keyed in-memory store (key-index search and gather), the dense
    store (the key is the slot), the DRAM cache of the SSD tier (all hits) and the SSD engine itself (the
    log store's read and write of rows not cached) --, bag pooling (``embedding_bag``, also the backward's
    row gradients), row-wise Adagrad's update and a row copy (``index_select``: the reply's gather, the
    gradient sums).  Returns ``{op: [call_s, per_item_s, per_float_s]}`` (:class:`~.hardware.TableRates`)."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from podscale.storage.dense import DenseRowStore
    from podscale.storage.log import LogRowStore
    from podscale.storage.rows import CachedRowStore, MemoryRowStore
    from podscale.table.embedding import Dedup
    from podscale.table.optim import RowWiseAdagrad

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    budget = 0.01 if quick else 0.05
    rng = np.random.default_rng(0)
    sizes = QUICK_TABLE_SIZES if quick else TABLE_SIZES
    big = 4 * max(sizes) if quick else 64 * max(sizes)   # keys per store: a shard's index, not
    # one that stays in the CPU's caches (its per-key cost grows with the size)
    all_keys = torch.from_numpy(rng.choice(1 << 40, size=big, replace=False).astype(np.int64))

    def key_sets(n):  # two sets, used in turn: a store remembers the slots of its last read
        return [all_keys[torch.from_numpy(rng.choice(big, size=n, replace=False))] for _ in range(2)]

    def filled(store, w):
        for a in range(0, big, 8192):
            store.put(all_keys[a: a + 8192], torch.randn(len(all_keys[a: a + 8192]), w))
        return store

    def reader(store, n):
        sets, i = key_sets(n), [0]

        def run():
            i[0] ^= 1
            store.get(sets[i[0]])
        return run

    def writer(store, n, w):
        keys, rows = key_sets(n)[0], torch.randn(n, w)
        store.get(keys)                      # a step writes back the keys it read

        def run():
            store.put(keys, rows)
        return run

    out = {}
    try:
        ids = torch.from_numpy(rng.zipf(1.05, size=16 * max(sizes)).astype(np.int64))
        out["dedup"] = _fit_op(lambda n, w: (lambda: Dedup.of(ids[:n])), budget, sizes, widths=(0,))
        out["keyed_get"] = _fit_op(lambda n, w: reader(filled(MemoryRowStore(w), w), n), budget, sizes)
        out["keyed_put"] = _fit_op(lambda n, w: writer(filled(MemoryRowStore(w), w), n, w), budget, sizes)

        def create(n, w):  # new keys as a step meets them: a read that misses, their initial rows (hashed per
            from podscale.table.hashing import init_rows   # key and column), the insert, the update's write
            store, made = MemoryRowStore(w), [0]

            def run():
                made[0] += 1
                keys = torch.arange(made[0] * n, (made[0] + 1) * n) * 7919
                store.get(keys)
                fresh = init_rows(1, keys, 0, w, 0.1)
                store.put(keys, fresh)
                store.put(keys, fresh)
            return run
        out["create"] = _fit_op(create, budget, sizes)

        def dense(w):
            return DenseRowStore(big, w, lambda k: torch.zeros(len(k), w))
        dense_keys = torch.arange(big)
        all_keys_saved = all_keys
        all_keys = dense_keys                # the dense store's keys are its slots
        out["dense_get"] = _fit_op(lambda n, w: reader(dense(w), n), budget, sizes)
        out["dense_put"] = _fit_op(lambda n, w: writer(dense(w), n, w), budget, sizes)
        all_keys = all_keys_saved
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            made = [0]

            def log_store(w):
                made[0] += 1
                return filled(LogRowStore(Path(tmp) / f"s{made[0]}", w), w)

            def cached(w):
                made[0] += 1
                store = CachedRowStore(LogRowStore(Path(tmp) / f"s{made[0]}", w), 4 * w * (big + 1024), "lru")
                filled(store, w)
                for a in range(0, big, 8192):   # every row cached: only the cache's own work is timed
                    store.get(all_keys[a: a + 8192])
                return store
            out["cached_get"] = _fit_op(lambda n, w: reader(cached(w), n), budget, sizes)
            out["cached_put"] = _fit_op(lambda n, w: writer(cached(w), n, w), budget, sizes)
            out["ssd_get"] = _fit_op(lambda n, w: reader(log_store(w), n), budget, sizes)
            out["ssd_put"] = _fit_op(lambda n, w: writer(log_store(w), n, w), budget, sizes)

        def pool(n, w):
            table = torch.randn(max(1, n // 2), w - 2)
            inv = torch.from_numpy(rng.integers(0, len(table), size=n))
            offsets = torch.arange(0, n, 16)
            return lambda: F.embedding_bag(inv, table, offsets, mode="sum")
        out["pool"] = _fit_op(pool, budget, sizes)
        adagrad = RowWiseAdagrad(0.05)

        def update(n, w):
            rows, g = torch.rand(n, w), torch.randn(n, w - 2)
            return lambda: adagrad.update(rows[:, : w - 2], rows[:, w - 2: w - 1], g, 1)
        out["update"] = _fit_op(update, budget, sizes)

        def copy(n, w):
            rows, idx = torch.randn(2 * n, w), torch.from_numpy(rng.integers(0, 2 * n, size=n))
            return lambda: rows.index_select(0, idx)
        out["copy"] = _fit_op(copy, budget, sizes)
        out["step_row"] = _fit_op(lambda n, w: _tiny_table_step(n, "row"), budget, sizes=(1, 4), widths=(0,))
        out["step_pooled"] = _fit_op(lambda n, w: _tiny_table_step(n, "table"), budget, sizes=(1, 4),
                                     widths=(0,))
    finally:
        torch.set_num_threads(threads)
    return out


def _concurrently(worker, args: tuple, ranks: int, what: str) -> list:
    """``worker(barrier, queue, *args)`` in ``ranks`` spawned processes at once (each puts one result, or one
    line saying what failed); their results, or a RuntimeError naming ``what``."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(barrier, queue, *args)) for _ in range(ranks)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    bad = [r for r in results if isinstance(r, str)]
    if bad:
        raise RuntimeError(f"{what} failed: {bad[0]}")
    return results


def _table_worker(barrier, queue, quick: bool, ranks: int, folder: str | None) -> None:
    barrier.wait()                       # start together: the ranks share the cores while they measure
    try:
        queue.put(measure_table_rates(quick, ranks, folder))
    except Exception as e:  # (reported by the parent, one line)
        queue.put(f"{type(e).__name__}: {e}")


def measure_table_rates_concurrently(quick: bool = False, ranks: int = 2, folder: str | None = None) -> dict:
    """:func:`measure_table_rates` in ``ranks`` processes at the same time, as `podscale train` runs its ranks
    (they share cores, caches and memory bandwidth, like the rest of calibration's measurements); each
    coefficient is the mean over the ranks."""
    results = _concurrently(_table_worker, (quick, ranks, folder), ranks, "table microbenchmark")
    return {op: [sum(r[op][i] for r in results) / ranks for i in range(3)] for op in results[0]}


def _tiny_table_step(tables: int, sharding: str):
    """A forward and backward of a one-rank :class:`ShardedEmbeddingBags` of ``tables`` tables (dim 16),
    one id in each of 2 bags, every row existing: what a table step costs whatever its size (row-wise:
    keyed stores through the row exchange; table-wise: dense stores through the pooled exchange)."""
    import torch
    from podscale.runtime.mesh import Mesh
    from podscale.table import RowWiseAdagrad, ShardedEmbeddingBags, TableSpec
    dense = sharding != "row"
    specs = [TableSpec(f"t{i}", 16, "sum", sharding, num_keys=64 if dense else None,
                       storage="dense" if dense else "keyed") for i in range(tables)]
    emb = ShardedEmbeddingBags(specs, Mesh.build(dp=1), RowWiseAdagrad(0.05), seed=1)
    feats = {s.name: (torch.tensor([3, 5]), torch.tensor([0, 1])) for s in specs}

    def run():
        out = emb(feats)
        sum(v.sum() for v in out.values()).backward()
    run()                                # creates the rows
    return run


def table_toml(rates: dict) -> str:
    """The ``[table]`` section of a system file (:class:`~.hardware.TableRates`)."""
    lines = "\n".join(f"{op} = [{', '.join(f'{x:.4g}' for x in v)}]" for op, v in rates.items())
    return f'''
[table]
# Host cost of a sharded table's operations, measured on synthetic keys and rows by `podscale plan
# calibrate` in each of the ranks at once (one rank's torch threads each, the mean over ranks):
# seconds = call + items * per_item + floats * per_float.
# [call_s, per_item_s, per_float_s]
{lines}
'''


def calibrate_table(path: str | None = None, quick: bool = False, ranks: int = 2, log=print) -> Path:
    """Measure the table rates alone and write them into an existing system file (default the ``local``
    one), replacing its ``[table]`` section: ``podscale plan calibrate --table-only``."""
    import re
    p = Path(path) if path else local_system_path()
    if not p.is_file():
        raise ValueError(f"no system file at {p}: run `podscale plan calibrate` first")
    start = time.perf_counter()
    rates = measure_table_rates_concurrently(quick, ranks)
    text = re.sub(r"\n\[table\]\n.*?(?=\n\[|\Z)", "", p.read_text(), flags=re.S)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(text.rstrip("\n") + "\n" + table_toml(rates))
    os.replace(tmp, p)
    log(f"table rates ({len(rates)} operations) written to {p} in {time.perf_counter() - start:.1f} s")
    return p
