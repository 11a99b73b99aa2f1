"""How far above the mean a dropless MoE's busiest expert-parallel rank runs: the ``peak_rank_load`` a
GPT-MoE training run logs per MoE layer and step (the most rows one ep rank's experts ran in one forward
over the mean rank's, :class:`podscale.parallel.moe.MoEStats`), the figure the planner prices a dropless
layer's expert memory and time at (``model.dropless_peak_load``, default 2.0).

Each run is ``podscale train`` of the small GPT-MoE of ``examples/gpt-moe.toml`` (4 blocks, 128 wide, 8
experts top-2 in every other block) with ``model.dropless = true`` on gloo ranks of this machine, for
``--steps`` steps on the byte-level corpus (``--data``: a text file; default the embedded corpus, the
Python standard library's source), once per ep size and load-balancing coefficient.  A GShard / Switch
router keeps the load near balance only through its auxiliary loss (Switch, section 2.2), so the runs
with ``aux_loss_coef = 0`` show what the loss holds off.  Printed per run: the median and the largest
``peak_rank_load`` over the steps and layers (first ``--skip`` steps left out and reported apart), and the
planner's activation memory per device for ``moe-1.3b-64e`` made dropless (64 A100s, tp 1, dp 8, ep 8,
micro-batch 1), priced at the default and at the measured peak: an illustration of what the figure moves,
not a measurement of that model.

    python bench/moe_load.py                      # ep 2 and 4, aux 0.01 and 0, 200 steps each
    python bench/moe_load.py --steps 30 --ep 2 --aux 0.01    # a smoke run
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from podscale.cli import main as podscale_main
from podscale.plan import predict
from podscale.plan.models import get_model


def run(ep: int, aux: float, args, root: Path) -> list[dict]:
    """One training run; the per-step task metrics of its metrics.jsonl."""
    name = f"ep{ep}-aux{aux:g}"
    data = f'path = "{args.data}"\n' if args.data else ""
    cfg = root / f"{name}.toml"
    cfg.write_text(f"""
[run]
name = "{name}"
out_dir = "{root / 'runs'}"
steps = {args.steps}
log_every = 1
seed = {args.seed}
[model]
kind = "gpt-moe"
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
experts = 8
top_k = 2
moe_every = 2
dropless = true
aux_loss_coef = {aux}
z_loss_coef = 0.001
[data]
{data}
[parallel]
nproc = {ep}
ep = {ep}
[train]
global_batch = 16
micro_batch = {16 // ep}
lr = 2e-3
min_lr = 2e-4
warmup_steps = 20
[checkpoint]
every = 0
""")
    if podscale_main(["train", str(cfg), "--fresh"]) != 0:
        raise SystemExit(f"the run {name} failed")
    rows = (root / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["task"] for line in rows]


def peaks(steps: list[dict]) -> list[float]:
    return [v for t in steps for k, v in t.items() if k.endswith("/peak_rank_load")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--aux", type=float, nargs="+", default=[0.01, 0.0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--skip", type=int, default=20, help="early steps reported apart (the router is untrained)")
    ap.add_argument("--data", default=None, help="a text file (default: the embedded corpus)")
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args()
    base = replace(get_model("moe-1.3b-64e"), dropless=True)
    print(f"GPT-MoE 4 x 128, 8 experts top-2 every other block, dropless; {args.steps} steps, global batch 16 x 128")
    print(f"{'ep':>3} {'aux':>6} {'first ' + str(args.skip) + ' steps max':>18} {'median':>8} {'p95':>6} {'max':>6}"
          f"   planner: activations GiB/device at 2.0 / at max")
    with tempfile.TemporaryDirectory() as tmp:
        for ep in args.ep:
            for aux in args.aux:
                steps = run(ep, aux, args, Path(tmp))
                early, late = peaks(steps[:args.skip]), sorted(peaks(steps[args.skip:]))
                med, p95, top = statistics.median(late), late[int(0.95 * (len(late) - 1))], late[-1]
                mem = [predict("dgx-a100-80g", 64, replace(base, dropless_peak_load=max(load, 1.0)),
                               {"tp": 1, "pp": 1, "dp": 8, "ep": 8, "microbatch": 1},
                               512).memory_breakdown_bytes["activations"] / 2**30 for load in (2.0, top)]
                print(f"{ep:>3} {aux:>6g} {max(early):>18.3f} {med:>8.3f} {p95:>6.3f} {top:>6.3f}"
                      f"   {mem[0]:.1f} / {mem[1]:.1f}", flush=True)


if __name__ == "__main__":
    main()
