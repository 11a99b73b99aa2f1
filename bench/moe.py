"""podscale's MoE layer vs DeepSpeed's ``deepspeed.moe.layer.MoE``, side by side on 2 ranks with ep = 2.

Both layers get the same weights (router, and every expert's two linear layers), the same input and the
same capacity (DeepSpeed: ``min_capacity=0``, no noisy gate, no random token selection, no sampling of the
second expert; podscale: ``random_routing=False``; all local tokens of a rank form one group, as in
DeepSpeed).  For experts 4 to 64, tokens per rank 1k to 8k and top-1 / top-2, each point times forward +
backward of ``sum(y * g)`` (the input wants its gradient, as a hidden state inside a model does;
``--no-input-grad``: it does not, and both layers skip sending the input gradients back) for both in alternating rounds (machine noise hits both alike) and prints the
median time ratio (podscale / DeepSpeed; below 1 is faster; the slowest rank's wall time), the same ratio
of CPU time (process CPU time summed over the ranks: on a shared, loaded machine it moves far less than
wall time, which counts the time other programs hold the cores), the expert rows podscale's busier rank
runs as a share of DeepSpeed's (which runs every capacity slot: ``E/ep * ep * C`` rows a rank; where the
expert GEMMs dominate, the time ratio cannot go much below it), the activation memory each keeps for the
backward (bytes of the tensors autograd saves; on a GPU the allocator's peak instead), and the largest
difference of the outputs on the tokens that no over-capacity expert touches (elsewhere the two differ by
design: DeepSpeed's top-1 without random token selection keeps an arbitrary C of the tied tokens, and its
top-2 renormalises the gate values after dropping where GShard normalises before).

    python bench/moe.py [--quick] [--d-model 128] [--d-hidden 512] [--capacity-factor 1.25] [--rounds 5]
                        [--kernel auto|tiled|segment|grouped]   # podscale's expert kernel (default: the device's)
                        [--row-tile N]   # the CPU kernel's row tile (an ablation; default: the library's)
                        [--ablate-overlap]   # also podscale with its own rows never overlapped with the exchange
                        [--bind-cores]   # each rank pinned to its own share of the cores (both layers)
                        [--keep-heap]    # freed memory stays resident (no page faults on new activations)
                        [--recompute-activation]   # podscale keeps only the experts' pre-activation
                        [--link-mbit M]  # root only: each rank a node of its own, the two joined by an M Mbit/s
                                         # link (network namespaces: emulated_nodes.py)
    python bench/moe.py --kernels [NAME ...] [--device cpu|cuda] [--dtype fp32 bf16] [--threads N] ...
                        # one process, ep = 1: podscale's expert kernels (tiled, segment, grouped, and each
                        # -recompute; default the first two) on the same layer and input, taking
                        # turns; fwd + bwd median of each and its ratio to the first's (no DeepSpeed)
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
from emulated_nodes import add_link_argument, nodes_for  # noqa: E402

from podscale.parallel.moe import EXPERT_DISPATCHES, MoELayer  # noqa: E402
from podscale.parallel.moe import layer as moe_layer  # noqa: E402
from podscale.parallel.moe import kernels  # noqa: E402
from podscale.parallel.moe.kernels import CacheTiledKernel  # noqa: E402
from podscale.runtime import hostmem  # noqa: E402
from podscale.runtime.launcher import launch  # noqa: E402
from podscale.runtime.mesh import Mesh  # noqa: E402
from podscale.runtime.process import bind_local_cores, init_process  # noqa: E402


class _SavedBytes:
    """Bytes of the distinct storages autograd saves for the backward during a forward, parameters
    excluded (the activation memory a layer adds)."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params:
            self.seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def copy_weights(ours: MoELayer, theirs) -> None:
    with torch.no_grad():
        theirs.deepspeed_moe.gate.wg.weight.copy_(ours.router.weight)
        for mine, expert in zip(ours.experts.values(), theirs.deepspeed_moe.experts.deepspeed_experts):
            expert[0].weight.copy_(mine.w_fc.t())
            expert[0].bias.copy_(mine.b_fc)
            expert[2].weight.copy_(mine.w_proj.t())
            expert[2].bias.copy_(mine.b_proj)


def _fwd_bwd(fn, params, x, g, device) -> tuple[float, float, torch.Tensor, int]:
    saved = _SavedBytes(params)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        y = fn(x)
    (y * g).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    t = torch.tensor([dt])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)   # a step takes as long as its slowest rank
    c = torch.tensor([cpu])
    dist.all_reduce(c, op=dist.ReduceOp.SUM)   # the CPU time of all ranks (every thread of each)
    mem = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else saved.total
    return float(t), float(c), y.detach(), mem


