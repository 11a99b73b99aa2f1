"""Planner vs. measured for DLRM: the step time :mod:`podscale.plan.dlrm_cost` predicts on the calibrated
``local`` system beside the step time of `podscale train` with ``[model] kind = "dlrm"`` (2 gloo ranks,
row-wise tables in memory, generated Criteo-like data) for the same model and batch.

    python -m podscale.plan calibrate       # once, on an idle machine
    python bench/plan_dlrm_vs_train.py [--steps 30]

The statistic is the one calibration uses (a low percentile of the step times after warm-up).  The cost
model counts the tables' bytes moved (lookups, gradients, row updates), the all-to-all of pooled vectors
and the MLP GEMMs; podscale's table does its routing and deduplication in Python, which the model does not
count, so on a CPU the ratio says how much of the step that bookkeeping is.
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

# (label, tables (cardinality), dim, ids per bag, global batch)
CASES = [
    ("4 tables x 100k, dim 16, 1 id, batch 256", [100_000] * 4, 16, 1, 256),
    ("8 tables x 100k, dim 64, 10-20 ids, batch 256", [100_000] * 8, 64, 15, 256),
]


def run_train(cards, dim, ids, batch, steps, out: Path, name: str) -> float:
    tables = ", ".join(f'{{name = "t{i}", cardinality = {c}}}' for i, c in enumerate(cards))
    lo, hi = (ids, ids) if ids == 1 else (10, 20)
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
[parallel]
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
    times = [r["step_time_s"] for r in rows][len(rows) // 4:]
    return low_percentile(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    system = load_system("local")
    print(f"system: {system.description}")
    print(f"{'case (2 ranks)':<48}{'measured s':>12}{'predicted s':>13}{'pred/meas':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, cards, dim, ids, batch) in enumerate(CASES):
            measured = run_train(cards, dim, ids, batch, args.steps, Path(tmp), f"case{i}")
            model = DLRM(tables=tuple((c, dim) for c in cards), bottom_mlp=(13, 64, 32, dim),
                         top_mlp=(64, 32, 1), lookups_per_table=ids)
            pred = predict(system, 2, model, {"tp": 1, "pp": 1, "dp": 2, "microbatch": batch // 2}, batch)
            print(f"{label:<48}{measured:>12.4f}{pred.step_time_s:>13.4f}{pred.step_time_s / measured:>11.2f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
