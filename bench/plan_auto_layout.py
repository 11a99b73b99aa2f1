"""`--layout auto` against measurement: the chosen layout vs. at least six others, measured in one run.

Loads a small GPT config, asks the planner (`podscale.plan.auto.choose_layout`, system `local` from
`podscale plan calibrate`) for its choice and its runners-up, adds hand-picked layouts (dp with ZeRO 0 and 3,
tp 2, pp 2) so that at least six distinct layouts (at most ``--max-layouts``) are measured, runs each with
`podscale train` on 2 local ranks, and prints measured and predicted step times (20th percentile after
warm-up, as calibration). Goal (issue 15): the chosen layout's measured step time within 10 % of the best of
at least six measured. The layouts are measured in ``--repeat`` rounds (round-robin), each layout's fastest
round counting (other work only slows a run down), and the rounds' spread for one layout is printed as the
measurement's noise: a chosen / best ratio inside it says nothing either way. Default settings (3 rounds)
take about 7-10 minutes on an idle 2-core machine; ``--small`` checks the script in about two.

    python -m podscale.plan calibrate                  # on an idle machine
    python bench/plan_auto_layout.py [--calibrate] [--steps 12] [--repeat 3] [--max-layouts 8]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import tempfile
from pathlib import Path

from podscale.config import load_config
from podscale.plan import load_system, predict
from podscale.plan.auto import as_trained, choose_layout, gpt_of, layout_overrides
from podscale.plan.calibrate import low_percentile
from podscale.plan.layout import Layout


COMMON = ["run.eval_every=0", "run.sample_tokens=0", "checkpoint.every=100000"]
MODEL = ["model.n_layer=8", "model.n_head=8", "model.n_embd=256", "model.block_size=128",
         "train.global_batch=16", "train.micro_batch=4"] + COMMON
SMALL = ["model.n_layer=2", "model.n_head=4", "model.n_embd=128", "model.block_size=64",
         "train.global_batch=16", "train.micro_batch=4"] + COMMON
MIN_LAYOUTS = 6
EXTRA = [Layout(dp=2, microbatch=4), Layout(dp=2, microbatch=8, zero_stage=3), Layout(tp=2, microbatch=8),
         Layout(pp=2, microbatch=4), Layout(dp=2, microbatch=2, zero_stage=1), Layout(dp=2, microbatch=8, zero_stage=2),
         Layout(pp=2, microbatch=2)]


def measure(base: list, overrides: list, steps: int, out: Path, name: str) -> float:
    import json
    import subprocess
    cmd = [sys.executable, "-m", "podscale.cli", "train", "--nproc", "2", "--steps", str(steps),
           "--out-dir", str(out), "--name", name, "--fresh"]
    for s in base + overrides:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines() if x.strip()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r]
    return low_percentile(times[len(times) // 4:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=3, help="rounds over all layouts (default 3)")
    ap.add_argument("--max-layouts", type=int, default=8)
    ap.add_argument("--system", default="local")
    ap.add_argument("--calibrate", action="store_true", help="recalibrate the local system first (files written "
                    "before the optimizer, gradient-pass and overlap measurements price those as on a GPU)")
    ap.add_argument("--small", action="store_true", help="a 2-layer model, 4 steps, one run each: checks the script")
    args = ap.parse_args(argv)
    if args.small:
        args.steps, args.repeat = 4, 1
    base = SMALL if args.small else MODEL
    start = time.perf_counter()
    if args.calibrate:
        from podscale.plan.calibrate import calibrate
        calibrate()
    cfg = load_config(None, base)
    system = load_system(args.system)
    choice = choose_layout(cfg, 2, system, keep=3)
    print(choice.describe())
    layouts = [choice.layout] + [Layout(**{k: v for k, v in p.layout.items() if k != "pipeline_layers"})
                                 for p, _ in choice.ranked[1:]]
    for lay in EXTRA:
        lay = as_trained(lay)
        if cfg.train.global_batch % (lay.dp * lay.microbatch):
            continue
        if all(lay.short() != seen.short() for seen in layouts):
            layouts.append(lay)
    layouts = layouts[:max(args.max_layouts, MIN_LAYOUTS)]
    model = gpt_of(cfg)
    preds = [predict(system, 2, model, lay, cfg.train.global_batch).step_time_s for lay in layouts]
    # Rounds over all layouts (round-robin), the fastest run of each counting: a slow spell of the machine
    # hits every layout alike instead of the ones measured during it (the chosen layout comes first).
    times = [[] for _ in layouts]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            for i, lay in enumerate(layouts):
                times[i].append(measure(base, layout_overrides(lay), args.steps, Path(tmp), f"l{i}r{r}"))
                if r == args.repeat - 1:
                    rounds = " ".join(f"{t:.4f}" for t in times[i])
                    print(f"{'chosen ' if i == 0 else '       '}{lay.short():<36} measured {min(times[i]):.4f} s  "
                          f"predicted {preds[i]:.4f} s  (rounds: {rounds})", flush=True)
    results = [(lay, min(t), p) for lay, t, p in zip(layouts, times, preds)]
    best = min(m for _, m, _ in results)
    ratio = results[0][1] / best
    met = ratio <= 1.10 and len(results) >= MIN_LAYOUTS
    print(f"{len(results)} layouts measured; chosen / best measured = {ratio:.3f}")
    # The noise of the measurement itself, fixed before any outcome was seen: how far apart the rounds of one
    # layout are (slowest / fastest round, median over the layouts). A chosen / best ratio inside it is not
    # evidence either way; then rerun with more rounds (--repeat) on an idle machine.
    if args.repeat > 1:
        spread = sorted(max(t) / min(t) for t in times)[len(times) // 2]
        print(f"noise: median over layouts of slowest / fastest round = {spread:.3f} ({args.repeat} rounds)"
              + ("; chosen / best is within it" if ratio <= spread else ""))
    print(f"GOAL (issue 15): the layout --layout auto chooses is within 10 % of the best of >= {MIN_LAYOUTS} measured "
          f"layouts: {'MET' if met else 'NOT MET'} ({time.perf_counter() - start:.0f} s; "
          f"load average {os.getloadavg()[0]:.1f} at the end: figures are final only on an idle machine)")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