#: the issue's goal for the time ratio (podscale / DeepSpeed) at every point
GOAL = 0.7


#: mallopt(3) parameter: the most chunks glibc serves with their own mmap (0: none, the heap serves all)
_M_MMAP_MAX = -4


def _without_overlap(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """The layer with its own rows sent through the exchange and regrouped (the rule decides in the forward)."""
    rule = moe_layer.MIN_SEGMENT_ROWS
    moe_layer.MIN_SEGMENT_ROWS = 10**9
    try:
        return layer(x)[0]
    finally:
        moe_layer.MIN_SEGMENT_ROWS = rule


def _worker(args, net=None) -> list[dict]:
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    if args.keep_heap:
        # both layers alike: freed memory stays in the process, so a step's activations reuse resident
        # pages instead of faulting fresh ones in (one fault per 4 KiB page)
        hostmem.mallopt(_M_MMAP_MAX, 0)
        hostmem.mallopt(hostmem.M_TRIM_THRESHOLD, 2**30)
    info = net.init_process(ranks_per_node=1) if net else init_process()
    cores = bind_local_cores(info.local_rank, info.world_size) if args.bind_cores else None
    torch.set_num_threads(len(cores) if cores else max(1, (os.cpu_count() or 1) // info.world_size))
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import logger as ds_logger
    ds_logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    mesh = Mesh.build(info.device, ep=info.world_size)
    dev = info.device
    # "auto": the layer picks the device's kernel itself (with --recompute-activation, its recomputing one)
    kernel = _kernel(args, args.kernel)
    rows = []
    for E, S, k in itertools.product(args.experts, args.tokens, args.top_k):
        torch.manual_seed(1)
        ours = MoELayer(args.d_model, args.d_hidden, E, top_k=k, capacity_factor=args.capacity_factor,
                        random_routing=False, mesh=mesh, kernel=kernel,
                        recompute_activation=args.recompute_activation, expert_dispatch=args.expert_dispatch).to(dev)
        with torch.no_grad():  # a router with some preference, so routing is uneven as in training
            ours.router.weight.normal_(0.0, args.router_std)
            for name, p in ours.experts.named_parameters():
                if ".b_" in name:
                    p.normal_(0.0, 0.02)
        expert = nn.Sequential(nn.Linear(args.d_model, args.d_hidden), nn.GELU(approximate="tanh"),
                               nn.Linear(args.d_hidden, args.d_model))
        theirs = MoE(args.d_model, expert, num_experts=E, ep_size=info.world_size, k=k,
                     capacity_factor=args.capacity_factor, eval_capacity_factor=args.capacity_factor,
                     min_capacity=0, noisy_gate_policy=None, drop_tokens=True, use_rts=False,
                     top2_2nd_expert_sampling=False).to(dev)
        theirs.set_deepspeed_parallelism()
        copy_weights(ours, theirs)
        g = torch.Generator().manual_seed(100 + info.rank)
        x = torch.randn(1, S, args.d_model, generator=g).to(dev).requires_grad_(not args.no_input_grad)
        gy = torch.randn(1, S, args.d_model, generator=g).to(dev)
        runs = {"podscale": (lambda t: ours(t)[0], list(ours.parameters())),
                "deepspeed": (lambda t: theirs(t)[0], list(theirs.parameters()))}
        if args.ablate_overlap:
            runs["podscale-no-overlap"] = (lambda t: _without_overlap(ours, t), list(ours.parameters()))
        times = {n: [] for n in runs}
        cpus = {n: [] for n in runs}
        outs, mems = {}, {}
        for r in range(args.rounds + 1):
            ours.zero_grad(set_to_none=True)
            theirs.zero_grad(set_to_none=True)
            x.grad = None
            names = list(runs)
            for name in names[r % len(names):] + names[:r % len(names)]:   # each goes first in turn
                fn, params = runs[name]
                dt, cpu, y, mem = _fwd_bwd(fn, params, x, gy, dev)
                if r > 0:  # round 0 warms up
                    times[name].append(dt)
                    cpus[name].append(cpu)
                outs[name], mems[name] = y, mem
        # Compare the tokens no expert had to turn away: where an expert is over capacity the two differ by
        # design (DeepSpeed's top-1 keeps an arbitrary C of a 0/1 mask's ties, and its top-2 renormalises
        # the gates after dropping, where GShard normalises before).
        with torch.no_grad():
            out = ours(x)[1]
        r, C = out.routing, ours.capacity(S)
        # The expert rows each side runs: podscale the kept choices of its experts (summed over the ranks
        # that send them), DeepSpeed every slot, E/ep experts x ep ranks x C on each rank.  Their ratio on
        # the busier rank bounds the time ratio from below wherever the expert GEMMs dominate.
        kept = out.stats.all_reduce(mesh, "ep").kept
        busiest = int(kept.view(info.world_size, -1).sum(1).max())
        full = torch.bincount(r.expert[r.wanted], minlength=E) > C
        clean = ~full[r.expert].any(1)
        d = (outs["podscale"] - outs["deepspeed"]).reshape(S, -1)[clean]
        diff = torch.tensor([float(d.abs().max()) if d.numel() else 0.0, float(clean.float().mean())])
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        t_ours, t_ds = statistics.median(times["podscale"]), statistics.median(times["deepspeed"])
        row = {"experts": E, "tokens_per_rank": S, "top_k": k, "podscale_ms": 1e3 * t_ours,
               "deepspeed_ms": 1e3 * t_ds, "ratio": t_ours / t_ds, "podscale_mem_mb": mems["podscale"] / 2**20,
               "deepspeed_mem_mb": mems["deepspeed"] / 2**20, "max_out_diff": float(diff[0]),
               "uncontested_share": float(diff[1]), "row_share": busiest / (E * C),
               "cpu_ratio": statistics.median(cpus["podscale"]) / statistics.median(cpus["deepspeed"])}
        if args.ablate_overlap:
            row["no_overlap_ratio"] = statistics.median(times["podscale-no-overlap"]) / t_ds
        rows.append(row)
        if info.rank == 0:
            print(f"E={E:3d} S={S:5d} k={k}  podscale {row['podscale_ms']:8.1f} ms  "
                  f"deepspeed {row['deepspeed_ms']:8.1f} ms  ratio {row['ratio']:.2f} (CPU time {row['cpu_ratio']:.2f}; "
                  f"expert rows {row['row_share']:.2f})  "
                  f"mem {row['podscale_mem_mb']:.1f} / {row['deepspeed_mem_mb']:.1f} MB  "
                  f"max|dy| {row['max_out_diff']:.1e} (on {100 * row['uncontested_share']:.0f}% of tokens)"
                  + (f"  no-overlap ratio {row['no_overlap_ratio']:.2f}" if args.ablate_overlap else ""), flush=True)
    return rows


#: the kernels ``--kernels`` can set side by side (``-recompute``: keeping only the experts' pre-activation)
KERNEL_NAMES = tuple(n + s for n in kernels.KERNEL_NAMES if n != "auto" for s in ("", "-recompute"))


def _kernel(args, name: str):
    """podscale's expert kernel ``name`` (one of :data:`KERNEL_NAMES`, or "auto"), the CPU's with
    ``--row-tile`` if given; ``--recompute-activation`` makes any of them keep only the pre-activation."""
    base, _, suffix = name.partition("-")
    recompute = suffix == "recompute" or args.recompute_activation
    if base in ("tiled", "auto") and args.row_tile:
        return CacheTiledKernel(args.row_tile, recompute=recompute)
    return kernels.kernel_named(base, recompute)


def kernel_ablation(args) -> list[dict]:
    """podscale's expert kernels (:mod:`podscale.parallel.moe.kernels`; ``--kernels`` names them, the first
    is the baseline) on the same MoE layer (same weights, routing and input) in one process at ep = 1, taking
    turns to go first each round; the median forward + backward time of each, per point and dtype, and its
    ratio to the first's."""
    dev = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.kernels or ["tiled", "segment"]
    rows = []
    for (E, S, k), dt in itertools.product(itertools.product(args.experts, args.tokens, args.top_k), args.dtype):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dt]
        layers = {}
        for name in names:
            torch.manual_seed(1)
            layer = MoELayer(args.d_model, args.d_hidden, E, top_k=k, capacity_factor=args.capacity_factor,
                             random_routing=False, kernel=_kernel(args, name))
            with torch.no_grad():
                layer.router.weight.normal_(0.0, args.router_std)
            layers[name] = layer.to(dev, dtype)
        x = torch.randn(1, S, args.d_model, generator=torch.Generator().manual_seed(100)).to(dev, dtype)
        x.requires_grad_(True)
        times = {name: [] for name in layers}
        for r in range(args.rounds + 2):
            for name in names[r % len(names):] + names[:r % len(names)]:   # each goes first in turn
                layer = layers[name]
                layer.zero_grad(set_to_none=True)
                x.grad = None
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                y, _ = layer(x)
                y.float().square().sum().backward()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                if r >= 2:  # two warm-up rounds
                    times[name].append(time.perf_counter() - t0)
        row = {"experts": E, "tokens": S, "top_k": k, "dtype": dt,
               **{f"{name}_ms": 1e3 * statistics.median(t) for name, t in times.items()}}
        for name in names[1:]:
            row[f"{name}_over_{names[0]}"] = row[f"{name}_ms"] / row[f"{names[0]}_ms"]
        rows.append(row)
        print(f"E={E:3d} S={S:5d} k={k} {dt}  " + "  ".join(f"{n} {row[f'{n}_ms']:8.2f} ms" for n in names) + "  " +
              "  ".join(f"{n} / {names[0]} {row[f'{n}_over_{names[0]}']:.2f}" for n in names[1:]), flush=True)
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="experts 4 and 64, 1k and 4k tokens, 3 rounds")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-hidden", type=int, default=512)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--router-std", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--experts", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--kernel", choices=kernels.KERNEL_NAMES, default="auto",
                    help="podscale's expert kernel: the device's (CPU: tiled; GPU: grouped for bf16 on SM90/SM100, "
                         "else segment), or any of them on any device")
    ap.add_argument("--row-tile", type=int, default=None,
                    help="rows per tile of the CPU kernel (implies --kernel tiled; default: its ROW_TILE; "
                         "a huge value gives one matmul per expert segment, the layout before tiling)")
    ap.add_argument("--no-input-grad", action="store_true",
                    help="the input wants no gradient (both layers then skip the backward's return exchange)")
    ap.add_argument("--ablate-overlap", action="store_true",
                    help="a third contestant in the same rounds: podscale with every rank's own rows sent through "
                         "the exchange and regrouped (MIN_SEGMENT_ROWS huge), never run while it is in flight")
    ap.add_argument("--bind-cores", action="store_true",
                    help="pin each rank's main thread to its own share of the cores once the process group exists "
                         "(podscale's bind_local_cores; gloo's threads stay unbound; both layers run in the same "
                         "processes, so both get it)")
    ap.add_argument("--keep-heap", action="store_true",
                    help="glibc: serve every allocation from the heap and never trim it (both layers; takes "
                         "page faults on freshly allocated activations out of the times)")
    ap.add_argument("--kernels", nargs="*", choices=KERNEL_NAMES, default=None,
                    help="instead: podscale's expert kernels side by side in one process (ep = 1, no DeepSpeed); "
                         "the first named is the baseline (none named: tiled segment)")
    ap.add_argument("--recompute-activation", action="store_true",
                    help="podscale's experts keep only their pre-activation and evaluate the GELU again in the "
                         "backward (model.expert_recompute)")
    ap.add_argument("--expert-dispatch", choices=EXPERT_DISPATCHES, default="choice",
                    help="podscale's exchange: a row per kept choice, a token once a rank with its choices "
                         "combined there, or once a node (parallel.expert_dispatch)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="with --kernels")
    ap.add_argument("--dtype", nargs="+", choices=["fp32", "bf16"], default=["fp32"], help="with --kernels")
    ap.add_argument("--threads", type=int, default=None, help="with --kernels: torch's CPU threads")
    ap.add_argument("--json", help="write the rows here")
    add_link_argument(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.experts, args.tokens, args.rounds = [4, 64], [1024, 4096], 3
    if args.kernels is not None:
        rows = kernel_ablation(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return rows
    net = nodes_for(args.link_mbit, args.nproc, 1)
    with net or contextlib.nullcontext():
        if net:
            print(f"each rank a node of its own, linked at {net.measure_mbit():.0f} Mbit/s (measured)")
        rows = launch(_worker, (args, net), nproc=args.nproc)[0]
    worst = max(r["ratio"] for r in rows)
    print(f"ratio (podscale / DeepSpeed): worst {worst:.2f}, median {statistics.median(r['ratio'] for r in rows):.2f}; "
          f"CPU-time ratio: worst {max(r['cpu_ratio'] for r in rows):.2f}, median "
          f"{statistics.median(r['cpu_ratio'] for r in rows):.2f}; largest output difference "
          f"{max(r['max_out_diff'] for r in rows):.1e}")
    over = [r for r in rows if r["ratio"] > GOAL]
    print(f"{len(rows) - len(over)} of {len(rows)} points at or under {GOAL:.2f}x" + (
        f"; the busier rank's expert rows at the others: {min(r['row_share'] for r in over):.2f}-"
        f"{max(r['row_share'] for r in over):.2f} of DeepSpeed's" if over else ""))
    if args.ablate_overlap:
        better = sum(r["ratio"] < r["no_overlap_ratio"] for r in rows)
        print(f"without the overlap: worst {max(r['no_overlap_ratio'] for r in rows):.2f}, median "
              f"{statistics.median(r['no_overlap_ratio'] for r in rows):.2f}; the library's rule faster at "
              f"{better} of {len(rows)} points")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
