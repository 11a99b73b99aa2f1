"""GNN training: podscale's GraphSAGE against PyG's, and METIS against random partitions (DistDGL's Fig. 10).

1. **Full-graph GraphSAGE epoch time, one process**: podscale's :class:`~podscale.models.graphsage.GNN` and PyG's
   ``SAGEConv`` (mean aggregation, on ``edge_index``; PyG core without torch-sparse) with the same weights on
   the same generated R-MAT graph; forward + backward + Adam step, alternating rounds, medians and their
   ratio (podscale / PyG; below 1 is faster), and the largest difference of the logits.
2. **METIS vs random partitions at 2 and 4 ranks**: mini-batch GraphSAGE (fan-outs 15, 10) through the GNN task on
   the same R-MAT graph partitioned both ways: epoch time, remote bytes per epoch (features and sampling
   requests between ranks), sampled edges per second, and per rank the resident memory after training and the feature
   bytes it holds against the whole graph's.

3. **Mini-batch GraphSAGE against PyG's ``NeighborLoader``, one process** (sampling + forward + backward +
   Adam step per batch of seeds, fan-outs 15, 10): runs only where PyG has a sampler, i.e. ``pyg-lib`` or
   ``torch-sparse`` is installed; PyG 2.8 has no pure-Python fallback (``NeighborSampler`` raises
   ImportError without either), so on this machine, where neither is (torch-sparse builds from source in
   about 13 min), the script says it skipped it.

    python bench/gnn.py [--small] [--scale 19] [--parts 2,4] [--rounds 5] [--epochs 2] [--max-steps N]

``--small`` checks the script in a minute (R-MAT scale 13); the full setting (scale 19, about 15 M directed
edges) is the >= 10 M edge comparison.  ``--max-steps N`` trains only N steps per partitioned run (a check
that the setting runs; per-epoch figures are then extrapolated from the steps' medians).
"""
from __future__ import annotations

import argparse
import json
import statistics
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


def worker(cfg_path: str, epochs: int, max_steps: int = 0) -> dict:
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
    steps = epochs * source.steps_per_epoch if not max_steps else min(max_steps, epochs * source.steps_per_epoch)
    times, edges, remote = [], 0, 0
    for _ in range(steps):
        t = time.perf_counter()
        batches = source.next_step()
        engine.step(batches)
        times.append(time.perf_counter() - t)
        edges += sum(b.sampled_edges for b in batches)
        remote += sum(b.remote for b in batches)
    ctx = task.context(mesh.local_rank("dp"), mesh.size("dp"))
    engine.close()
    spe = source.steps_per_epoch
    # per epoch from the steps (whole epochs, or the first max_steps steps): sampling runs ahead in the
    # background, so a step's time is what training waits for
    stats = {"epoch_time_s": statistics.median(times[1:] or times) * spe,
             "remote_bytes_per_epoch": remote / steps * spe,
             "sampled_edges_per_s": edges / max(sum(times), 1e-9)}
    return {"epochs": [stats], "steps": steps, "steps_per_epoch": spe,
            "feature_bytes": int(ctx.part.features.nbytes),
            # resident memory now (ru_maxrss would carry the launching process's peak across fork + exec)
            "rss_mb": psutil.Process().memory_info().rss / 2**20}


