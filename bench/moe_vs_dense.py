"""A GPT-MoE against a dense GPT with the same active FLOPs per token, trained for the same steps on the
same data: the validation losses of both (GShard, Lepikhin et al. 2020, and Switch, Fedus et al. 2021,
section 3: at equal compute per token, the sparse model reaches a lower loss).

The dense GPT has an MLP of hidden size ``4 h`` in every block; the GPT-MoE replaces every
``moe_every``-th MLP by ``--experts`` experts of hidden size ``4 h / top_k`` with top-k routing, so a token
passes through the same number of expert-MLP weights (plus the router's ``h x E``) and the FLOPs per token
match up to the router.  Both run through podscale's trunk (task, engine, AdamW, cosine schedule) in one
process, on the byte-level corpus (``--data``: a text file; default the Python standard library's source,
the embedded corpus), with the same seed, batch and learning rate.  Prints both models' parameter counts,
FLOPs per token (the tasks' own formula), final training and validation losses and the difference.

    python bench/moe_vs_dense.py [--steps 300] [--experts 8] [--top-k 2] [--n-layer 4] [--n-embd 128]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import podscale
from podscale.config import parse_config
from podscale.runtime.mesh import Mesh
from podscale.tasks import task_for


def train(model_section: dict, args) -> dict:
    cfg = parse_config({
        "run": {"name": "moe-vs-dense", "steps": args.steps, "seed": args.seed, "eval_batches": args.eval_batches},
        "model": model_section,
        "data": {"path": args.data} if args.data else {},
        "parallel": {"nproc": 1},
        "train": {"global_batch": args.batch, "micro_batch": args.batch, "lr": args.lr, "min_lr": args.lr / 10,
                  "warmup_steps": max(1, args.steps // 20)},
    })
    mesh = Mesh.build()
    task = task_for(cfg)
    torch.manual_seed(cfg.run.seed)
    model = task.build_model_on(mesh)
    engine = podscale.parallelize(model, mesh, cfg, task)
    loader, val = task.train_data(0, 1), task.eval_data(0, 1)
    t0 = time.perf_counter()
    losses = []
    with engine:
        for _ in range(args.steps):
            losses.append(engine.step(loader.next_step()).loss)
            task.step_metrics(engine.model, mesh)
        seconds = time.perf_counter() - t0
        val_loss = task.evaluate(engine, val)["loss"]
    tail = losses[-max(1, args.steps // 10):]
    return {"kind": model_section["kind"], "params": sum(p.numel() for p in engine.model.parameters()),
            "flops_per_token": task.flops_per_sample() / task.units_per_sample(),
            "train_loss": sum(tail) / len(tail), "val_loss": val_loss, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-every", type=int, default=2)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--data", default=None, help="a text file (default: the Python standard library's source)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    gpt = {"n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd, "block_size": args.block_size}
    if (4 * args.n_embd) % args.top_k:
        raise SystemExit(f"--top-k {args.top_k} must divide 4 * n_embd = {4 * args.n_embd}")
    moe = dict(gpt, kind="gpt-moe", experts=args.experts, top_k=args.top_k, moe_every=args.moe_every,
               expert_hidden=4 * args.n_embd // args.top_k, random_routing=args.top_k == 2)
    dense = train(dict(gpt, kind="gpt"), args)
    sparse = train(moe, args)
    for r in (dense, sparse):
        print(f"{r['kind']:8s} params {r['params'] / 1e6:6.2f}M  FLOPs/token {r['flops_per_token'] / 1e6:7.2f}M  "
              f"train loss {r['train_loss']:.4f}  val loss {r['val_loss']:.4f}  ({r['seconds']:.0f} s)")
    print(f"GPT-MoE ({args.experts} experts, top-{args.top_k}, every {args.moe_every} blocks) vs dense at "
          f"{sparse['flops_per_token'] / dense['flops_per_token']:.3f}x the FLOPs per token, {args.steps} steps: "
          f"validation loss {sparse['val_loss']:.4f} vs {dense['val_loss']:.4f} "
          f"(difference {sparse['val_loss'] - dense['val_loss']:+.4f})")
    print(json.dumps({"dense": dense, "moe": sparse, "args": vars(args)}))


if __name__ == "__main__":
    main()
