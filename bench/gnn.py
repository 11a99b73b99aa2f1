"""GNN training: podscale's GraphSAGE against PyG's, and METIS against random partitions (DistDGL's Fig. 10).

Three parts (``--only`` picks some), all on one generated graph (R-MAT by default, ``--graph sbm``
for planted communities; generated once per run):

1. ``full``: **full-graph GraphSAGE epoch time, one process**: podscale's :class:`~podscale.models.graphsage.GNN`
   (one CSR sparse product per layer) and PyG's ``SAGEConv`` (mean aggregation by scatter over ``edge_index``)
   with the same weights; forward + backward + Adam step, alternating, the medians of ``--rounds`` epochs after a
   warm-up and their ratio (podscale / PyG; below 1 is faster), and the largest difference of the logits.
2. ``minibatch``: **mini-batch GraphSAGE against PyG's ``NeighborLoader``, one process** (fan-outs 15, 10,
   ``--batch / 2`` seeds a batch; the same seeds in the same order and the same weights on both sides; sample,
   gather the features, forward, backward, Adam step): the medians of ``--batches`` batches, alternating, of the
   whole step and of its sampling + gathering.  It needs PyG's sampler (torch-sparse or pyg-lib; PyG 2.8 has no
   pure-Python one): without either the script says it skipped it.
3. ``partitions``: **METIS vs random partitions at 2 and 4 ranks**: mini-batch GraphSAGE (fan-outs 15, 10)
   through the GNN task on the graph partitioned both ways: epoch time (the median step's time times the
   steps of an epoch), remote bytes per epoch (features and sampling requests between ranks), sampled edges per
   second, and per rank the resident memory after training and the feature bytes it holds against the whole
   graph's.  ``--partition-dir`` keeps the partitions and reuses them on the next run (METIS at scale 19 takes
   minutes); ``--max-steps N`` trains only N steps per run (per-epoch figures from those steps).

Every part prints what it measured as it finishes; the last line gives the wall time of each part.

    python bench/gnn.py [--small] [--scale 19] [--only full,minibatch,partitions] [--parts 2,4] [--rounds 3]
                        [--batches 30] [--epochs 1] [--max-steps N] [--partition-dir DIR] [--json FILE]

``--small`` checks the script in a few minutes (R-MAT scale 13); scale 19 (524,288 nodes, 15.5 M directed
edges) is the >= 10 M edge comparison.
"""
from __future__ import annotations

import argparse
import json
import resource
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

from podscale.graph.source import load_graph  # noqa: E402
from podscale.graph.partition import assign, read_meta, write_partitions  # noqa: E402
from podscale.graph.sampler import full_block  # noqa: E402
from podscale.models.graphsage import GNN, GNNConfig  # noqa: E402


def _same_models(features: int, hidden: int, classes: int):
    """podscale's 2-layer GraphSAGE (mean aggregator, no dropout) and PyG's (two ``SAGEConv``), with the same
    weights: ``lin_l`` is the neighbours' map, ``lin_r`` the node's own (no bias)."""
    from torch_geometric.nn import SAGEConv

    torch.manual_seed(0)
    ours = GNN(GNNConfig("graphsage", features, hidden, classes, 2, 0.0))
    pyg = torch.nn.ModuleList([SAGEConv(features, hidden, aggr="mean"), SAGEConv(hidden, classes, aggr="mean")])
    with torch.no_grad():
        for a, b in zip(ours.convs, pyg):
            b.lin_l.weight.copy_(a.lin_neigh.weight)
            b.lin_l.bias.copy_(a.lin_neigh.bias)
            b.lin_r.weight.copy_(a.lin_self.weight)
    return ours, pyg