def partitions(g, scale: int, features: int, epochs: int, batch: int, parts: int, max_steps: int) -> list[dict]:
    from podscale.runtime.launcher import launch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in ("metis", "random"):
            t = time.perf_counter()
            part = assign(g, parts, method)
            meta = write_partitions(g, part, Path(tmp) / method, method)
            t_part = time.perf_counter() - t
            cfg = {"run": {"name": method, "out_dir": tmp, "seed": 0},
                   "model": {"kind": "graphsage", "graph": "rmat", "scale": scale, "features": features,
                             "hidden": 64, "fanouts": [15, 10], "dropout": 0.0, "partitions": str(Path(tmp) / method),
                             "feature_cache_rows": 0},
                   "parallel": {"nproc": parts}, "train": {"global_batch": batch, "micro_batch": batch // parts}}
            path = Path(tmp) / f"{method}.toml"
            path.write_text(_toml(cfg))
            res = launch(worker, (str(path), epochs, max_steps), nproc=parts)
            last = [res[r]["epochs"][-1] for r in range(parts)]
            rows.append({"method": method, "parts": parts, "partition_s": t_part,
                         "edge_cut": meta["report"]["edge_cut"],
                         "halo_share": meta["report"]["halo_share"], "balance": meta["report"]["balance"],
                         "steps_per_epoch": res[0]["steps_per_epoch"], "steps": res[0]["steps"],
                         "epoch_s": max(x["epoch_time_s"] for x in last),
                         "remote_mb_per_epoch": sum(x["remote_bytes_per_epoch"] for x in last) / 2**20,
                         "sampled_edges_per_s": sum(x["sampled_edges_per_s"] for x in last),
                         "feature_share_per_rank": [res[r]["feature_bytes"] / g.features.nbytes for r in range(parts)],
                         "rss_mb": [round(res[r]["rss_mb"]) for r in range(parts)]})
    return rows


def minibatch_vs_pyg(g, features: int, hidden: int, batch: int, rounds: int, fanouts=(15, 10)) -> dict:
    """Mini-batch GraphSAGE on one process: podscale's sampler (:func:`~podscale.graph.sampler.sample_csc`
    per layer, as :class:`~podscale.graph.sampler.DistSampler` on one rank) and model against PyG's
    ``NeighborLoader`` and ``SAGEConv``; the median time of a batch (sample, forward, backward, Adam step)
    over ``rounds`` batches each, alternating.  Skipped (a reason) where PyG has no sampler."""
    import torch_geometric.typing as pyg_typing
    if not (pyg_typing.WITH_PYG_LIB or pyg_typing.WITH_TORCH_SPARSE):
        return {"skipped": "PyG's NeighborLoader needs pyg-lib or torch-sparse (PyG 2.8 has no pure-Python "
                           "sampler) and neither is installed"}
    from torch_geometric.data import Data
    from torch_geometric.loader import NeighborLoader
    from torch_geometric.nn import SAGEConv

    from podscale.graph.sampler import make_block, sample_csc

    x, y = torch.from_numpy(g.features), torch.from_numpy(g.labels)
    train = g.splits["train"]
    src, dst = g.edges()
    data = Data(x=x, edge_index=torch.from_numpy(np.stack([src, dst])), y=y, num_nodes=g.num_nodes)
    # PyG lists the fan-outs from the seeds outwards; podscale's are input layer first
    loader = iter(NeighborLoader(data, num_neighbors=list(reversed(fanouts)), batch_size=batch,
                                 input_nodes=torch.from_numpy(train), shuffle=True))
    ours = GNN(GNNConfig("graphsage", features, hidden, g.num_classes, 2, 0.0))
    pyg = torch.nn.ModuleList([SAGEConv(features, hidden, aggr="mean"), SAGEConv(hidden, g.num_classes, aggr="mean")])
    opt_o = torch.optim.Adam(ours.parameters(), lr=1e-3)
    opt_p = torch.optim.Adam(pyg.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)

    def step_ours() -> tuple[float, int]:
        t = time.perf_counter()
        seeds = rng.choice(train, min(batch, len(train)), replace=False)
        blocks, dst_ = [], seeds
        for k in reversed(fanouts):
            counts, nbrs = sample_csc(g.indptr, g.indices, dst_, k, rng)
            blocks.append(make_block(dst_, counts, nbrs))
            dst_ = blocks[-1].src_ids.numpy()
        blocks = blocks[::-1]
        opt_o.zero_grad()
        F.cross_entropy(ours(blocks, x[blocks[0].src_ids]), y[torch.from_numpy(seeds)]).backward()
        opt_o.step()
        return time.perf_counter() - t, sum(b.num_edges for b in blocks)

    def step_pyg() -> tuple[float, int]:
        t = time.perf_counter()
        b = next(loader)
        opt_p.zero_grad()
        h = F.relu(pyg[0](b.x, b.edge_index))
        out = pyg[1](h, b.edge_index)[: b.batch_size]
        F.cross_entropy(out, b.y[: b.batch_size]).backward()
        opt_p.step()
        return time.perf_counter() - t, int(b.edge_index.shape[1])

    step_ours(), step_pyg()  # warm-up
    t_o, t_p, e_o, e_p = [], [], 0, 0
    for _ in range(rounds):
        a, ea = step_ours()
        b, eb = step_pyg()
        t_o.append(a), t_p.append(b)
        e_o, e_p = e_o + ea, e_p + eb
    a, b = statistics.median(t_o), statistics.median(t_p)
    return {"podscale_s": a, "pyg_s": b, "ratio": a / b, "podscale_edges_per_batch": e_o / rounds,
            "pyg_edges_per_batch": e_p / rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="R-MAT scale 13, 2 rounds, 1 epoch: checks the script")
    ap.add_argument("--scale", type=int, default=19, help="log2 of the R-MAT graph's nodes")
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2048, help="seed nodes per step over both ranks")
    ap.add_argument("--parts", default="2,4", help="partition counts to compare METIS and random at")
    ap.add_argument("--max-steps", type=int, default=0, help="train at most this many steps per partitioned run")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.small:
        args.scale, args.rounds, args.epochs, args.batch = 13, 2, 1, 256
    fg = full_graph(args.scale, args.features, args.hidden, args.rounds)
    print(f"full-graph GraphSAGE, R-MAT scale {args.scale} ({fg['nodes']} nodes, {fg['edges']} edges), "
          f"{args.features} features, hidden {args.hidden}, one process: podscale {1e3 * fg['podscale_s']:.1f} ms, "
          f"PyG {1e3 * fg['pyg_s']:.1f} ms per epoch, ratio {fg['ratio']:.2f} (podscale / PyG); "
          f"largest logit difference {fg['max_logit_diff']:.1e}", flush=True)
    mb = minibatch_vs_pyg(rmat(args.scale, features=args.features, seed=0), args.features, args.hidden,
                          args.batch // 2, args.rounds)
    if "skipped" in mb:
        print(f"mini-batch GraphSAGE vs PyG NeighborLoader: skipped: {mb['skipped']}", flush=True)
    else:
        print(f"mini-batch GraphSAGE (fan-outs 15, 10, {args.batch // 2} seeds), one process: podscale "
              f"{1e3 * mb['podscale_s']:.1f} ms, PyG NeighborLoader {1e3 * mb['pyg_s']:.1f} ms per batch, ratio "
              f"{mb['ratio']:.2f} (podscale / PyG); sampled edges per batch {mb['podscale_edges_per_batch']:,.0f} vs "
              f"{mb['pyg_edges_per_batch']:,.0f}", flush=True)
    g = rmat(args.scale, features=args.features, seed=0)
    rows = []
    for parts in (int(p) for p in args.parts.split(",")):
        rs = partitions(g, args.scale, args.features, args.epochs, args.batch, parts, args.max_steps)
        rows += rs
        for r in rs:
            print(f"{r['method']:6s} {parts} partitions: edge cut {r['edge_cut']:.1%}, halo {r['halo_share']:.1%}, "
                  f"balance {r['balance']}, {r['steps']} of {r['steps_per_epoch']} steps/epoch run, epoch "
                  f"{r['epoch_s']:.2f} s, remote {r['remote_mb_per_epoch']:.1f} MiB/epoch, "
                  f"{r['sampled_edges_per_s']:,.0f} sampled edges/s, features per rank "
                  f"{', '.join(f'{x:.2f}' for x in r['feature_share_per_rank'])} of the graph's, RSS {r['rss_mb']} MiB "
                  f"(partitioned in {r['partition_s']:.1f} s)", flush=True)
        m, rnd = rs
        print(f"METIS / random at {parts} partitions: epoch time {m['epoch_s'] / rnd['epoch_s']:.2f}, remote bytes "
              f"{m['remote_mb_per_epoch'] / max(rnd['remote_mb_per_epoch'], 1e-9):.2f}, sampled edges/s "
              f"{m['sampled_edges_per_s'] / rnd['sampled_edges_per_s']:.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"full_graph": fg, "minibatch": mb, "partitions": rows}, indent=1))


if __name__ == "__main__":
    main()
