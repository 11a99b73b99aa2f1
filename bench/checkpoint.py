"""Saving a tensor/pipeline-parallel checkpoint: time, memory and bytes per rank, two podscale trees side by side.

    python bench/checkpoint.py --compare /path/to/other/podscale/tree     # this tree vs another, 3 rounds
    python bench/checkpoint.py --layouts tp2pp2 --rounds 1                # this tree alone

Each run starts 4 ranks on a GPT of 47.9M parameters (8 layers, hidden 704, vocab 256, block 64), takes
one training step (so Adam has state), then saves a checkpoint 3 times (model + optimizer, the same call
``podscale train`` makes).  Per save and rank: wall time of building the state dicts plus
``checkpoint.save`` (the slowest rank's, after a barrier), the growth of the process's peak RSS over its RSS
before the save (Linux ``/proc/self/clear_refs`` resets the high-water mark, so the peak is the save's
own; the first save of a process is reported apart, as later saves reuse pages the allocator kept), and
the bytes podscale's collectives moved.  Afterwards the size of each rank's DCP file.  The two
trees run alternately (round-robin) so machine load hits both alike; medians over rounds and saves.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

LAYOUTS = {"tp2pp2": {"tp": 2, "pp": 2}, "tp2dp2z1": {"tp": 2, "zero": 1}}
MODEL = {"n_layer": 8, "n_head": 8, "n_embd": 704, "block_size": 64, "vocab_size": 256}


def _cfg(layout: str) -> dict:
    p = dict(LAYOUTS[layout])
    zero = p.pop("zero", 0)
    d = {"run": {"steps": 1, "seed": 1}, "model": MODEL, "parallel": {"nproc": 4, **p},
         "train": {"global_batch": 8, "micro_batch": 2, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 0}}
    if zero:
        d["zero"] = {"stage": zero}
    return d


def _kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024


def worker(layout: str, root: str, saves: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from podscale.config import parse_config
    from podscale.models.gpt import GPT
    from podscale.parallel.compose import build_engine
    from podscale.runtime.mesh import Mesh
    from podscale.runtime.process import init_process
    from podscale.train import checkpoint
    from podscale.tasks.gpt import gpt_config

    info = init_process()
    torch.set_num_threads(1)
    cfg = parse_config(_cfg(layout))
    mesh = Mesh.build(info.device, **cfg.mesh_sizes())
    torch.manual_seed(1)
    with torch.device("meta"):
        model = GPT(gpt_config(cfg))
    engine = build_engine(model, mesh, cfg)
    g = torch.Generator().manual_seed(0)
    micro = [(torch.randint(0, 256, (2, 64), generator=g), torch.randint(0, 256, (2, 64), generator=g))
             for _ in range(cfg.grad_accum)]
    engine.step(micro)
    out = []
    for k in range(saves):
        dist.barrier()
        mesh.stats.reset()
        rss = _kb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        t0 = time.perf_counter()
        checkpoint.save(root, k + 1, {"model": engine.model_state(), "optim": engine.optim_state()},
                        {"step": k + 1}, {"torch_rng": torch.get_rng_state()}, info.rank, keep=1)
        dt = torch.tensor(time.perf_counter() - t0)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        out.append({"seconds": float(dt), "peak_growth": _kb("VmHWM") - rss,
                    "comm_bytes": mesh.stats.totals()["bytes"]})
    last = os.path.join(root, f"step_{saves:08d}")
    files = {f: os.path.getsize(os.path.join(last, f)) for f in os.listdir(last) if f.endswith(".distcp")}
    n_params = sum(p.numel() for _, p in engine.strategy.named_parameters())
    return [{"saves": out, "files": files, "local_params": n_params}]


def run_one(layout: str, saves: int) -> dict:
    """This tree, one layout: 4 ranks; per-save medians over ranks and saves."""
    from podscale.runtime.launcher import launch
    with tempfile.TemporaryDirectory() as root:
        res = launch(worker, (layout, root, saves), nproc=4)
    ranks = sorted(res)
    return {"seconds": [s["seconds"] for s in res[0][0]["saves"]],
            "peak_growth_mb": [max(res[r][0]["saves"][k]["peak_growth"] for r in ranks) / 2**20
                               for k in range(saves)],
            "comm_mb": [res[0][0]["saves"][k]["comm_bytes"] / 2**20 for k in range(saves)],
            "file_mb": {f: round(b / 2**20, 1) for f, b in sorted(res[0][0]["files"].items())},
            "local_params_m": [round(res[r][0]["local_params"] / 1e6, 1) for r in ranks]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", help="another podscale source tree (e.g. before a change)")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.saves)))
        return
    here = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    trees = {"this": here} | ({"other": os.path.abspath(args.compare)} if args.compare else {})
    runs: dict = {}
    for _ in range(args.rounds):
        for layout in args.layouts:
            for name, tree in trees.items():
                env = dict(os.environ, PYTHONPATH=tree)
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", layout,
                                      "--saves", str(args.saves)], env=env, capture_output=True, text=True,
                                     cwd=tree)
                if out.returncode:
                    sys.exit(out.stderr[-3000:])
                runs.setdefault((layout, name), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    for layout in args.layouts:
        for name in trees:
            rs = runs[(layout, name)]
            sec = statistics.median(x for r in rs for x in r["seconds"])
            # the first save of a process is the honest peak: later ones reuse pages the allocator kept
            first = statistics.median(r["peak_growth_mb"][0] for r in rs)
            mem = statistics.median(x for r in rs for x in r["peak_growth_mb"])
            comm = statistics.median(x for r in rs for x in r["comm_mb"])
            print(f"{layout:9s} {name:5s}  save {sec:6.2f} s   peak RSS growth (max rank) first save "
                  f"{first:7.1f} MB, all saves {mem:7.1f} MB   collectives {comm:7.1f} MB/rank   "
                  f"files MB {rs[-1]['file_mb']}   params/rank (M) {rs[-1]['local_params_m']}")


if __name__ == "__main__":
    main()
