"""podscale's expert-parallel dispatches side by side: one row per kept (token, expert) choice against one row
per (token, rank holding any of its choices), the choices combined on that rank (`parallel.expert_dispatch`,
DeepEP's dispatch and combine), and, with `--ranks-per-node`, one row per (token, node) between nodes, forwarded
per rank inside the node (DeepEP's internode dispatch).

The peer of these dispatches is DeepEP (GPU kernels over NVLink and RDMA), which does not run here; so this bench
measures what they change on one layout against podscale's own per-choice dispatch, in the same processes, same
weights, same tokens, rounds taking turns: each rank's bytes sent to other ranks and to other nodes (every
`all_to_all_single` of the forward and backward, counted from its split sizes: the bytes a network would carry;
`--ranks-per-node R` numbers the ranks R a node, as torchrun does, on this one machine), the all-to-alls a step
issues, the forward + backward time (the slowest rank's, median of the rounds), and the largest output
difference from the per-choice dispatch (0: the same sums in the same order).

Points: experts x tokens per rank x top-k on `--nproc` gloo ranks (ep = nproc), d_model and expert width as
given, fp32, capacity factor 1.25, router N(0, `--router-std`).  `--group-limited`: DeepSeek-V3's node-limited
routing with one group per node (per rank without `--ranks-per-node`) and one group per token (`Gating(groups,
group_top_k=1)`), so all k choices of a token lie on one node (rank): what that routing buys is paid out only by a
dispatch that sends a token once a node (rank).

    python bench/moe_dispatch.py [--experts 16 64] [--tokens 1024 4096] [--top-k 1 2 4] [--d-model 128]
                                 [--d-hidden 512] [--nproc 2] [--ranks-per-node R] [--group-limited] [--rounds 7]
                                 [--link-mbit M]   # root only: the nodes (each rank without --ranks-per-node) in
                                                   # network namespaces joined by M Mbit/s links (emulated_nodes.py)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from emulated_nodes import add_link_argument, nodes_for  # noqa: E402

from podscale.parallel.moe import Gating, MoELayer  # noqa: E402
from podscale.runtime.launcher import launch  # noqa: E402
from podscale.runtime.mesh import Mesh  # noqa: E402
from podscale.runtime.process import init_process  # noqa: E402

#: bytes sent to other ranks and to other nodes, and all-to-alls issued, in the step in progress (this rank)
SENT = {"bytes": 0, "node_bytes": 0, "calls": 0}


def _counting(raw, rank: int, world: int, per_node: int):
    """``dist.all_to_all_single`` over the world that adds the bytes it sends to other ranks and to ranks of other
    nodes (``per_node`` ranks a node) to :data:`SENT`."""
    def call(output, inp, output_split_sizes=None, input_split_sizes=None, **kw):
        row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
        splits = input_split_sizes or [inp.shape[0] // world] * world
        SENT["bytes"] += row * sum(n for r, n in enumerate(splits) if r != rank)
        SENT["node_bytes"] += row * sum(n for r, n in enumerate(splits) if r // per_node != rank // per_node)
        SENT["calls"] += 1
        return raw(output, inp, output_split_sizes, input_split_sizes, **kw)
    return call


def _worker(a, net) -> list[dict]:
    per_node = a.ranks_per_node or (1 if net else int(os.environ["WORLD_SIZE"]))
    info = net.init_process(per_node) if net else init_process()
    torch.set_num_threads(1)
    mesh = Mesh.build(info.device, ep=info.world_size)
    dist.all_to_all_single = _counting(dist.all_to_all_single, info.rank, info.world_size, per_node)
    dispatches = ("choice", "rank", "node") if 1 < per_node < info.world_size else ("choice", "rank")
    rows = []
    for E in a.experts:
        for T in a.tokens:
            for k in a.top_k:
                # one router group a node (a rank without --ranks-per-node), one group a token
                groups = info.world_size // per_node if per_node < info.world_size else info.world_size
                gating = Gating(groups=groups, group_top_k=1) if a.group_limited else Gating()
                layers = {}
                for dispatch in dispatches:
                    torch.manual_seed(1)
                    layer = MoELayer(a.d_model, a.d_hidden, E, top_k=k, capacity_factor=1.25, random_routing=False,
                                     mesh=mesh, gating=gating, expert_dispatch=dispatch, ranks_per_node=per_node)
                    with torch.no_grad():
                        layer.router.weight.normal_(0.0, a.router_std)
                    layers[dispatch] = layer
                g = torch.Generator().manual_seed(100 + info.rank)
                x = torch.randn(1, T, a.d_model, generator=g).requires_grad_(True)
                gy = torch.randn(1, T, a.d_model, generator=g)
                times = {d: [] for d in layers}
                sent, outs = {}, {}
                for r in range(a.rounds + 1):
                    for d in list(layers)[::1 if r % 2 else -1]:
                        layers[d].zero_grad(set_to_none=True)
                        x.grad = None
                        SENT.update(bytes=0, node_bytes=0, calls=0)
                        dist.barrier()
                        t0 = time.perf_counter()
                        y = layers[d](x)[0]
                        (y * gy).sum().backward()
                        dt = torch.tensor([time.perf_counter() - t0])
                        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                        if r:
                            times[d].append(float(dt))
                        sent[d] = dict(SENT)
                        outs[d] = y.detach()
                # every rank's bytes, summed (collective)
                b = torch.tensor([[float(sent[d]["bytes"]), float(sent[d]["node_bytes"])] for d in dispatches])
                dist.all_reduce(b)
                t = {d: statistics.median(v) for d, v in times.items()}
                for i, d in enumerate(dispatches):
                    rows.append({"experts": E, "tokens": T, "top_k": k, "dispatch": d, "ms": 1e3 * t[d],
                                 "time_ratio": t[d] / t["choice"], "mb": float(b[i, 0]) / 2**20,
                                 "node_mb": float(b[i, 1]) / 2**20,
                                 "bytes_ratio": float(b[i, 0] / b[0, 0]) if b[0, 0] else 1.0,
                                 "node_bytes_ratio": float(b[i, 1] / b[0, 1]) if b[0, 1] else 1.0,
                                 "calls": sent[d]["calls"],
                                 "max_diff": float((outs[d] - outs["choice"]).abs().max())})
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--top-k", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-hidden", type=int, default=512)
    ap.add_argument("--router-std", type=float, default=0.1)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="simulated nodes of this many ranks (torchrun's numbering); adds the per-node dispatch")
    ap.add_argument("--group-limited", action="store_true",
                    help="one router group per node (per rank without --ranks-per-node), one group per token")
    ap.add_argument("--rounds", type=int, default=7)
    add_link_argument(ap)
    a = ap.parse_args(argv)
    net = nodes_for(a.link_mbit, a.nproc, a.ranks_per_node or 1)
    with net or contextlib.nullcontext():
        link = f", nodes linked at {net.measure_mbit():.0f} Mbit/s (measured)" if net else ""
        rows = launch(_worker, (a, net), nproc=a.nproc)[0]
    nodes = f", nodes of {a.ranks_per_node} ranks" if a.ranks_per_node else ""
    nodes += link
    print(f"ep={a.nproc}{nodes} d_model={a.d_model} d_hidden={a.d_hidden}"
          f"{' group-limited' if a.group_limited else ''}: each dispatch against per-choice (bytes: every rank's to "
          "other ranks and to other nodes, forward + backward)")
    node_cols = " MB to other nodes | ratio |" if a.ranks_per_node else ""
    print(f"| experts | tokens/rank | k | dispatch | ms | time ratio | MB to other ranks | ratio |{node_cols} "
          "all-to-alls | max output diff |")
    print("|---" * (10 + 2 * bool(a.ranks_per_node)) + "|")
    for r in rows:
        node = f" {r['node_mb']:.2f} | {r['node_bytes_ratio']:.2f} |" if a.ranks_per_node else ""
        print(f"| {r['experts']} | {r['tokens']} | {r['top_k']} | {r['dispatch']} | {r['ms']:.1f} | "
              f"{r['time_ratio']:.2f} | {r['mb']:.2f} | {r['bytes_ratio']:.2f} |{node} {r['calls']} | "
              f"{r['max_diff']:.1e} |")
    return rows


if __name__ == "__main__":
    main()