def full_graph(g, features: int, hidden: int, rounds: int) -> dict:
    x, y = torch.from_numpy(g.features), torch.from_numpy(g.labels)
    train = torch.from_numpy(g.splits["train"])
    src, dst = g.edges()
    edge_index = torch.from_numpy(np.stack([src, dst]))
    blk = full_block(g.indptr, g.indices)
    ours, pyg = _same_models(features, hidden, g.num_classes)

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

    t0 = time.perf_counter()
    cfg = load_config(cfg_path)
    info = init_process(device="cpu")
    torch.set_num_threads(1)
    mesh = Mesh.build(info.device, dp=info.world_size)
    task = task_for(cfg)
    torch.manual_seed(cfg.run.seed)
    engine = parallelize(task.build_model(), mesh, cfg, task)
    source = task.train_data(mesh.local_rank("dp"), mesh.size("dp"))
    setup = time.perf_counter() - t0
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
    return {"epochs": [stats], "steps": steps, "steps_per_epoch": spe, "setup_s": setup,
            "feature_bytes": int(ctx.part.features.nbytes),
            # resident memory now (ru_maxrss would carry the launching process's peak across fork + exec)
            "rss_mb": psutil.Process().memory_info().rss / 2**20}


def _partitioned(g, parts: int, method: str, where: Path) -> tuple[dict, float, float]:
    """The partitions of ``g`` into ``parts`` by ``method`` in the folder ``where``: read back when a folder
    of the same graph is there, else partitioned and written; returns its description and the seconds
    partitioning and writing took (0 when read back)."""
    if (where / "meta.json").is_file():
        meta = read_meta(where)
        if (meta["num_nodes"], meta["num_edges"], meta["feature_dim"], meta["num_parts"], meta["method"]) == \
                (g.num_nodes, g.num_edges, g.features.shape[1], parts, method):
            return meta, 0.0, 0.0
        raise SystemExit(f"'{where}' holds partitions of another graph or layout: remove it or choose another "
                         "--partition-dir")
    t = time.perf_counter()
    part = assign(g, parts, method)
    t_part = time.perf_counter() - t
    t = time.perf_counter()
    meta = write_partitions(g, part, where, method)
    return meta, t_part, time.perf_counter() - t


