"""``train.compile = true`` against the eager model: the same GPT, data and layout, both in one run.

    python bench/compile.py                                   # 1 process, 4 x 256 GPT, inductor
    python bench/compile.py --nproc 2 --zero 3                # any layout: --tp 2 --sp, --pp 2, --zero 1-3
    python bench/compile.py --backend aot_eager               # tracing without code generation
    python bench/compile.py --moe-experts 8 --nproc 2 --ep 2  # a GPT-MoE (top-2 every other block), experts over ep

Each rank builds two engines with ``podscale.parallel.compose.build_engine`` from the same seed -- one eager,
one with ``train.compile = true`` -- and feeds both the same batches.  The compiled engine's first steps
(Dynamo tracing, AOTAutograd, inductor's C++ code generation and compilation; ``--warmup`` steps in all) are
timed separately and reported as compile time; then the two engines take turns step by step (eager,
compiled, compiled, eager, ...) so that drift on a shared machine hits both, and the median step times
(slowest rank), their ratio and the median of the per-pair ratios are printed (> 1: compiled is faster).
The losses of both are printed too: they agree to rounding (tests/test_compile.py checks that).

A GPT-MoE's MoE layers run eagerly between the compiled pieces of their blocks (the attention half, and the
residual add after the layer); its dense blocks compile whole.

The inductor cache (``TORCHINDUCTOR_CACHE_DIR``) is a fresh folder unless ``--cache-dir`` names one, so the
compile time is a cold compile.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _config(a, compiled: bool) -> dict:
    return {"run": {"steps": a.steps, "seed": 1},
            "model": {"n_layer": a.n_layer, "n_head": a.n_head, "n_embd": a.n_embd, "block_size": a.block,
                      **({"kind": "gpt-moe", "experts": a.moe_experts} if a.moe_experts else {})},
            "parallel": {"nproc": a.nproc, "tp": a.tp, "pp": a.pp, "ep": a.ep, "sequence_parallel": a.sp},
            "zero": {"stage": a.zero},
            "train": {"global_batch": a.batch, "micro_batch": a.micro, "lr": 1e-3, "min_lr": 1e-4,
                      "warmup_steps": 0, "grad_clip": 1.0, "compile": compiled, "compile_backend": a.backend}}


def worker(a) -> dict:
    import torch

    from podscale.config import parse_config
    from podscale.parallel.compose import build_engine
    from podscale.runtime.mesh import Mesh
    from podscale.runtime.process import init_process
    from podscale.tasks import task_for

    info = init_process()
    engines, loaders = [], []
    for compiled in (False, True):
        cfg = parse_config(_config(a, compiled))
        cfg.check_layout(info.world_size)
        mesh = Mesh.build(info.device, **cfg.mesh_sizes())
        task = task_for(cfg)
        torch.manual_seed(cfg.run.seed)
        engines.append(build_engine(task.build_model_on(mesh), mesh, cfg, task))
        loaders.append(task.train_data(mesh.local_rank(*mesh.data_axes), mesh.size(*mesh.data_axes)))
    eager, comp = engines
    losses = {"eager": [], "compiled": []}

    def step(i: int) -> float:
        t0 = time.perf_counter()
        r = engines[i].step(loaders[i].next_step())
        dt = time.perf_counter() - t0
        losses["compiled" if i else "eager"].append(r.loss)
        return dt

    t_eager_warm = sum(step(0) for _ in range(a.warmup))
    t0 = time.perf_counter()
    for _ in range(a.warmup):  # the first step compiles; the next ones check nothing recompiles
        step(1)
    compile_s = time.perf_counter() - t0
    times = {"eager": [], "compiled": []}
    for r in range(a.steps):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for i in order:
            times["compiled" if i else "eager"].append(step(i))
    for e in engines:
        e.close()
    return {"times": times, "compile_s": compile_s, "eager_warmup_s": t_eager_warm, "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    ap.add_argument("--ep", type=int, default=1, help="expert parallelism (with --moe-experts)")
    ap.add_argument("--moe-experts", type=int, default=0, help="a GPT-MoE with this many experts (0: the GPT)")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--micro", type=int, default=4, help="micro-batch per rank")
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each engine")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each (the compile is in these)")
    ap.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager"))
    ap.add_argument("--cache-dir", default=None, help="inductor cache (default: a fresh folder: cold compile)")
    a = ap.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = a.cache_dir or tempfile.mkdtemp(prefix="podscale-inductor-")
    from podscale.runtime.launcher import launch

    res = launch(worker, (a,), nproc=a.nproc)
    # a step is as slow as its slowest rank
    eager = [max(res[r]["times"]["eager"][i] for r in res) for i in range(a.steps)]
    comp = [max(res[r]["times"]["compiled"][i] for r in res) for i in range(a.steps)]
    me, mc = statistics.median(eager), statistics.median(comp)
    pair = statistics.median(e / c for e, c in zip(eager, comp))
    compile_s = max(res[r]["compile_s"] for r in res)
    l0 = res[0]["losses"]
    load = os.getloadavg()
    moe = f"-MoE ({a.moe_experts} experts, top-2 every other block, ep {a.ep})" if a.moe_experts else ""
    print(f"GPT{moe} {a.n_layer} x {a.n_embd}, seq {a.block}, global batch {a.batch}, micro {a.micro}, nproc {a.nproc} "
          f"(tp {a.tp}, pp {a.pp}, sp {a.sp}, ZeRO-{a.zero}), backend {a.backend}, {a.steps} timed steps each; "
          f"load average {load[0]:.1f}")
    print(f"compile (first {a.warmup} compiled steps, cold cache): {compile_s:.1f} s "
          f"(eager's first {a.warmup}: {max(res[r]['eager_warmup_s'] for r in res):.2f} s)")
    print(f"median step: eager {me * 1e3:.1f} ms, compiled {mc * 1e3:.1f} ms")
    print(f"compiled speed-up (eager / compiled step time): {me / mc:.3f}x (median of per-pair ratios {pair:.3f}x)")
    worst = max(abs(x - y) for x, y in zip(l0["eager"], l0["compiled"]))
    print(f"losses eager vs compiled, largest difference over {len(l0['eager'])} steps: {worst:.2e}")


if __name__ == "__main__":
    main()
