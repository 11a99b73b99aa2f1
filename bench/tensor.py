"""Tensor-parallel speed-up (tp=2 vs one process) and communication share, for several hidden sizes.

    python bench/tensor.py                        # hidden 128, 256, 512, 1024; 2 ranks
    python bench/tensor.py --hidden 256 512 --sp  # with sequence parallelism

Rank 0 first trains the plain model alone (one thread, like each tp rank), then both ranks train it with
tp=2 (Megatron column/row-parallel layers, vocab-parallel cross-entropy).  Speed-up = step time alone /
step time at tp=2 (ideal 2); communication share = time blocked in tp collectives / step time (the
metrics' ``comm`` per axis); CPU-time speed-up = the same ratio in CPU seconds of one rank, which is
what a machine with a free core per rank would see when other jobs share this one.  Medians over the
timed steps.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _cfg(hidden: int, tp: int, sp: bool, steps: int) -> dict:
    return {"run": {"steps": steps, "seed": 1},
            "model": {"n_layer": 4, "n_head": 8, "n_embd": hidden, "block_size": 128, "vocab_size": 256},
            "parallel": {"nproc": tp, "tp": tp, "sequence_parallel": sp and tp > 1},
            "train": {"global_batch": 8, "micro_batch": 8, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 0}}


def worker(hiddens: list[int], steps: int, sp: bool) -> list[dict]:
    from podscale.config import parse_config
    from podscale.models.gpt import GPT
    from podscale.parallel.compose import build_engine
    from podscale.runtime.mesh import Mesh
    from podscale.runtime.process import init_process
    from podscale.tasks.gpt import gpt_config

    info = init_process()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    out = []
    for h in hiddens:
        batch = [(torch.randint(0, 256, (8, 128), generator=g), torch.randint(0, 256, (8, 128), generator=g))]
        row = {"hidden": h}
        alone = []
        if info.rank == 0:
            cfg = parse_config(_cfg(h, 1, sp, steps))
            mesh1 = Mesh(sizes={"pp": 1, "dp": 1, "ep": 1, "tp": 1}, device=info.device)
            torch.manual_seed(1)
            engine = build_engine(GPT(gpt_config(cfg)), mesh1, cfg)
            for i in range(steps + 1):
                t0, c0 = time.perf_counter(), time.process_time()
                engine.step(batch)
                if i:
                    alone.append((time.perf_counter() - t0, time.process_time() - c0))
        torch.distributed.barrier()
        cfg = parse_config(_cfg(h, 2, sp, steps))
        mesh = Mesh.build(info.device, **cfg.mesh_sizes())
        torch.manual_seed(1)
        engine = build_engine(GPT(gpt_config(cfg)), mesh, cfg)
        times, cpu, shares = [], [], []
        for i in range(steps + 1):
            torch.distributed.barrier()
            mesh.stats.reset()
            t0, c0 = time.perf_counter(), time.process_time()
            engine.step(batch)
            dt = time.perf_counter() - t0
            if i:
                times.append(dt)
                cpu.append(time.process_time() - c0)
                shares.append(mesh.stats.per_axis().get("tp", {}).get("exposed_s", 0.0) / dt)
                tp_bytes = mesh.stats.per_axis().get("tp", {}).get("bytes", 0)
        if info.rank == 0:
            row.update(alone_s=statistics.median(a for a, _ in alone), tp2_s=statistics.median(times),
                       comm_share=statistics.median(shares), tp_mib=tp_bytes / 2**20)
            row["speedup"] = row["alone_s"] / row["tp2_s"]
            # CPU time of one rank (its compute and communication threads): the speed-up a machine with a
            # free core per rank would see, whatever else shares this one
            row["cpu_speedup"] = statistics.median(c for _, c in alone) / statistics.median(cpu)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sp", action="store_true", help="sequence parallelism on")
    a = ap.parse_args()
    from podscale.runtime.launcher import launch

    rows = launch(worker, (a.hidden, a.steps, a.sp), nproc=2)[0]
    print(f"GPT 4 layers, 8 heads, 8 x 128 tokens per step, tp=2{' + sequence parallel' if a.sp else ''} "
          "(gloo, CPU, 1 thread per rank)")
    print(f"{'hidden':>7} {'alone s':>9} {'tp=2 s':>8} {'speed-up':>9} {'CPU-time speed-up':>18} "
          f"{'comm share':>11} {'tp MiB/step':>12}")
    for r in rows:
        print(f"{r['hidden']:7d} {r['alone_s']:9.3f} {r['tp2_s']:8.3f} {r['speedup']:9.2f} {r['cpu_speedup']:18.2f} "
              f"{r['comm_share']:11.1%} {r['tp_mib']:12.1f}")


if __name__ == "__main__":
    main()
