"""GNN training: podscale's GraphSAGE against PyG's, and METIS against random partitions (DistDGL's Fig. 10).

1. **Full-graph GraphSAGE epoch time, one process**: podscale's :class:`~podscale.models.graphsage.GNN` and PyG's
   ``SAGEConv`` (mean aggregation, on ``edge_index``; PyG core without torch-sparse) with the same weights on
   the same generated R-MAT graph; forward + backward + Adam step, alternating rounds, medians and their
   ratio (podscale / PyG; below 1 is faster), and the largest difference of the logits.
2. **METIS vs random partitions at 2 ranks**: mini-batch GraphSAGE (fan-outs 15, 10) through the GNN task on
   the same R-MAT graph partitioned both ways: epoch time, remote bytes per epoch (features and sampling
   requests between ranks), sampled edges per second, and per rank the resident memory after training and the feature
   bytes it holds against the whole graph's.

Not run here: mini-batch sampling + training against PyG's ``NeighborLoader``, which needs torch-sparse or
pyg-lib built from source.

    python bench/gnn.py [--small] [--scale 19] [--rounds 5] [--epochs 2]

``--small`` checks the script in a minute (R-MAT scale 13); the full setting (scale 19, about 15 M directed
edges) is the >= 10 M edge comparison.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from podscale.graph import rmat  # noqa: E402
from podscale.graph.partition import assign, write_partitions  # noqa: E402
from podscale.graph.sampler import full_block  # noqa: E402
from podscale.models.graphsage import GNN, GNNConfig  # noqa: E402


def full_graph(scale: int, features: int, hidden: int, rounds: int) -> dict:
    from torch_geometric.nn import SAGEConv

    g = rmat(scale, features=features, seed=0)
    x, y = torch.from_numpy(g.features), torch.from_numpy(g.labels)
    train = torch.from_numpy(g.splits["train"])
    src, dst = g.edges()
    edge_index = torch.from_numpy(np.stack([src, dst]))
    blk = full_block(g.indptr, g.indices)
    torch.manual_seed(0)
    ours = GNN(GNNConfig("graphsage", features, hidden, g.num_classes, 2, 0.0))
    pyg = torch.nn.ModuleList([SAGEConv(features, hidden, aggr="mean"), SAGEConv(hidden, g.num_classes, aggr="mean")])
    with torch.no_grad():
        for a, b in zip(ours.convs, pyg):
            b.lin_l.weight.copy_(a.lin_neigh.weight)
            b.lin_l.bias.copy_(a.lin_neigh.bias)
            b.lin_r.weight.copy_(a.lin_self.weight)

    def pyg_forward(h):
        h = F.relu(pyg[0](h, edge_index))
        return pyg[1](h, edge_index)

    with torch.no_grad():
        diff = (ours([blk, blk], x) - pyg_forward(x)).abs().max().item()
    opt_o = torch.optim.Adam(ours.parameters(), lr=1e-3)
    opt_p = torch.optim.Adam(pyg.parameters(), lr=1e-3)

    def epoch(fwd, opt):
        t = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(fwd()[train], y[train]).backward()
        opt.step()
        return time.perf_counter() - t

    times = {"podscale": [], "pyg": []}
    epoch(lambda: ours([blk, blk], x), opt_o)  # warm-up (builds the block's adjacency once)
    epoch(lambda: pyg_forward(x), opt_p)
    for _ in range(rounds):
        times["podscale"].append(epoch(lambda: ours([blk, blk], x), opt_o))
        times["pyg"].append(epoch(lambda: pyg_forward(x), opt_p))
    a, b = statistics.median(times["podscale"]), statistics.median(times["pyg"])
    return {"nodes": g.num_nodes, "edges": g.num_edges, "podscale_s": a, "pyg_s": b, "ratio": a / b,
            "max_logit_diff": diff}


def _toml(d: dict) -> str:
    out = []
    for sec, vals in d.items():
        out.append(f"[{sec}]")
        out += [f"{k} = {json.dumps(v)}" for k, v in vals.items() if v is not None]
    return "\n".join(out) + "\n"


def worker(cfg_path: str, epochs: int) -> dict:
    """One rank: the GNN task's mini-batches and its model under the trunk's engine, ``epochs`` epochs."""
    from podscale import parallelize
    from podscale.config import load_config
    from podscale.runtime.mesh import Mesh
    from podscale.runtime.process import init_process
    from podscale.tasks import task_for

    cfg = load_config(cfg_path)
    info = init_process(device="cpu")
    torch.set_num_threads(1)
    mesh = Mesh.build(info.device, dp=info.world_size)
    task = task_for(cfg)
    torch.manual_seed(cfg.run.seed)
    engine = parallelize(task.build_model(), mesh, cfg, task)
    source = task.train_data(mesh.local_rank("dp"), mesh.size("dp"))
    stats = []
    for _ in range(epochs * source.steps_per_epoch):
        engine.step(source.next_step())
        if source.consumed % source.steps_per_epoch == 0:
            stats.append(dict(source.last_epoch))
    ctx = task.context(mesh.local_rank("dp"), mesh.size("dp"))
    engine.close()
    return {"epochs": stats, "steps_per_epoch": source.steps_per_epoch,
            "feature_bytes": int(ctx.part.features.nbytes),
            # resident memory now (ru_maxrss would carry the launching process's peak across fork + exec)
            "rss_mb": psutil.Process().memory_info().rss / 2**20}


def partitions(scale: int, features: int, epochs: int, batch: int) -> list[dict]:
    from podscale.runtime.launcher import launch

    g = rmat(scale, features=features, seed=0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in ("metis", "random"):
            t = time.perf_counter()
            part = assign(g, 2, method)
            meta = write_partitions(g, part, Path(tmp) / method, method)
            t_part = time.perf_counter() - t
            cfg = {"run": {"name": method, "out_dir": tmp, "seed": 0},
                   "model": {"kind": "graphsage", "graph": "rmat", "scale": scale, "features": features,
                             "hidden": 64, "fanouts": [15, 10], "dropout": 0.0, "partitions": str(Path(tmp) / method),
                             "feature_cache_rows": 0},
                   "parallel": {"nproc": 2}, "train": {"global_batch": batch, "micro_batch": batch // 2}}
            path = Path(tmp) / f"{method}.toml"
            path.write_text(_toml(cfg))
            res = launch(worker, (str(path), epochs), nproc=2)
            last = [res[r]["epochs"][-1] for r in (0, 1)]
            rows.append({"method": method, "partition_s": t_part, "edge_cut": meta["report"]["edge_cut"],
                         "halo_share": meta["report"]["halo_share"], "steps_per_epoch": res[0]["steps_per_epoch"],
                         "epoch_s": max(x["epoch_time_s"] for x in last),
                         "remote_mb_per_epoch": sum(x["remote_bytes_per_epoch"] for x in last) / 2**20,
                         "sampled_edges_per_s": sum(x["sampled_edges_per_s"] for x in last),
                         "feature_share_per_rank": [res[r]["feature_bytes"] / g.features.nbytes for r in (0, 1)],
                         "rss_mb": [round(res[r]["rss_mb"]) for r in (0, 1)]})
    return rows, g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="R-MAT scale 13, 2 rounds, 1 epoch: checks the script")
    ap.add_argument("--scale", type=int, default=19, help="log2 of the R-MAT graph's nodes")
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2048, help="seed nodes per step over both ranks")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.small:
        args.scale, args.rounds, args.epochs, args.batch = 13, 2, 1, 256
    fg = full_graph(args.scale, args.features, args.hidden, args.rounds)
    print(f"full-graph GraphSAGE, R-MAT scale {args.scale} ({fg['nodes']} nodes, {fg['edges']} edges), "
          f"{args.features} features, hidden {args.hidden}, one process: podscale {1e3 * fg['podscale_s']:.1f} ms, "
          f"PyG {1e3 * fg['pyg_s']:.1f} ms per epoch, ratio {fg['ratio']:.2f} (podscale / PyG); "
          f"largest logit difference {fg['max_logit_diff']:.1e}", flush=True)
    rows, g = partitions(args.scale, args.features, args.epochs, args.batch)
    for r in rows:
        print(f"{r['method']:6s} 2 partitions: edge cut {r['edge_cut']:.1%}, halo {r['halo_share']:.1%}, "
              f"{r['steps_per_epoch']} steps/epoch, epoch {r['epoch_s']:.2f} s, remote "
              f"{r['remote_mb_per_epoch']:.1f} MiB/epoch, {r['sampled_edges_per_s']:,.0f} sampled edges/s, "
              f"features per rank {', '.join(f'{x:.2f}' for x in r['feature_share_per_rank'])} of the graph's, "
              f"RSS {r['rss_mb']} MiB (partitioned in {r['partition_s']:.1f} s)")
    m, rnd = rows
    print(f"METIS / random: epoch time {m['epoch_s'] / rnd['epoch_s']:.2f}, remote bytes "
          f"{m['remote_mb_per_epoch'] / max(rnd['remote_mb_per_epoch'], 1e-9):.2f}, sampled edges/s "
          f"{m['sampled_edges_per_s'] / rnd['sampled_edges_per_s']:.2f}")
    print("not run: mini-batch sampling + training against PyG's NeighborLoader (needs torch-sparse or pyg-lib "
          "built from source)")
    if args.json:
        Path(args.json).write_text(json.dumps({"full_graph": fg, "partitions": rows}, indent=1))


if __name__ == "__main__":
    main()
