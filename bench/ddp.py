"""podscale data parallelism vs torch DistributedDataParallel, side by side on the same GPT and data.

Both run in the same process group, in alternating rounds (so machine noise hits both alike), with the same
model initialisation, batches, fused AdamW and 25 MB buckets.  Prints median step times and their ratio
(podscale / DDP; below 1.0 means podscale is faster) and checks that both trained to the same loss.

    python bench/ddp.py [--nproc 2] [--layers 6] [--embd 384] [--rounds 5] [--steps 6]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from podscale.config import TrainSection
from podscale.models.gpt import GPT, GPTConfig
from podscale.optim import build_adamw
from podscale.runtime.launcher import launch
from podscale.runtime.mesh import Mesh
from podscale.runtime.process import init_process
from podscale.train.data import ShardedLoader, load_tokens
from podscale.parallel.data import DataParallel
from podscale.tasks.gpt import gpt_loss_fn
from podscale.train.engine import Engine

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def _worker(args) -> dict:
    info = init_process()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    mesh = Mesh.build(info.device, dp=info.world_size)
    gcfg = GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.embd, block_size=args.block)
    train = TrainSection(global_batch=args.batch * info.world_size, micro_batch=args.batch, lr=3e-4, min_lr=3e-4,
                         warmup_steps=0, decay_steps=10**6, grad_clip=1.0)
    tokens = load_tokens(str(DATA) if DATA.is_file() else None)

    torch.manual_seed(0)
    model = GPT(gcfg).to(mesh.device)
    replicated = DataParallel(model, mesh, ("dp",), bucket_mb=25.0,
                              optimizer=build_adamw(model, train.lr, (train.beta1, train.beta2), train.eps,
                                                    train.weight_decay))
    ours = Engine(model, mesh, train, replicated, gpt_loss_fn(train.precision, mesh.device))
    torch.manual_seed(0)
    ref_model = GPT(gcfg)
    ddp = DDP(ref_model, bucket_cap_mb=25, gradient_as_bucket_view=True)
    opt = build_adamw(ref_model, 3e-4, (0.9, 0.95), 1e-8, 0.1)
    loaders = [ShardedLoader(tokens, args.block, train.global_batch, args.batch, info.rank, info.world_size, seed=1)
               for _ in range(2)]

    def ddp_step(batches):
        t0 = time.perf_counter()
        (x, y), = batches
        _, loss = ddp(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        return time.perf_counter() - t0, loss.detach()

    def ours_step(batches):
        r = ours.step(batches)
        return r.step_time_s, None

    times = {"podscale": [], "ddp": []}
    for rnd in range(args.rounds + 1):
        for name, fn, loader in (("podscale", ours_step, loaders[0]), ("ddp", ddp_step, loaders[1])):
            dist.barrier()
            for _ in range(args.steps):
                dt, _ = fn(loader.next_step())
                if rnd > 0:  # round 0 warms up both
                    times[name].append(dt)
    with torch.no_grad():
        (x, y), = loaders[0].next_step()
        loss_ours = ours.model(x, y)[1].item()
        loss_ddp = ref_model(x, y)[1].item()
    return {"times": times, "loss_ours": loss_ours, "loss_ddp": loss_ddp,
            "params": gcfg.num_params(), "comm": mesh.stats.per_axis()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--embd", type=int, default=384)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6, help="steps per round and implementation")
    args = p.parse_args()
    res = launch(_worker, (args,), nproc=args.nproc)
    r0 = res[0]
    # a step ends when the slowest rank ends: take the per-step max over ranks
    med = {}
    for name in ("podscale", "ddp"):
        per_step = [max(res[r]["times"][name][i] for r in res) for i in range(len(r0["times"][name]))]
        med[name] = statistics.median(per_step)
    print(f"GPT {r0['params'] / 1e6:.1f}M params, {args.nproc} ranks, {args.batch}x{args.block} tokens/rank/step, "
          f"{args.rounds} rounds x {args.steps} steps each")
    print(f"median step time: podscale {med['podscale'] * 1e3:.1f} ms, torch DDP {med['ddp'] * 1e3:.1f} ms")
    print(f"ratio podscale/DDP = {med['podscale'] / med['ddp']:.3f}  (goal <= 1.0)")
    print(f"loss after training: podscale {r0['loss_ours']:.5f}, DDP {r0['loss_ddp']:.5f}")
    ok = abs(r0["loss_ours"] - r0["loss_ddp"]) < 1e-3
    if not ok:
        print("losses differ: the two runs did not train the same model", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
