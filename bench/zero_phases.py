"""Where ZeRO-3's step time goes, against the replicated (stage 0) step on the same model, in one run.

Both engines are built in the same worker processes (2 gloo ranks on this CPU) from the same eagerly built
GPT and step alternately on the same batches, so machine load hits both alike.  Per phase (forward,
backward, gradient sync, norm + clip, optimizer step, zero_grad) the median over the measured steps is
printed for each, with the difference; ``--profile`` adds a ``torch.profiler`` table of one stage-3 step
on rank 0 (self CPU time per op, which names gathers, copies and hooks).

    python bench/zero_phases.py [--layers 12 --width 640 --vocab 256 --block 128 --micro 4 --steps 6]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def worker(args: dict) -> dict:
    from podscale.config import TrainSection, ZeroSection
    from podscale.models.gpt import GPT, GPTConfig
    from podscale.optim import build_adamw
    from podscale.parallel.data import DataParallel
    from podscale.parallel.zero import build_strategy
    from podscale.runtime.mesh import Mesh
    from podscale.runtime.process import init_process
    from podscale.tasks.gpt import gpt_loss_fn
    from podscale.train.engine import Engine

    info = init_process()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // info.world_size))
    mesh = Mesh.build(info.device, dp=info.world_size)
    cfg = GPTConfig(vocab_size=args["vocab"], block_size=args["block"], n_layer=args["layers"],
                    n_head=max(1, args["width"] // 64), n_embd=args["width"])
    train = TrainSection(lr=1e-4, min_lr=1e-5, warmup_steps=0, decay_steps=1000, grad_clip=1.0)
    g = torch.Generator().manual_seed(info.rank)
    batches = [(torch.randint(0, cfg.vocab_size, (args["micro"], cfg.block_size), generator=g),
                torch.randint(0, cfg.vocab_size, (args["micro"], cfg.block_size), generator=g))
               for _ in range(args["steps"] + args["warmup"])]
    engines = {}
    for name in args["kinds"]:
        torch.manual_seed(0)
        model = GPT(cfg)
        if name == "stage0":
            opt = build_adamw(model, train.lr, (train.beta1, train.beta2), train.eps, train.weight_decay)
            strategy = DataParallel(model, mesh, ("dp",), optimizer=opt)
        else:
            strategy = build_strategy(model, mesh, train, ZeroSection(stage=int(name[5]), **args["zero_set"]))
        engines[name] = Engine(model, mesh, train, strategy, gpt_loss_fn(train.precision, mesh.device))
    phases = {n: {} for n in engines}

    def timed(name, label, fn):
        def wrap(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            phases[name].setdefault(label, []).append(time.perf_counter() - t0)
            return out
        return wrap

    for name, e in engines.items():
        s = e.strategy
        e.loss_fn = timed(name, "forward", e.loss_fn)
        s.forward_backward = timed(name, "fwd+bwd", s.forward_backward)
        for m in ("finish_grad_sync", "grad_norm", "scale_grads", "step", "zero_grad"):
            setattr(s, m, timed(name, m, getattr(s, m)))
    total = {n: [] for n in engines}
    cpu = {n: [] for n in engines}  # process CPU time (every thread: compute and gloo's), robust to load
    sys_t = {n: [] for n in engines}  # of which in the kernel (TCP copies, page faults)
    from podscale.runtime import comm
    inplace_min = comm.GLOO_INPLACE_MIN_BYTES
    prof_table = None
    for i, batch in enumerate(batches):
        for name, e in engines.items():
            if i == args["warmup"]:
                for v in phases[name].values():
                    v.clear()
            # "stageN:flat": torch's flat gloo collectives (with their staging copies), for an A/B in one run
            comm.GLOO_INPLACE_MIN_BYTES = 1 << 62 if name.endswith(":flat") else inplace_min
            t0, c0, s0 = time.perf_counter(), time.process_time(), os.times().system
            if args["profile"] and i == len(batches) - 1:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    e.step([batch])
                prof_table = (prof_table or "") + f"\n== {name} ==\n" + prof.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50) + \
                    prof.key_averages(group_by_input_shape=True).table(
                        sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=30)
            else:
                e.step([batch])
            if i >= args["warmup"]:
                total[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                sys_t[name].append(os.times().system - s0)
    for e in engines.values():
        e.close()
    out = {n: {"total": statistics.median(v), "process CPU": statistics.median(cpu[n]),
              "of which system": statistics.median(sys_t[n])} for n, v in total.items()}
    for n, ph in phases.items():
        for label, v in ph.items():
            out[n][label] = statistics.median(v) if v else 0.0
        out[n]["backward"] = out[n]["fwd+bwd"] - out[n]["forward"]
    return {"phases": out, "profile": prof_table}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--micro", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--kinds", default="stage0,stage3", help="comma list of stage0, stage1, stage2, stage3")
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of the last kind's last step")
    ap.add_argument("--zero-set", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args(argv)
    import json
    from podscale.runtime.launcher import launch
    args = dict(vars(a), kinds=a.kinds.split(","),
                zero_set={k: json.loads(v) for k, v in (kv.split("=", 1) for kv in a.zero_set)})
    res = launch(worker, (args,), nproc=a.nproc, quiet=True)
    r0 = res[0]
    kinds = args["kinds"]
    labels = ["total", "process CPU", "of which system", "forward", "backward", "finish_grad_sync", "grad_norm", "scale_grads", "step", "zero_grad"]
    print(f"GPT {a.layers}x{a.width}, vocab {a.vocab}, seq {a.block}, {a.micro} seq/rank, {a.nproc} ranks; "
          f"rank 0, median of {a.steps} steps (ms), engines alternating step by step")
    print(f"{'phase':18s}" + "".join(f"{k:>12s}" for k in kinds))
    for lab in labels:
        print(f"{lab:18s}" + "".join(f"{r0['phases'][k].get(lab, 0.0) * 1e3:12.1f}" for k in kinds))
    if r0["profile"]:
        print(r0["profile"])


if __name__ == "__main__":
    main()
