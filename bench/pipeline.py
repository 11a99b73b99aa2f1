"""podscale's pipeline schedules against torch.distributed.pipelining, same model, same data, one run.

    python bench/pipeline.py                      # 4 ranks, 1F1B and interleaved 1F1B (2 virtual stages)

Each rank builds the same GPT from the same seed and splits it into the same stages (8 blocks: 4 stages of
2 for 1F1B, 8 chunks of 1 for interleaved).  podscale trains with its Engine (schedule executor, tied
embedding sync, global-norm clipping, AdamW); the peer with ``torch.distributed.pipelining``'s
``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` over ``PipelineStage``s of the same chunks, plus
``torch.optim.AdamW`` (no clipping, no tied-embedding sync: slightly less work).  Runs alternate
step by step (podscale, torch, torch, podscale, ...) so drift on a shared machine hits both; the ratio of
median step times and the median of the per-pair ratios are printed (> 1: podscale is faster), with the
median CPU time per step (slowest rank).  ``--recv-ahead 1,4`` runs podscale's executor with each
receive look-ahead in the same alternation.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MODEL = {"n_layer": 8, "n_head": 4, "n_embd": 128, "block_size": 128, "vocab_size": 256}


class TorchStage(nn.Module):
    """A podscale GPT chunk as torch.distributed.pipelining wants a stage: one tensor in, one out."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x):
        return self.chunk(x)[0]


def _config(schedule: str, v: int, micro: int, m: int, steps: int) -> dict:
    return {"run": {"steps": steps, "seed": 1}, "model": MODEL,
            "parallel": {"nproc": 4, "pp": 4, "schedule": schedule, "virtual_stages": v},
            "train": {"global_batch": micro * m, "micro_batch": micro, "lr": 1e-3, "min_lr": 1e-4,
                      "warmup_steps": 0, "grad_clip": 1.0}}


def worker(micro: int, m: int, steps: int, rounds: int, schedules: tuple[str, ...],
           recv_ahead: tuple[int, ...] = (4,)) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    from podscale.config import parse_config
    from podscale.models.gpt import GPT
    from podscale.parallel.compose import build_engine
    from podscale.parallel.pipeline.partition import split_chunk, stage_layers
    from podscale.runtime.mesh import Mesh
    from podscale.runtime.process import init_process
    from podscale.tasks.gpt import gpt_config

    info = init_process()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    T, V = MODEL["block_size"], MODEL["vocab_size"]
    batches = [[(torch.randint(0, V, (micro, T), generator=g), torch.randint(0, V, (micro, T), generator=g))
                for _ in range(m)] for _ in range(steps)]
    results = {}
    for schedule, v in (("1f1b", 1), ("interleaved", 2)):
        if schedule not in schedules:
            continue
        cfg = parse_config(_config(schedule, v, micro, m, steps))
        mesh = Mesh.build(info.device, **cfg.mesh_sizes())
        torch.manual_seed(1)
        engine = build_engine(GPT(gpt_config(cfg)), mesh, cfg)

        # the peer: the same chunks of a model built from the same seed
        torch.manual_seed(1)
        full = GPT(gpt_config(cfg))
        groups = stage_layers(full, 4 * v)
        r, n = mesh.local_rank("pp"), 4 * v
        stages, params = [], []
        for c in range(v):
            k = c * 4 + r
            mod = TorchStage(split_chunk(full, groups[k], first=k == 0, last=k == n - 1))
            params += list(mod.parameters())
            example = torch.zeros(micro, T, dtype=torch.long) if k == 0 else torch.zeros(micro, T, MODEL["n_embd"])
            stages.append(PipelineStage(mod, k, n, info.device, input_args=(example,), group=mesh.group("pp")))

        def loss_fn(logits, y):
            return F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1))

        sched = Schedule1F1B(stages[0], m, loss_fn=loss_fn) if v == 1 else \
            ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)

        def run_torch(mbs):
            x = torch.cat([a for a, _ in mbs]) if r == 0 else None
            y = torch.cat([b for _, b in mbs]) if r == 3 else None
            if r == 0:
                sched.step(x)
            elif r == 3:
                sched.step(target=y)
            else:
                sched.step()
            opt.step()
            opt.zero_grad()

        # podscale once per receive look-ahead asked for, torch once, back to back in each step (order
        # reversed every other step), so load from other jobs hits all alike
        names = ["torch"] + [f"podscale ahead={k}" for k in recv_ahead]
        times = {n: [] for n in names}
        cpu = {n: [] for n in names}
        for rnd in range(rounds):
            for i, mbs in enumerate(batches):
                for name in names if (rnd + i) % 2 == 0 else names[::-1]:
                    if name != "torch":
                        engine.strategy.recv_ahead = int(name.split("=")[1])
                    torch.distributed.barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    engine.step(mbs) if name != "torch" else run_torch(mbs)
                    dt = torch.tensor([time.perf_counter() - t0, time.process_time() - c0])
                    torch.distributed.all_reduce(dt, op=torch.distributed.ReduceOp.MAX)
                    if rnd > 0 or i > 0:  # the very first steps set up connections
                        times[name].append(float(dt[0]))
                        cpu[name].append(float(dt[1]))
        tokens = micro * m * T
        results[schedule] = {
            name: {"tok_s": tokens / statistics.median(times[name]), "cpu_s": statistics.median(cpu[name]),
                   "ratio": statistics.median(times["torch"]) / statistics.median(times[name]),
                   "pair_ratio": statistics.median(b / a for a, b in zip(times[name], times["torch"])),
                   "steps": len(times[name])} for name in names}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--m", type=int, default=8, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=4, help="steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of steps, podscale and torch alternating")
    ap.add_argument("--schedules", default="1f1b,interleaved", help="comma-separated: 1f1b, interleaved")
    ap.add_argument("--recv-ahead", default="4", help="comma-separated receive look-aheads of podscale's "
                    "executor to compare (1 = before 2026-11-30)")
    a = ap.parse_args()
    from podscale.runtime.launcher import launch

    ahead = tuple(int(k) for k in a.recv_ahead.split(","))
    res = launch(worker, (a.micro, a.m, a.steps, a.rounds, tuple(a.schedules.split(",")), ahead), nproc=4)[0]
    print(f"GPT {MODEL}, 4 pipeline ranks (gloo, CPU), {a.m} micro-batches of {a.micro} x {MODEL['block_size']}")
    for schedule, runs in res.items():
        for name, r in runs.items():
            print(f"{schedule:12s} {name:20s} {r['tok_s']:8.0f} tok/s  cpu {r['cpu_s']:.3f} s/step  vs torch: "
                  f"ratio of medians {r['ratio']:.2f}, median of {r['steps']} step pairs {r['pair_ratio']:.2f}")


if __name__ == "__main__":
    main()
