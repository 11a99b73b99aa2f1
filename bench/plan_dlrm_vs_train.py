"""Planner vs. measured for DLRM: the step time :mod:`podscale.plan.dlrm_cost` predicts on the calibrated
``local`` system beside the step time of `podscale train` with ``[model] kind = "dlrm"`` (2 gloo ranks,
generated Criteo-like data) for the same model, layout and batch, over cases that differ in table count,
dimension, ids per bag, batch, sharding, store (keyed / dense) and tier (one case with a DRAM budget over the
SSD tier).  None of them is what ``plan calibrate`` measured: its table rates come from microbenchmarks of
single operations on synthetic keys (``[table]`` of the system file).

    python -m podscale.plan calibrate       # once, on an idle machine (or: calibrate --table-only)
    python bench/plan_dlrm_vs_train.py [--steps 30] [--small]

The statistic is the one calibration uses (a low percentile of the step times after the first quarter);
the prediction is for the middle step of that window (keyed stores still create rows for ids no earlier
step drew: :func:`podscale.table.estimate.expected_new`).  Prints
predicted / measured per case, and the mean and largest |error|; the prediction's table model (host or
bandwidth) is named.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from podscale.plan import load_system, predict
from podscale.plan.calibrate import low_percentile
from podscale.plan.models import DLRM

# (label, tables (cardinality), dim, (min ids, max ids), global batch, sharding, storage, DRAM MiB per shard)
CASES = [
    ("4 x 100k, dim 16, 1 id, b256, row", [100_000] * 4, 16, (1, 1), 256, "row", "keyed", None),
    ("8 x 100k, dim 64, 10-20 ids, b256, row", [100_000] * 8, 64, (10, 20), 256, "row", "keyed", None),
    ("6 x 50k, dim 32, 4-8 ids, b512, table", [50_000] * 6, 32, (4, 8), 512, "table", "keyed", None),
    ("4 x 200k, dim 32, 2-6 ids, b1024, column", [200_000] * 4, 32, (2, 6), 1024, "column", "keyed", None),
    ("6 x 50k, dim 32, 4-8 ids, b512, table, dense", [50_000] * 6, 32, (4, 8), 512, "table", "dense", None),
    ("3 x 400k, dim 32, 5-15 ids, b512, row, SSD 4 MiB", [400_000] * 3, 32, (5, 15), 512, "row", "keyed", 4.0),
]
SMALL = {"batch": 0.5}


def run_train(cards, dim, ids, batch, sharding, storage, budget, steps, out: Path, name: str) -> float:
    tables = ", ".join(f'{{name = "t{i}", cardinality = {c}}}' for i, c in enumerate(cards))
    lo, hi = ids
    extra = ""
    if storage == "dense":
        extra += 'table_storage = "dense"\ndeclare_range = true\n'
    if budget is not None:
        extra += f'dram_budget_mb = {budget}\nssd_path = "{out / (name + "-ssd")}"\n'
    config = out / f"{name}.toml"
    config.write_text(f"""
[run]
name = "{name}"
steps = {steps}
log_every = 1000
[model]
kind = "dlrm"
embedding_dim = {dim}
bottom_mlp = [64, 32]
top_mlp = [64, 32]
tables = [{tables}]
min_ids = {lo}
max_ids = {hi}
sharding = "{sharding}"
{extra}[parallel]
nproc = 2
[train]
global_batch = {batch}
micro_batch = {batch // 2}
[checkpoint]
at_end = false
""")
    subprocess.run([sys.executable, "-m", "podscale", "train", str(config), "--out-dir", str(out), "--fresh"],
                   check=True, capture_output=True, text=True, timeout=1800)
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r][len(rows) // 4:]
    return low_percentile(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--small", action="store_true", help="half the batches (a quick check that it runs)")
    ap.add_argument("--cases", help="comma-separated case numbers (default: all)")
    args = ap.parse_args(argv)
    system = load_system("local")
    print(f"system: {system.description}")
    pick = [int(c) for c in args.cases.split(",")] if args.cases else range(len(CASES))
    print(f"{'case (2 ranks)':<50}{'measured s':>12}{'predicted s':>13}{'pred/meas':>11}")
    errors, model_used = [], ""
    with tempfile.TemporaryDirectory() as tmp:
        for i in pick:
            label, cards, dim, ids, batch, sharding, storage, budget = CASES[i]
            if args.small:
                batch = int(batch * SMALL["batch"])
            measured = run_train(cards, dim, ids, batch, sharding, storage, budget, args.steps, Path(tmp),
                                 f"case{i}")
            model = DLRM(tables=tuple((c, dim) for c in cards), bottom_mlp=(13, 64, 32, dim),
                         top_mlp=(64, 32, 1), lookups_per_table=(ids[0] + ids[1]) / 2, sharding=sharding,
                         storage=storage, dram_budget_mb=budget, step=round(0.625 * args.steps))
            pred = predict(system, 2, model, {"tp": 1, "pp": 1, "dp": 2, "microbatch": batch // 2}, batch)
            model_used = pred.notes[0]
            ratio = pred.step_time_s / measured
            errors.append(abs(ratio - 1))
            print(f"{label:<50}{measured:>12.4f}{pred.step_time_s:>13.4f}{ratio:>11.2f}", flush=True)
    print(f"mean |error| {sum(errors) / len(errors):.0%}, max {max(errors):.0%}; {model_used}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
