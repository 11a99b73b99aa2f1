"""Sparse upcycling against continuing the dense model (Komatsuzaki et al. 2023, "Sparse Upcycling: Training
Mixture-of-Experts from Dense Checkpoints", section 4: from the same dense checkpoint, the upcycled MoE reaches
a lower loss than the dense model trained on for the same extra steps).

A dense GPT is trained for ``--dense-steps`` steps; from its final checkpoint (``train.init_from``) two runs
go on for ``--more-steps`` steps each, with a fresh optimizer and learning-rate schedule and the same batches:
the dense GPT itself, and a GPT-MoE of the same trunk upcycled from it (every ``--moe-every``-th block's MLP
copied into ``--experts`` experts of the MLP's width, the routers new, top-``--top-k``, capacity factor
``--capacity-factor``).  ``--scratch`` adds the same GPT-MoE trained from scratch for ``--dense-steps`` +
``--more-steps`` steps (the paper's other baseline: the same total steps without the dense start).  Every run
goes through ``podscale train`` in one process on the byte-level corpus (``--data``; default the Python
standard library's source, the embedded corpus), in a fresh folder under ``--out`` (default: a new temporary
folder).  Prints each run's validation loss (``--eval-batches`` held-out batches, after its last step), its
FLOPs per token and median step time; top-2 of full-width experts costs about twice the dense MLP's FLOPs per
token, so the comparison is at equal steps and tokens, not equal compute (as in the paper's figures by
step).

    python bench/upcycle.py                              # the full setting
    python bench/upcycle.py --dense-steps 20 --more-steps 10 --n-embd 64 --block-size 64   # a smoke run
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from podscale.cli import main as podscale


def _toml(name: str, out: Path, steps: int, model: str, args, init_from: Path | None) -> str:
    return f"""
[run]
name = "{name}"
out_dir = "{out}"
steps = {steps}
seed = {args.seed}
log_every = 50
eval_every = {steps}
eval_batches = {args.eval_batches}
sample_tokens = 0
[model]
n_layer = {args.n_layer}
n_head = {args.n_head}
n_embd = {args.n_embd}
block_size = {args.block_size}
{model}
[data]
{f'path = "{args.data}"' if args.data else ''}
[parallel]
nproc = 1
[train]
global_batch = {args.batch}
micro_batch = {args.batch}
lr = {args.lr}
min_lr = {args.lr / 10}
warmup_steps = {max(1, steps // 20)}
{f'init_from = "{init_from}"' if init_from is not None else ''}
"""


def _run(name: str, out: Path, steps: int, model: str, args, init_from: Path | None = None) -> dict:
    cfg = out / f"{name}.toml"
    cfg.write_text(_toml(name, out, steps, model, args, init_from))
    if podscale(["train", str(cfg)]) != 0:
        raise SystemExit(f"the {name} run failed")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return {"val_loss": rows[-1]["val_loss"], "steps": steps,
            "flops_per_token": rows[-1]["tflops_per_rank"] * 1e12 / rows[-1]["tokens_per_s"],
            "step_ms": 1e3 * statistics.median(r["step_time_s"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dense-steps", type=int, default=600)
    ap.add_argument("--more-steps", type=int, default=400)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--moe-every", type=int, default=2)
    ap.add_argument("--scratch", action="store_true", help="also the GPT-MoE from scratch for all the steps")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-batches", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--data", default=None, help="a text file (default: the Python standard library's source)")
    ap.add_argument("--out", default=None, help="a new folder for the runs (default: a fresh temporary one)")
    args = ap.parse_args()
    if args.out is not None and Path(args.out).exists():
        raise SystemExit(f"--out {args.out} exists: give a new folder (the bench writes its runs there)")
    out = Path(args.out or tempfile.mkdtemp(prefix="podscale-upcycle-"))
    out.mkdir(parents=True, exist_ok=True)
    moe = (f'kind = "gpt-moe"\nexperts = {args.experts}\ntop_k = {args.top_k}\nmoe_every = {args.moe_every}\n'
           f"capacity_factor = {args.capacity_factor}\nrandom_routing = {str(args.top_k == 2).lower()}")
    dense = _run("dense", out, args.dense_steps, 'kind = "gpt"', args)
    runs = {"dense, continued": _run("dense-continued", out, args.more_steps, 'kind = "gpt"', args, out / "dense"),
            "MoE, upcycled": _run("upcycled", out, args.more_steps, moe, args, out / "dense")}
    if args.scratch:
        runs["MoE, from scratch"] = _run("scratch", out, args.dense_steps + args.more_steps, moe, args)
    print(f"dense GPT after {args.dense_steps} steps: validation loss {dense['val_loss']:.4f}")
    for name, r in runs.items():
        print(f"{name:18s} {r['steps']:5d} steps  validation loss {r['val_loss']:.4f}  FLOPs/token "
              f"{r['flops_per_token'] / 1e6:6.2f}M  step {r['step_ms']:6.1f} ms (median)")
    up, cont = runs["MoE, upcycled"], runs["dense, continued"]
    print(f"upcycled ({args.experts} experts, top-{args.top_k}, every {args.moe_every} blocks) vs dense continued, "
          f"{args.more_steps} more steps from the same checkpoint: validation loss {up['val_loss']:.4f} vs "
          f"{cont['val_loss']:.4f} (difference {up['val_loss'] - cont['val_loss']:+.4f}) at "
          f"{up['flops_per_token'] / cont['flops_per_token']:.2f}x the FLOPs per token; runs in {out}")
    print(json.dumps({"dense": dense, "runs": runs, "args": vars(args)}))


if __name__ == "__main__":
    main()
