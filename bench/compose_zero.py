"""ZeRO stages on the dp axis of a pipeline, side by side in one run: (pp, dp) = (2, 2) on 4 ranks.

    python bench/compose_zero.py                 # GPT 8 x 128, 1F1B, 4 micro-batches of 2 x 128 tokens
    python bench/compose_zero.py --only ZeRO-1   # one layout (e.g. to run against an older checkout)

For ZeRO-1, ZeRO-2, ZeRO-3 (blocks freed after each forward and backward) and ZeRO-3 with
``reshard_after_forward = false`` (blocks gathered once per step): the median step time (slowest rank), and
per step the dp reduce-scatters and all-gathers (calls, MB) with the reduce-scatter time that was exposed
(waited for) against the time it was in flight.  Layouts alternate round by round so drift on a shared
machine hits all of them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MODEL = {"n_layer": 8, "n_head": 4, "n_embd": 128, "block_size": 128, "vocab_size": 256}
LAYOUTS = {"ZeRO-1": {"stage": 1}, "ZeRO-2": {"stage": 2}, "ZeRO-3": {"stage": 3},
           "ZeRO-3 keep gathered": {"stage": 3, "reshard_after_forward": False}}


def _config(zero: dict, micro: int, m: int) -> dict:
    return {"run": {"steps": 1000, "seed": 1}, "model": MODEL,
            "parallel": {"nproc": 4, "pp": 2, "dp": 2, "schedule": "1f1b"},
            "train": {"global_batch": 2 * micro * m, "micro_batch": micro, "lr": 1e-3, "min_lr": 1e-4,
                      "warmup_steps": 0, "grad_clip": 1.0},
            "zero": {"reduce_bucket_mb": 1.0, "param_persistence_threshold": 10_000, **zero}}


def worker(micro: int, m: int, steps: int, rounds: int, only: list[str] | None = None) -> dict:
    from podscale.config import parse_config
    from podscale.models.gpt import GPT
    from podscale.parallel.compose import build_engine
    from podscale.runtime.mesh import Mesh
    from podscale.runtime.process import init_process
    from podscale.tasks.gpt import gpt_config

    info = init_process()
    torch.set_num_threads(1)
    mesh = None
    engines = {}
    g = torch.Generator().manual_seed(info.rank)
    layouts = {n: z for n, z in LAYOUTS.items() if not only or n in only}
    for name, zero in layouts.items():
        cfg = parse_config(_config(zero, micro, m))
        cfg.check_layout(info.world_size)
        mesh = mesh or Mesh.build(info.device, **cfg.mesh_sizes())
        torch.manual_seed(1)
        engines[name] = build_engine(GPT(gpt_config(cfg)), mesh, cfg)
    batch = [(torch.randint(0, 256, (micro, 128), generator=g), torch.randint(0, 256, (micro, 128), generator=g))
             for _ in range(m)]
    times = {n: [] for n in layouts}
    comm = {n: {} for n in layouts}
    for r in range(rounds + 1):  # round 0 warms up
        for name, engine in engines.items():
            mesh.stats.reset()
            for _ in range(steps):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                engine.step(batch)
                t = torch.tensor([time.perf_counter() - t0])
                torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
                if r:
                    times[name].append(float(t))
            if r:
                for k, v in mesh.stats.snapshot().items():
                    acc = comm[name].setdefault(k, {"calls": 0, "bytes": 0, "busy_s": 0.0, "exposed_s": 0.0})
                    for f in acc:
                        acc[f] += v[f]
    n = rounds * steps
    out = {}
    for name in layouts:
        c = comm[name]
        rs, ag = c.get("dp/reduce_scatter", {}), c.get("dp/all_gather", {})
        out[name] = {"median_ms": 1e3 * statistics.median(times[name]),
                     "rs_calls": rs.get("calls", 0) / n, "rs_mb": rs.get("bytes", 0) / n / 2**20,
                     "rs_busy_ms": 1e3 * rs.get("busy_s", 0) / n, "rs_exposed_ms": 1e3 * rs.get("exposed_s", 0) / n,
                     "ag_calls": ag.get("calls", 0) / n, "ag_mb": ag.get("bytes", 0) / n / 2**20}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--m", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=4, help="steps per layout and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", nargs="*", choices=list(LAYOUTS), help="layouts to run (default: all)")
    args = ap.parse_args()
    from podscale.runtime.launcher import launch
    results = launch(worker, (args.micro, args.m, args.steps, args.rounds, args.only), nproc=4)
    print(f"(pp, dp) = (2, 2), 1F1B, m = {args.m} micro-batches of {args.micro} x 128 tokens; per step, rank 0")
    print(f"{'layout':22s} {'median ms':>10s} {'RS calls':>9s} {'RS MB':>7s} {'RS busy ms':>11s} "
          f"{'RS exposed ms':>14s} {'AG calls':>9s} {'AG MB':>7s}")
    base = next(iter(results[0].values()))["median_ms"]
    for name, r in results[0].items():
        print(f"{name:22s} {r['median_ms']:10.1f} {r['rs_calls']:9.1f} {r['rs_mb']:7.2f} {r['rs_busy_ms']:11.1f} "
              f"{r['rs_exposed_ms']:14.1f} {r['ag_calls']:9.1f} {r['ag_mb']:7.2f}   x{r['median_ms'] / base:.2f}")


if __name__ == "__main__":
    main()
