"""A GPT-MoE against a dense GPT with the same active FLOPs per token, trained for the same steps on the
same data: the validation losses of both (GShard, Lepikhin et al. 2020, and Switch, Fedus et al. 2021,
section 3: at equal compute per token, the sparse model reaches a lower loss).

The default is Switch's setup scaled down (Fedus et al. 2021, sections 2-3): every other feed-forward
layer (``--moe-every 2``) becomes a Switch layer of ``--experts 8`` experts, each as wide as the dense MLP
(``4 h``), top-1 routing, capacity factor 1.25 in training (2.0 in evaluation), load-balancing loss
coefficient 0.01; a token then passes through exactly one MLP's weights, so the FLOPs per token match the
dense model's up to the router's ``h x E``.  With ``--top-k 2`` the experts are ``4 h / 2`` wide (GShard's
top-2 at equal FLOPs); with ``--shared-experts S`` every MoE layer also has S shared experts that every token
passes through (DeepSeekMoE, Dai et al. 2024), all experts ``4 h / (k + S)`` wide, so a token still passes
through one dense MLP's worth of weights (``--experts 16 --top-k 1 --shared-experts 1`` against ``--experts
16 --top-k 2``: DeepSeekMoE's shared-expert isolation at equal FLOPs).  ``--balancing both`` trains the
GPT-MoE twice, once with the load-balancing loss (``--aux-loss-coef``) and once with DeepSeek-V3's
auxiliary-loss-free selection biases instead (``model.bias_balancing``, aux loss 0; Wang et al. 2024), and
prints for each the mean over steps and MoE layers of the dropped share and of the busiest expert's load over
the mean (Wang et al.'s MaxVio, ``load_max x E - 1``).  ``--router-score both`` likewise trains it with
GShard's softmax scores and with DeepSeek-V3's sigmoid affinities (``model.router_score``; with
``--router-groups``, ``--router-group-top-k`` and ``--router-scale`` its node-limited routing and gate
scale, for every variant).  ``--aux-loss-scope both`` trains it with the load-balancing loss's first-choice
shares counted per sequence (``group``: Switch, GShard) and over the whole batch (``global``: Qiu et al. 2025,
"Demons in the Detail"; Megatron-core's ``global_aux_loss``; ``model.aux_loss_scope``); ``all`` adds
``global_step``, the counts summed over the micro-batches of the step so far (the paper's buffer for gradient
accumulation), which differs from ``global`` only when a step runs as several micro-batches
(``--micro-batches N``: the ``--batch`` sequences of a step in N micro-batches, gradients accumulated, and the
validation set the same ``--eval-batches`` x ``--batch`` windows, in N times as many batches); it prints
for each the last step's per-expert load spread (the least and the most loaded expert's share of the dispatched
choices, per MoE layer).  ``--drop-policy all`` trains it with each of ``model.drop_policy``'s rules for which
choices keep an over-full expert's slots (GShard's position order, V-MoE's Batch Prioritized Routing, Riquelme
et al. 2021, and Megatron-core's per-expert probabilities), usefully at a tight ``--capacity-factor`` (and
``--eval-capacity-factor``).  Both models run through podscale's trunk (task, engine, AdamW, cosine schedule) in
one process, on the byte-level corpus (``--data``: a text file; default the Python standard library's
source, the embedded corpus), with the same seed — hence the same initial attention/embedding weights and
the same sequence of training batches (the loader's order is a function of the seed) — the same tokens per
step, learning rate and steps.  Prints both models' parameter counts, FLOPs per token (the tasks' own
formula), the median step time, the final training loss (mean of the last 10 % of steps) and the
validation loss (``--eval-batches`` batches of held-out text), and the difference.

    python bench/moe_vs_dense.py          # the full setting (estimated 12-15 minutes on 2 idle cores)
    python bench/moe_vs_dense.py --steps 40 --n-embd 64 --block-size 64   # a smoke run
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import podscale
from podscale.config import parse_config
from podscale.parallel.moe import AUX_LOSS_SCOPES, DROP_POLICIES
from podscale.runtime.mesh import Mesh
from podscale.tasks import task_for

#: ``--aux-loss-scope`` values that train the GPT-MoE once with each of several scopes
SCOPE_SETS = {"both": ("group", "global"), "all": AUX_LOSS_SCOPES}
#: what the summary line says f_e is counted over, per scope
SCOPE_WORDS = {"group": "sequence", "global": "batch (global)", "global_step": "step (global, over its micro-batches)"}


def train(model_section: dict, args) -> dict:
    cfg = parse_config({
        # (the GPT task's validation set is eval_batches global batches, in micro-batches: the same windows)
        "run": {"name": "moe-vs-dense", "steps": args.steps, "seed": args.seed, "eval_batches": args.eval_batches},
        "model": model_section,
        "data": {"path": args.data} if args.data else {},
        "parallel": {"nproc": 1},
        "train": {"global_batch": args.batch, "micro_batch": args.batch // args.micro_batches, "lr": args.lr, "min_lr": args.lr / 10,
                  "warmup_steps": max(1, args.steps // 20)},
    })
    mesh = Mesh.build()
    task = task_for(cfg)
    torch.manual_seed(cfg.run.seed)
    model = task.build_model_on(mesh)
    engine = podscale.parallelize(model, mesh, cfg, task)
    loader, val = task.train_data(0, 1), task.eval_data(0, 1)
    t0 = time.perf_counter()
    losses, step_s, drops, maxvio = [], [], [], []
    metrics = {}
    with engine:
        for _ in range(args.steps):
            t = time.perf_counter()
            losses.append(engine.step(loader.next_step()).loss)
            task.after_step(engine.model, mesh)
            metrics = task.step_metrics(engine.model, mesh)
            step_s.append(time.perf_counter() - t)
            experts = model_section.get("experts", 1)
            for k, v in metrics.items():
                if k.endswith("/dropped_share"):
                    drops.append(v)
                elif k.endswith("/load_max"):
                    maxvio.append(v * experts - 1)
        seconds = time.perf_counter() - t0
        val_loss = task.evaluate(engine, val)["loss"]
    tail = losses[-max(1, args.steps // 10):]
    dropped = [v for k, v in metrics.items() if k.endswith("/dropped_share")]
    return {"kind": model_section["kind"], "params": sum(p.numel() for p in engine.model.parameters()),
            "flops_per_token": task.flops_per_sample() / task.units_per_sample(),
            "train_loss": sum(tail) / len(tail), "val_loss": val_loss, "seconds": seconds,
            "step_ms": 1e3 * statistics.median(step_s),
            "last_dropped_share": sum(dropped) / len(dropped) if dropped else None,
            "mean_dropped_share": statistics.fmean(drops) if drops else None,
            "mean_maxvio": statistics.fmean(maxvio) if maxvio else None,
            # the last step's per-expert load spread of each MoE layer: (least, most) loaded expert's share
            "last_load": {k.removesuffix("/load_min"): (v, metrics[k.removesuffix("min") + "max"])
                          for k, v in metrics.items() if k.endswith("/load_min")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=1)
    ap.add_argument("--shared-experts", type=int, default=0)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--moe-every", type=int, default=2)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="run each step's --batch sequences as this many micro-batches (gradient accumulation)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-batches", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--data", default=None, help="a text file (default: the Python standard library's source)")
    ap.add_argument("--aux-loss-coef", type=float, default=0.01)
    ap.add_argument("--balancing", choices=("aux", "bias", "both"), default="aux",
                    help="the GPT-MoE balanced by the aux loss, by DeepSeek-V3's selection biases (aux loss 0), or "
                         "trained once each")
    ap.add_argument("--bias-update-rate", type=float, default=1e-3)
    ap.add_argument("--router-score", choices=("softmax", "sigmoid", "both"), default="softmax",
                    help="the router's scores (model.router_score): GShard's softmax, DeepSeek-V3's sigmoid "
                         "affinities, or the GPT-MoE trained once with each")
    ap.add_argument("--aux-loss-scope", choices=AUX_LOSS_SCOPES + tuple(SCOPE_SETS), default="group",
                    help="where the load-balancing loss counts f_e (model.aux_loss_scope): per sequence, over the "
                         "whole micro-batch (Qiu et al. 2025), over the step's micro-batches so far; or the GPT-MoE "
                         "trained once with each of group and global (both) or of the three (all)")
    ap.add_argument("--router-groups", type=int, default=1, help="model.router_groups (node-limited routing)")
    ap.add_argument("--router-group-top-k", type=int, default=1, help="model.router_group_top_k")
    ap.add_argument("--router-scale", type=float, default=1.0, help="model.router_scale (gate values times this)")
    ap.add_argument("--eval-capacity-factor", type=float, default=2.0, help="model.eval_capacity_factor")
    ap.add_argument("--drop-policy", choices=DROP_POLICIES + ("all",), default="position",
                    help="model.drop_policy: which choices keep an over-full expert's slots (all: one run each)")
    args = ap.parse_args()
    if args.micro_batches < 1 or args.batch % args.micro_batches:
        raise SystemExit(f"--micro-batches {args.micro_batches} must divide --batch {args.batch}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    gpt = {"n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd, "block_size": args.block_size}
    active = args.top_k + args.shared_experts
    if (4 * args.n_embd) % active:
        raise SystemExit(f"--top-k + --shared-experts = {active} must divide 4 * n_embd = {4 * args.n_embd}")
    moe = dict(gpt, kind="gpt-moe", experts=args.experts, top_k=args.top_k, moe_every=args.moe_every,
               expert_hidden=4 * args.n_embd // active, random_routing=args.top_k == 2,
               capacity_factor=args.capacity_factor, eval_capacity_factor=args.eval_capacity_factor,
               aux_loss_coef=args.aux_loss_coef,
               shared_experts=args.shared_experts, router_groups=args.router_groups,
               router_group_top_k=args.router_group_top_k, router_scale=args.router_scale)
    balancing = {"aux": {}, "bias": dict(aux_loss_coef=0.0, bias_balancing=True,
                                         bias_update_rate=args.bias_update_rate)}
    balancings = ("aux", "bias") if args.balancing == "both" else (args.balancing,)
    scores = ("softmax", "sigmoid") if args.router_score == "both" else (args.router_score,)
    scopes = SCOPE_SETS.get(args.aux_loss_scope, (args.aux_loss_scope,))
    policies = DROP_POLICIES if args.drop_policy == "all" else (args.drop_policy,)
    variants = {b + ("" if s == "softmax" else f"-{s}") + ("" if a == "group" else f"-{a}")
                + ("" if d == "position" else f"-{d}"):
                dict(moe, **balancing[b], router_score=s, aux_loss_scope=a, drop_policy=d)
                for b in balancings for s in scores for a in scopes for d in policies}
    dense = train(dict(gpt, kind="gpt"), args)
    sparse = {name: train(v, args) for name, v in variants.items()}
    print(f"{args.steps} steps of {args.batch} x {args.block_size} = {args.batch * args.block_size} tokens "
          f"({args.micro_batches} micro-batch{'es' if args.micro_batches > 1 else ''}), the same batches for all")
    for name, r in [("dense", dense)] + [(f"moe-{k}", v) for k, v in sparse.items()]:
        drop = "" if r["last_dropped_share"] is None else (
            f"  dropped {r['last_dropped_share']:.1%} (last step), {r['mean_dropped_share']:.1%} (mean); MaxVio "
            f"{r['mean_maxvio']:.3f} (mean)")
        print(f"{name:9s} params {r['params'] / 1e6:6.2f}M  FLOPs/token {r['flops_per_token'] / 1e6:7.2f}M  "
              f"step {r['step_ms']:6.1f} ms (median)  train loss {r['train_loss']:.4f}  val loss "
              f"{r['val_loss']:.4f}  ({r['seconds']:.0f} s){drop}")
        for layer, (lo, hi) in r.get("last_load", {}).items():
            print(f"{'':9s} {layer}: expert load share at the last step min {lo:.3f} max {hi:.3f} "
                  f"(uniform {1 / args.experts:.3f})")
    shared = f" + {args.shared_experts} shared" if args.shared_experts else ""
    for name, r in sparse.items():
        how = (f"aux loss {args.aux_loss_coef:g}" if name.startswith("aux") else
               f"selection biases, rate {args.bias_update_rate:g}, no aux loss")
        how += f", {variants[name]['router_score']} scores"
        if name.startswith("aux"):
            how += f", f_e per {SCOPE_WORDS[variants[name]['aux_loss_scope']]}"
        if args.router_groups > 1:
            how += f", top {args.router_group_top_k} of {args.router_groups} expert groups"
        if args.router_scale != 1.0:
            how += f", gates x {args.router_scale:g}"
        how += f", slots kept by {variants[name]['drop_policy']}"
        print(f"GPT-MoE ({args.experts} experts, top-{args.top_k}{shared}, capacity {args.capacity_factor} (evaluation "
              f"{args.eval_capacity_factor}), every "
              f"{args.moe_every} blocks, {how}) vs dense at {r['flops_per_token'] / dense['flops_per_token']:.3f}x "
              f"the FLOPs per token, {args.steps} steps: validation loss {r['val_loss']:.4f} vs "
              f"{dense['val_loss']:.4f} (difference {r['val_loss'] - dense['val_loss']:+.4f}); step time "
              f"{r['step_ms'] / dense['step_ms']:.2f}x")
    print(json.dumps({"dense": dense, "moe": sparse, "args": vars(args)}))


if __name__ == "__main__":
    main()
