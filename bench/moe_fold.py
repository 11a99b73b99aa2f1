"""MoE parallel folding (``parallel.fold_tp_into_ep``) and expert tensor parallelism
(``parallel.expert_tensor_parallel``) against experts replicated over tp: one GPT-MoE, data and layout, the
three in one run.

    python bench/moe_fold.py                        # tp 2 (2 ranks), 8 experts of 4 x 256 in every block
    python bench/moe_fold.py --ep 2 --nproc 4       # tp 2 x ep 2: folded over 4 ranks, split over 2
    python bench/moe_fold.py --sp --zero 1          # any layout of the trainer
    python bench/moe_fold.py --shared-experts 1     # a shared expert beside the routed ones

Each rank builds three engines with ``podscale.parallel.compose.build_engine`` from the same seed, each on a
mesh of its own, and feeds them the same batches: experts replicated over tp (every tp rank holds the ep
rank's E/ep experts and sums their gradients over tp), folded (the experts sharded over ep x tp, the tokens
exchanged over those ranks; Liu et al. 2025, Megatron-core's ``expert_tensor_parallel_size = 1``) and split
(each expert's hidden width split over tp, every tp rank's received rows all-gathered over tp and the partial
outputs reduce-scattered back; Megatron-core's ``expert_tensor_parallel_size = tp``).  After ``--warmup``
untimed steps each, they take turns step by step, the order rotating every round, so that drift on a shared
machine hits all; printed: the median step times (slowest rank), each one's speed-up over replicated and
the median of the per-round ratios (> 1: faster than replicated); the bytes a rank holds of expert
parameters, gradients and Adam moments (fp32), and of the whole model's; the bytes each collective moved per
step on rank 0 (``podscale.runtime.comm``'s counters, by axis and operation); and the largest difference of
each run's losses from the replicated run's, which are the same model's (tests/test_gpt_moe_layouts.py
checks every layout against one process).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


#: the contestants: the parallel keys each sets
LAYOUTS = {"replicated": {}, "folded": {"fold_tp_into_ep": True}, "split": {"expert_tensor_parallel": True}}


def _config(a, layout: dict) -> dict:
    return {"run": {"steps": a.steps, "seed": 1},
            "model": {"kind": "gpt-moe", "n_layer": a.n_layer, "n_head": a.n_head, "n_embd": a.n_embd,
                      "block_size": a.block, "experts": a.experts, "moe_every": a.moe_every, "top_k": a.top_k,
                      "random_routing": False, "shared_experts": a.shared_experts},
            "parallel": {"nproc": a.nproc, "tp": a.tp, "ep": a.ep, "sequence_parallel": a.sp, **layout},
            "zero": {"stage": a.zero},
            "train": {"global_batch": a.batch, "micro_batch": a.micro, "lr": 1e-3, "min_lr": 1e-4,
                      "warmup_steps": 0, "grad_clip": 1.0}}


def worker(a) -> dict:
    import torch

    from podscale.config import parse_config
    from podscale.parallel.compose import build_engine
    from podscale.parallel.moe import expert_parameters
    from podscale.runtime.mesh import Mesh
    from podscale.runtime.process import init_process
    from podscale.tasks import task_for

    info = init_process()
    torch.set_num_threads(1)
    engines, loaders, meshes, held = [], [], [], []
    names = list(LAYOUTS)
    for name in names:
        cfg = parse_config(_config(a, LAYOUTS[name]))
        cfg.check_layout(info.world_size)
        mesh = Mesh.build(info.device, **cfg.mesh_sizes())
        task = task_for(cfg)
        torch.manual_seed(cfg.run.seed)
        model = task.build_model_on(mesh)
        engines.append(build_engine(model, mesh, cfg, task))
        meshes.append(mesh)
        loaders.append(task.train_data(mesh.local_rank(*mesh.data_axes), mesh.size(*mesh.data_axes)))
        # fp32 parameter, gradient and two Adam moments per element (ZeRO shards the last three over dp)
        held.append({"experts": sum(p.numel() for p in expert_parameters(engines[-1].model)),
                     "model": sum(p.numel() for p in engines[-1].model.parameters())})
    losses = {n: [] for n in names}

    def step(i: int) -> float:
        t0 = time.perf_counter()
        r = engines[i].step(loaders[i].next_step())
        dt = time.perf_counter() - t0
        losses[names[i]].append(r.loss)
        return dt

    for _ in range(a.warmup):
        for i in range(len(names)):
            step(i)
    for m in meshes:
        m.stats.reset()
    times = {n: [] for n in names}
    for r in range(a.steps):
        for k in range(len(names)):
            i = (r + k) % len(names)
            times[names[i]].append(step(i))
    comm = [{k: v["bytes"] / a.steps for k, v in m.stats.snapshot().items()} for m in meshes]
    for e in engines:
        e.close()
    return {"times": times, "losses": losses, "held": held, "comm": comm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--sp", action="store_true", help="sequence parallelism")
    ap.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-every", type=int, default=1)
    ap.add_argument("--shared-experts", type=int, default=0,
                    help="model.shared_experts (split over tp too by expert tensor parallelism, whole otherwise)")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--micro", type=int, default=4, help="micro-batch per rank (a multiple of --tp)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each engine")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each")
    a = ap.parse_args()
    from podscale.runtime.launcher import launch

    res = launch(worker, (a,), nproc=a.nproc)
    names = list(LAYOUTS)
    slowest = {n: [max(res[r]["times"][n][i] for r in res) for i in range(a.steps)] for n in names}
    med = {n: statistics.median(t) for n, t in slowest.items()}
    load = os.getloadavg()
    print(f"GPT-MoE {a.n_layer} x {a.n_embd}, {a.experts} experts top-{a.top_k} (+{a.shared_experts} shared) every "
          f"{a.moe_every} block(s), seq "
          f"{a.block}, global batch {a.batch}, micro {a.micro}, nproc {a.nproc} (tp {a.tp}, ep {a.ep}, sp {a.sp}, "
          f"ZeRO-{a.zero}), {a.steps} timed steps each; load average {load[0]:.1f}")
    print("median step: " + ", ".join(f"{n} {med[n] * 1e3:.1f} ms" for n in names))
    for n in names[1:]:
        rounds = statistics.median(x / y for x, y in zip(slowest["replicated"], slowest[n]))
        print(f"{n}: speed-up over replicated {med['replicated'] / med[n]:.3f}x (median of per-round ratios "
              f"{rounds:.3f}x)")
    for i, name in enumerate(names):
        h = res[0]["held"][i]
        mib = 16 / 2**20  # fp32 parameter + gradient + two Adam moments
        print(f"{name}: rank 0 holds {h['experts'] / 1e6:.3f} M expert parameters ({h['experts'] * mib:.1f} MiB "
              f"with gradients and Adam moments) of {h['model'] / 1e6:.3f} M ({h['model'] * mib:.1f} MiB)")
        per_op = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in res[0]["comm"][i].items() if v)
        print(f"{name}: rank 0 per step: {per_op}")
    l0 = res[0]["losses"]
    for n in names[1:]:
        worst = max(abs(x - y) for x, y in zip(l0["replicated"], l0[n]))
        print(f"losses replicated vs {n}, largest difference over {len(l0[n])} steps: {worst:.2e}")


if __name__ == "__main__":
    main()
