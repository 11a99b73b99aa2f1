"""How `--layout auto` ranks a GPT-MoE's expert placements: the best runnable layout of each tensor-parallel size
and placement of the experts (replicated over tp, folded into ep, or split over tp by expert tensor parallelism).

`podscale.plan.auto.ranked_layouts` predicts every layout the planner enumerates for the config (as the trainer
runs it: fused attention, tp overlap), drops those that do not fit, and yields the rest fastest first, each
checked by the trainer's config validator; this script walks that ranking and prints, for every (tp, placement),
the first one it meets with its rank, predicted step time and memory per device. The default model is the
catalogue's `moe-1.3b-64e` written as a training config (24 x 2048, 16 heads, sequence 2048, vocabulary 51,200,
64 experts, top-2, capacity 1.25, every other block) on 64 x dgx-a100-80g at global batch 512. Nothing runs on
the CPU but the planner.

    python bench/plan_moe_layouts.py [--system dgx-a100-80g] [--devices 64] [--batch 512] [--experts 64]
"""
from __future__ import annotations

import argparse
import time

from podscale.config import apply_override, parse_config
from podscale.plan.auto import ranked_layouts


def placement(lay) -> str:
    if lay.tp == 1:
        return "-"
    return "folded" if lay.fold_tp_into_ep else "ETP" if lay.expert_tensor_parallel else "replicated"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", default="dgx-a100-80g")
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64)
    args = ap.parse_args(argv)
    data: dict = {}
    for item in ["model.kind='gpt-moe'", "model.n_layer=24", "model.n_embd=2048", "model.n_head=16",
                 "model.block_size=2048", "model.vocab_size=51200", f"model.experts={args.experts}", "model.top_k=2",
                 "model.capacity_factor=1.25", "model.moe_every=2", f"train.global_batch={args.batch}"]:
        apply_override(data, item)
    cfg = parse_config(data)
    start = time.perf_counter()
    evaluated, layouts = ranked_layouts(cfg, args.devices, args.system)
    tps = {t for t in (1, 2, 4, 8) if t <= args.devices}
    wanted = {(1, "-")} | {(t, p) for t in tps - {1} for p in ("replicated", "folded", "ETP")}
    best = {}
    for rank, (pred, _, lay) in enumerate(layouts, 1):
        key = (lay.tp, placement(lay))
        if key in wanted and key not in best:
            best[key] = (rank, pred, lay)
            if len(best) == len(wanted):
                break
    print(f"{evaluated:,} layouts predicted and ranked in {time.perf_counter() - start:.0f} s "
          f"({args.devices} x {args.system}, batch {args.batch})")
    print(f"{'tp':>3} {'placement':<11}{'rank':>9}{'step s':>9}{'GiB':>7}  layout")
    for key in sorted(best):
        rank, pred, lay = best[key]
        print(f"{key[0]:>3} {key[1]:<11}{rank:>9,}{pred.step_time_s:>9.3f}{pred.memory_per_device_bytes / 2**30:>7.1f}  "
              f"{lay.short()}")
    for key in sorted(wanted - set(best)):
        print(f"{key[0]:>3} {key[1]:<11}  no runnable layout that fits")
    return best


if __name__ == "__main__":
    main()