def partitions(g, graph: dict, features: int, epochs: int, batch: int, parts: int, max_steps: int,
               keep: str | None = None) -> list[dict]:
    from podscale.runtime.launcher import launch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(keep) if keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for method in ("metis", "random"):
            where = root / f"{g.name}-n{g.num_nodes}-f{features}-{method}-{parts}"
            meta, t_part, t_write = _partitioned(g, parts, method, where)
            cfg = {"run": {"name": method, "out_dir": tmp, "seed": 0},
                   "model": {"kind": "graphsage", **graph, "features": features,
                             "hidden": 64, "fanouts": [15, 10], "dropout": 0.0, "partitions": str(where),
                             "feature_cache_rows": 0},
                   "parallel": {"nproc": parts}, "train": {"global_batch": batch, "micro_batch": batch // parts}}
            path = Path(tmp) / f"{method}.toml"
            path.write_text(_toml(cfg))
            t = time.perf_counter()
            res = launch(worker, (str(path), epochs, max_steps), nproc=parts)
            t_launch = time.perf_counter() - t
            last = [res[r]["epochs"][-1] for r in range(parts)]
            rows.append({"method": method, "parts": parts, "partition_s": t_part, "write_s": t_write,
                         "launch_s": t_launch, "edge_cut": meta["report"]["edge_cut"],
                         "halo_share": meta["report"]["halo_share"], "balance": meta["report"]["balance"],
                         "steps_per_epoch": res[0]["steps_per_epoch"], "steps": res[0]["steps"],
                         "epoch_s": max(x["epoch_time_s"] for x in last),
                         "remote_mb_per_epoch": sum(x["remote_bytes_per_epoch"] for x in last) / 2**20,
                         "sampled_edges_per_s": sum(x["sampled_edges_per_s"] for x in last),
                         "feature_share_per_rank": [res[r]["feature_bytes"] / g.features.nbytes for r in range(parts)],
                         "rss_mb": [round(res[r]["rss_mb"]) for r in range(parts)],
                         "setup_s": [round(res[r]["setup_s"], 1) for r in range(parts)]})
    return rows


def minibatch_vs_pyg(g, features: int, hidden: int, batch: int, batches: int, fanouts=(15, 10)) -> dict:
    """Mini-batch GraphSAGE on one process, per batch of seed nodes: sample the 2-hop neighbourhood, gather
    its input features, forward, backward, Adam step.

    * podscale: :func:`~podscale.graph.sampler.sample_blocks` over
      :func:`~podscale.graph.sampler.sample_csc` (what :class:`~podscale.graph.sampler.DistSampler` runs on
      one rank) into CSR blocks, ``x[src_ids]``, :class:`~podscale.models.graphsage.GNN`;
    * PyG: ``NeighborLoader`` (C++ sampling in torch-sparse or pyg-lib, COO ``edge_index`` per batch, features
      gathered by the loader) and ``SAGEConv`` (mean aggregation by scatter over ``edge_index``).

    Both start from the same weights and take the same seeds in the same order (one seeded permutation of
    the training nodes, cut into batches of ``batch``; the loader gets it with ``shuffle=False``), without
    replacement, fan-outs ``fanouts`` input layer first (PyG lists them from the seeds outwards), alternating
    batch by batch after one warm-up batch each; the medians of ``batches`` batches.  Skipped (a reason)
    where PyG has no sampler."""
    import torch_geometric.typing as pyg_typing
    if not (pyg_typing.WITH_PYG_LIB or pyg_typing.WITH_TORCH_SPARSE):
        return {"skipped": "PyG's NeighborLoader needs pyg-lib or torch-sparse (PyG 2.8 has no pure-Python "
                           "sampler) and neither is installed"}
    from torch_geometric.data import Data
    from torch_geometric.loader import NeighborLoader

    from podscale.graph.sampler import sample_blocks, sample_csc

    x, y = torch.from_numpy(g.features), torch.from_numpy(g.labels)
    src, dst = g.edges()
    data = Data(x=x, edge_index=torch.from_numpy(np.stack([src, dst])), y=y, num_nodes=g.num_nodes)
    order = np.random.default_rng(0).permutation(g.splits["train"])
    batches = min(batches + 1, len(order) // batch)
    order = order[: batches * batch]
    loader = iter(NeighborLoader(data, num_neighbors=list(reversed(fanouts)), batch_size=batch,
                                 input_nodes=torch.from_numpy(order), shuffle=False, replace=False))
    ours, pyg = _same_models(features, hidden, g.num_classes)
    opt_o = torch.optim.Adam(ours.parameters(), lr=1e-3)
    opt_p = torch.optim.Adam(pyg.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)

    def hop(d, k):
        return sample_csc(g.indptr, g.indices, d, k, rng)

    def step_ours(i: int) -> tuple[float, float, int]:
        t = time.perf_counter()
        seeds = order[i * batch:(i + 1) * batch]
        blocks = sample_blocks(hop, seeds, list(fanouts))
        xb = x[blocks[0].src_ids]
        t_s = time.perf_counter()
        opt_o.zero_grad()
        F.cross_entropy(ours(blocks, xb), y[torch.from_numpy(seeds)]).backward()
        opt_o.step()
        return time.perf_counter() - t, t_s - t, sum(b.num_edges for b in blocks)

    def step_pyg(i: int) -> tuple[float, float, int]:
        t = time.perf_counter()
        b = next(loader)
        t_s = time.perf_counter()
        opt_p.zero_grad()
        h = F.relu(pyg[0](b.x, b.edge_index))
        out = pyg[1](h, b.edge_index)[: b.batch_size]
        F.cross_entropy(out, b.y[: b.batch_size]).backward()
        opt_p.step()
        t_e = time.perf_counter()
        # the loader took the same seeds, in the same order, as podscale's batch i (its first batch_size nodes)
        assert torch.equal(b.n_id[: b.batch_size], torch.from_numpy(order[i * batch:(i + 1) * batch]))
        return t_e - t, t_s - t, int(b.edge_index.shape[1])

    step_ours(0), step_pyg(0)  # warm-up: the first batch of each
    res = {"podscale": [], "pyg": []}
    for i in range(1, batches):
        res["podscale"].append(step_ours(i))
        res["pyg"].append(step_pyg(i))
    out = {"batches": batches - 1, "seeds_per_batch": batch}
    for side, rows in res.items():
        out[f"{side}_s"] = statistics.median(r[0] for r in rows)
        out[f"{side}_sample_s"] = statistics.median(r[1] for r in rows)
        out[f"{side}_edges_per_batch"] = sum(r[2] for r in rows) / len(rows)
        out[f"{side}_sampled_edges_per_s"] = sum(r[2] for r in rows) / sum(r[0] for r in rows)
    out["ratio"] = out["podscale_s"] / out["pyg_s"]
    out["sample_ratio"] = out["podscale_sample_s"] / out["pyg_sample_s"]
    return out


PHASES = ("full", "minibatch", "partitions")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="R-MAT scale 13, 2 rounds, 1 epoch: checks the script")
    ap.add_argument("--graph", choices=("rmat", "sbm"), default="rmat", help="the generated graph: R-MAT "
                    "(Graph500 parameters: power-law, little community structure) or a stochastic block model "
                    "(planted communities, the GNN task's embedded default; average degree 10, 8 blocks)")
    ap.add_argument("--scale", type=int, default=19, help="log2 of the R-MAT graph's nodes")
    ap.add_argument("--nodes", type=int, default=1 << 20, help="nodes of the sbm graph (2^20: ~10.5M directed "
                    "edges)")
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="measured full-graph epochs per side (after a warm-up)")
    ap.add_argument("--batches", type=int, default=30, help="measured mini-batches per side against PyG")
    ap.add_argument("--epochs", type=int, default=1, help="epochs per partitioned run (the epoch time is the "
                    "median step's times the steps of an epoch)")
    ap.add_argument("--batch", type=int, default=2048, help="seed nodes per step over both ranks (half of it "
                    "per batch against PyG)")
    ap.add_argument("--parts", default="2,4", help="partition counts to compare METIS and random at")
    ap.add_argument("--max-steps", type=int, default=0, help="train at most this many steps per partitioned run")
    ap.add_argument("--only", default=",".join(PHASES),
                    help=f"comma-separated parts of the benchmark to run, of {', '.join(PHASES)}")
    ap.add_argument("--partition-dir", help="keep the partitions here and reuse them when they are there "
                    "(the same scale and features: a rerun skips METIS and the writing)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.small:
        args.scale, args.rounds, args.epochs, args.batch, args.batches = 13, 2, 1, 256, 10
    only = [p for p in args.only.split(",") if p]
    if not only or set(only) - set(PHASES):
        ap.error(f"--only={args.only}: choose from {', '.join(PHASES)}")
    wall = {}
    t = time.perf_counter()
    # the graph as the GNN task builds it from the same settings (the partitioned runs' workers rebuild it)
    graph = {"graph": "rmat", "scale": args.scale} if args.graph == "rmat" else {"graph": "sbm", "nodes": args.nodes}
    g = load_graph(graph["graph"], seed=0, nodes=args.nodes, scale=args.scale, features=args.features)
    wall["generate"] = time.perf_counter() - t
    what = f"R-MAT scale {args.scale}" if args.graph == "rmat" else "SBM (8 planted communities)"
    print(f"{what}: {g.num_nodes:,} nodes, {g.num_edges:,} edges, generated in {wall['generate']:.1f} s",
          flush=True)
    results = {}
    if "full" in only:
        t = time.perf_counter()
        fg = results["full_graph"] = full_graph(g, args.features, args.hidden, args.rounds)
        wall["full"] = time.perf_counter() - t
        print(f"full-graph GraphSAGE, {args.features} features, hidden {args.hidden}, one process, median of "
              f"{args.rounds} epochs (forward, backward, Adam) after a warm-up: podscale (CSR sparse product) "
              f"{1e3 * fg['podscale_s']:.1f} ms, PyG SAGEConv on edge_index {1e3 * fg['pyg_s']:.1f} ms per epoch, "
              f"ratio {fg['ratio']:.2f} (podscale / PyG); largest logit difference {fg['max_logit_diff']:.1e}",
              flush=True)
    if "minibatch" in only:
        t = time.perf_counter()
        mb = results["minibatch"] = minibatch_vs_pyg(g, args.features, args.hidden, args.batch // 2, args.batches)
        wall["minibatch"] = time.perf_counter() - t
        if "skipped" in mb:
            print(f"mini-batch GraphSAGE vs PyG NeighborLoader: skipped: {mb['skipped']}", flush=True)
        else:
            print(f"mini-batch GraphSAGE (fan-outs 15, 10, {mb['seeds_per_batch']} seeds a batch, the same seeds "
                  f"and weights both sides), one process, median of {mb['batches']} batches (sample, gather "
                  f"features, forward, backward, Adam): podscale (vectorised CSR sampling into CSR blocks) "
                  f"{1e3 * mb['podscale_s']:.1f} ms, PyG (NeighborLoader, SAGEConv) {1e3 * mb['pyg_s']:.1f} ms per "
                  f"batch, ratio {mb['ratio']:.2f} (podscale / PyG); of which sampling and gathering "
                  f"{1e3 * mb['podscale_sample_s']:.1f} vs {1e3 * mb['pyg_sample_s']:.1f} ms (ratio "
                  f"{mb['sample_ratio']:.2f}); sampled edges per batch {mb['podscale_edges_per_batch']:,.0f} vs "
                  f"{mb['pyg_edges_per_batch']:,.0f}, per second {mb['podscale_sampled_edges_per_s']:,.0f} vs "
                  f"{mb['pyg_sampled_edges_per_s']:,.0f}", flush=True)
    rows = results["partitions"] = []
    for parts in (int(p) for p in args.parts.split(",")) if "partitions" in only else ():
        t = time.perf_counter()
        rs = partitions(g, graph, args.features, args.epochs, args.batch, parts, args.max_steps,
                        args.partition_dir)
        wall[f"partitions-{parts}"] = time.perf_counter() - t
        rows += rs
        for r in rs:
            print(f"{r['method']:6s} {parts} partitions: edge cut {r['edge_cut']:.1%}, halo {r['halo_share']:.1%}, "
                  f"balance {r['balance']}, {r['steps']} of {r['steps_per_epoch']} steps/epoch run, epoch "
                  f"{r['epoch_s']:.2f} s, remote {r['remote_mb_per_epoch']:.1f} MiB/epoch, "
                  f"{r['sampled_edges_per_s']:,.0f} sampled edges/s, features per rank "
                  f"{', '.join(f'{x:.2f}' for x in r['feature_share_per_rank'])} of the graph's, RSS {r['rss_mb']} MiB; "
                  + (f"partitioned in {r['partition_s']:.1f} s, written in {r['write_s']:.1f} s"
                     if r["partition_s"] or r["write_s"] else "partitions read back from --partition-dir")
                  + f", training run "
                  f"{r['launch_s']:.1f} s (setup per rank {r['setup_s']} s)", flush=True)
        m, rnd = rs
        print(f"METIS / random at {parts} partitions: epoch time {m['epoch_s'] / rnd['epoch_s']:.2f}, remote bytes "
              f"{m['remote_mb_per_epoch'] / max(rnd['remote_mb_per_epoch'], 1e-9):.2f}, sampled edges/s "
              f"{m['sampled_edges_per_s'] / rnd['sampled_edges_per_s']:.2f}", flush=True)
    results["wall_s"] = wall
    print("wall time by part: " + ", ".join(f"{k} {v:.0f} s" for k, v in wall.items())
          + f"; peak RSS of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB",
          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
