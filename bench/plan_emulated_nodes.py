"""Planner vs. measured across a slow link: `podscale train` on two emulated nodes of one rank each.

`bench/plan_local_vs_train.py` checks the planner against runs whose ranks talk over loopback, where gloo moves
a megabyte in under a millisecond and a layout's bytes barely show. Here the same small cases (its 4 x 128 GPT
and GPT-MoE) run with each rank in a node of its own, the two nodes joined by a link of `--link-mbit` Mbit/s each
way (`bench/emulated_nodes.py`: network namespaces, a bridge, token-bucket rate limits; root only), and the
planner predicts them on the calibrated `local` system given that link between its nodes:

    system = local, one rank a node; inter-node link = the rate one TCP stream measures over the emulated link
             (not fitted to any training run), with the loopback link's calibrated per-message latency and wait

Each case prints the measured step (the low percentile after warm-up, as `plan_local_vs_train.py`), the
prediction and their ratio; the MoE cases run per choice and per rank (`parallel.expert_dispatch`), which send
different bytes. Default link: the rate at which this machine's ranks have the flops per element sent of a DGX
A100's GPUs over their 200 Gbit/s InfiniBand ports (`emulated_nodes.balanced_mbit`, at the calibrated matmul rate).

    python bench/plan_emulated_nodes.py [--link-mbit R] [--steps 16] [--repeat 2] [--only SUBSTRING]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from emulated_nodes import EmulatedNodes, balanced_mbit  # noqa: E402
from plan_local_vs_train import CASES, measured_step, model_of, train_args  # noqa: E402

from podscale.plan import load_system, predict  # noqa: E402
from podscale.plan.auto import as_trained  # noqa: E402
from podscale.plan.hardware import System  # noqa: E402
from podscale.plan.layout import Layout  # noqa: E402
from podscale.runtime.launcher import launch  # noqa: E402

#: the cases of plan_local_vs_train.py small enough for a slow link (the 4-layer, 128-wide models)
SMALL_CASES = [c for c in CASES if "L4 h128" in c[0]]


def emulated_system(local: System, link_bytes_per_s: float) -> System:
    """``local`` with one rank a node and ``link_bytes_per_s`` between nodes (per message: the loopback link's
    calibrated latency and wait, which the emulated link's messages also pay)."""
    inter = dataclasses.replace(local.intra, bandwidth=link_bytes_per_s, efficiency=1.0,
                                reduce_scatter_bandwidth=0.0, all_gather_bandwidth=0.0)
    return dataclasses.replace(local, name="local-emulated-nodes", devices_per_node=1,
                               description=f"{local.description}; one rank a node, nodes linked at "
                                           f"{link_bytes_per_s * 8 / 1e6:.0f} Mbit/s", inter=inter)


def run_on_nodes(net: EmulatedNodes, case, steps: int, out: Path, name: str) -> float:
    """One case's `podscale train` run with each of its 2 ranks on its own emulated node -> its step time."""
    _, ov, gb, mb, lay, zero = case
    worker = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "emulated_nodes.py"), net.tag,
              str(net.nodes), "1", "-m", "podscale.cli", *train_args(ov, gb, mb, lay, zero, steps, out, name)]
    launch(sys.executable, worker, nproc=2, host=net.host_address, quiet=True,
           log_dir=str(out / f"{name}-logs"))
    return measured_step(out, name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--link-mbit", type=float, default=None,
                    help="the link between the nodes (default: a DGX A100's flops per element sent, scaled)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2, help="runs per case; the fastest counts")
    ap.add_argument("--only", default="", help="only the cases whose label contains this")
    a = ap.parse_args(argv)
    local = load_system("local")
    mbit = a.link_mbit or balanced_mbit("dgx-a100", local.device.peak_flops / 1e9, 1)
    start = time.perf_counter()
    rows = []
    with EmulatedNodes(2, mbit) as net, tempfile.TemporaryDirectory() as tmp:
        measured_mbit = min(net.measure_mbit(0, 1), net.measure_mbit(1, 0))
        system = emulated_system(local, measured_mbit * 1e6 / 8)
        print(f"link set to {mbit:.0f} Mbit/s, measured {measured_mbit:.0f} Mbit/s; system: {system.description}")
        print(f"{'layout (2 ranks, one a node)':<40}{'measured s':>12}{'predicted s':>13}{'pred/meas':>11}")
        for i, case in enumerate(SMALL_CASES):
            label, ov, gb, mb, lay, zero = case
            if a.only not in label:
                continue
            measured = min(run_on_nodes(net, case, a.steps, Path(tmp), f"case{i}-{r}") for r in range(a.repeat))
            pred = predict(system, 2, model_of(ov), as_trained(Layout(**lay, microbatch=mb, zero_stage=zero)), gb)
            rows.append((label, measured, pred.step_time_s))
            print(f"{label:<40}{measured:>12.4f}{pred.step_time_s:>13.4f}{pred.step_time_s / measured:>11.2f}",
                  flush=True)
    worst = max(abs(p / m - 1) for _, m, p in rows)
    print(f"max |predicted/measured - 1| = {worst:.0%} ({len(rows)} layouts, {time.perf_counter() - start:.0f} s; "
          f"load average {os.getloadavg()[0]:.1f} at the end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
