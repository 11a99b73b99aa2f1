"""Host overhead: podscale's training step against a plain PyTorch loop on the same GPT, data and optimizer.

Both sides run in the same worker processes and step alternately on the same batches, so machine load and
clock changes hit them alike; the median step time of each and the throughput ratio (plain / podscale:
>= 1.0 means podscale is as fast as the plain loop) are printed.

* 1 rank: a plain loop (``model(x, y)``, ``loss.backward()``, ``clip_grad_norm_``, fused AdamW, the same
  cosine learning rate set on the groups) vs podscale stage 0 (replicated) and ZeRO-3, both built through
  ``podscale.parallelize`` from a :class:`~podscale.config.Config`, as a user would.
* 2 ranks (``--nproc 2``; on CUDA only with 2 GPUs): torch's ``DistributedDataParallel`` + the same loop vs
  podscale stage 0 over dp = 2.

The GPT is built eagerly from the same seed on every side.  On CUDA (``--device cuda``) every step ends with
``torch.cuda.synchronize()`` on both sides.  Each side's loss is read as a Python float every step (the
plain loop's ``loss.item()`` for logging; podscale's ``Engine.step`` returns floats), so both synchronise
once per step.  ``--profile`` prints a ``torch.profiler`` table of one step of
each side on rank 0 (self CPU time per op: the host work each side adds).

    python bench/overhead.py [--device cpu|cuda] [--layers 6 --width 384 --micro 4 --block 128]
    python bench/overhead.py --nproc 2
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn as nn


def _config(args: dict, stage: int):
    from podscale.config import Config
    return Config.model_validate({
        "run": {"device": args["device"]},
        "model": {"kind": "gpt", "n_layer": args["layers"], "n_embd": args["width"],
                  "n_head": max(1, args["width"] // 64), "block_size": args["block"], "vocab_size": args["vocab"]},
        "train": {"global_batch": args["micro"] * args["world"], "micro_batch": args["micro"], "lr": 1e-4,
                  "min_lr": 1e-5, "warmup_steps": 0, "decay_steps": 1000, "grad_clip": 1.0,
                  "precision": args["precision"]},
        "parallel": {"dp": args["world"]},
        "zero": {"stage": stage}})


class PlainLoop:
    """What a PyTorch user writes: forward, backward, clip, fused AdamW (decay on matrices), the cosine lr."""

    def __init__(self, model: nn.Module, cfg, device: torch.device, ddp: bool):
        from podscale.optim import cosine_lr
        self.cosine_lr, self.t = cosine_lr, cfg.train
        self.model = model.to(device)
        if ddp:
            self.model = nn.parallel.DistributedDataParallel(self.model, device_ids=None)
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": self.t.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=self.t.lr, betas=(self.t.beta1, self.t.beta2), eps=self.t.eps,
                                     fused=True)
        self.device, self.step_count = device, 0
        self.amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.t.precision)

    def step(self, batch) -> float:
        x, y = (b.to(self.device, non_blocking=True) for b in batch)
        lr = self.cosine_lr(self.step_count, self.t.lr, self.t.min_lr, self.t.warmup_steps, self.t.decay_steps)
        for g in self.opt.param_groups:
            g["lr"] = lr
        with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):
            _, loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.t.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_count += 1
        return loss.detach()


def worker(args: dict) -> dict:
    import podscale
    from podscale.models.gpt import GPT
    from podscale.tasks.gpt import gpt_config

    cfg0 = _config(args, 0)
    mesh = podscale.init(cfg0)
    dev = mesh.device
    world = mesh.size("dp")
    if dev.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    g = torch.Generator().manual_seed(mesh.rank)
    vocab, block = args["vocab"], args["block"]
    batches = [(torch.randint(0, vocab, (args["micro"], block), generator=g),
                torch.randint(0, vocab, (args["micro"], block), generator=g))
               for _ in range(args["warmup"] + args["steps"])]
    sides = {}
    for name in args["sides"]:
        torch.manual_seed(0)
        model = GPT(gpt_config(cfg0))
        if name == "plain":
            sides[name] = PlainLoop(model, cfg0, dev, ddp=world > 1).step
        else:
            stage = {"stage0": 0, "zero3": 3}[name]
            engine = podscale.parallelize(model, mesh, _config(args, stage))
            sides[name] = (lambda e: (lambda batch: e.step([batch]).loss))(engine)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times = {n: [] for n in sides}
    cpu = {n: [] for n in sides}  # process CPU time of the step (every thread), less sensitive to machine load
    losses = {n: [] for n in sides}
    tables, counts = {}, {}
    for i, batch in enumerate(batches):
        for name, step in sides.items():
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = step(batch)
            sync()
            if i >= args["warmup"]:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            losses[name].append(float(loss))
    if args["profile"]:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        for name, step in sides.items():
            with profile(activities=acts) as prof:
                step(batches[-1])
                sync()
            # load-independent counts of host work: operators dispatched (top level: not nested in another
            # operator) and all operators, per step
            ev = [e for e in prof.events() if e.name.startswith("aten::")]
            top = [e for e in ev if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
            counts[name] = (len(top), len(ev))
            tables[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                                     max_name_column_width=50)
    return {"median": {n: statistics.median(v) for n, v in times.items()},
            "cpu": {n: statistics.median(v) for n, v in cpu.items()}, "losses": losses, "tables": tables, "counts": counts,
            "device": str(dev), "world": world}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--nproc", type=int, default=1, help="1: plain vs stage 0 and ZeRO-3; 2: DDP vs stage 0")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--micro", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sides", default=None, help="comma list of plain, stage0, zero3 (default: all for 1 rank, "
                    "plain,stage0 for 2)")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    if a.device == "cuda" and a.nproc > torch.cuda.device_count():
        ap.error(f"--nproc {a.nproc} needs {a.nproc} GPUs (found {torch.cuda.device_count()}): use --nproc 1")
    from podscale.runtime.launcher import launch
    sides = a.sides.split(",") if a.sides else (["plain", "stage0", "zero3"] if a.nproc == 1 else ["plain", "stage0"])
    args = dict(vars(a), sides=sides, world=a.nproc)
    res = launch(worker, (args,), nproc=a.nproc, quiet=True)
    r0 = res[0]
    med = r0["median"]
    plain = "DDP + plain loop" if r0["world"] > 1 else "plain loop"
    print(f"GPT {a.layers} x {a.width}, vocabulary {a.vocab}, {a.micro} x {a.block} tokens per rank, {a.precision}, "
          f"AdamW (fused), clip 1.0; {r0['world']} rank(s) on {r0['device']}; median of {a.steps} steps after "
          f"{a.warmup}, sides alternating step by step (rank 0)")
    cpu = r0["cpu"]
    print(f"  {'':22s} {'step':>12s} {'process CPU':>14s}   plain / podscale (step; CPU)")
    for name in sides:
        label = plain if name == "plain" else f"podscale {name}"
        ratio = "" if name == "plain" or "plain" not in med else \
            f"   {med['plain'] / med[name]:.3f}x; {cpu['plain'] / cpu[name]:.3f}x"
        print(f"  {label:22s} {med[name] * 1e3:9.2f} ms {cpu[name] * 1e3:11.2f} ms{ratio}")
    last = {n: v[-1] for n, v in r0["losses"].items()}
    print("  last losses: " + ", ".join(f"{n} {v:.5f}" for n, v in last.items()))
    for name, (top, every) in r0["counts"].items():
        print(f"  operators per step, {name:8s}: {top:5d} dispatched by Python, {every:5d} in all")
    for name, t in r0["tables"].items():
        print(f"\n== {name} ==\n{t}")


if __name__ == "__main__":
    main()
