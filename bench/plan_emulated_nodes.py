"""Planner vs. measured across a slow link: `podscale train` on emulated nodes (two of one rank each by default).

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
A100's GPUs over their 200 Gbit/s InfiniBand ports (`emulated_nodes.balanced_mbit`, at the calibrated matmul rate,
times the ranks a node).

`--nproc 4 --ranks-per-node 2`: two nodes of two ranks, 4 ranks on this machine's cores, with the GPT-MoE at ep 4
per choice, per rank and per node, and the dense GPT at dp 4. The planner then needs a calibration of 4 ranks
at once (`python -m podscale.plan calibrate --ranks 4 --out FILE`, then `--system FILE`).

    python bench/plan_emulated_nodes.py [--link-mbit R] [--steps 16] [--repeat 2] [--only SUBSTRING]
    python bench/plan_emulated_nodes.py --nproc 4 --ranks-per-node 2 --system FILE [...]
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
from plan_local_vs_train import CASES, MOE, SMALL, measured_step, model_of, train_args  # noqa: E402

from podscale.plan import load_system, predict  # noqa: E402
from podscale.plan.auto import as_trained  # noqa: E402
from podscale.plan.hardware import System, load_system_file  # noqa: E402
from podscale.plan.layout import Layout  # noqa: E402
from podscale.runtime.launcher import launch  # noqa: E402

#: the cases of plan_local_vs_train.py small enough for a slow link (the 4-layer, 128-wide models)
SMALL_CASES = [c for c in CASES if "L4 h128" in c[0]]
#: 4 ranks, two nodes of two: (label, model overrides, global batch, micro batch, layout, ZeRO stage)
FOUR_RANK_CASES = [
    ("dp4 L4 h128 mb4", SMALL, 16, 4, dict(tp=1, pp=1, dp=4), 0),
    ("moe ep4 L4 h128 E8 mb4", MOE, 16, 4, dict(tp=1, pp=1, dp=1, ep=4), 0),
    ("moe ep4 L4 h128 E8 mb4 per rank", MOE, 16, 4, dict(tp=1, pp=1, dp=1, ep=4, expert_dispatch="rank"), 0),
    ("moe ep4 L4 h128 E8 mb4 per node", MOE, 16, 4, dict(tp=1, pp=1, dp=1, ep=4, expert_dispatch="node"), 0),
]


def emulated_system(local: System, link_bytes_per_s: float, ranks_per_node: int = 1, devices: int = 2) -> System:
    """``local`` with ``ranks_per_node`` ranks a node and ``link_bytes_per_s`` a node between nodes, each rank's
    share of it ``1 / ranks_per_node`` (per message: the loopback link's calibrated latency and wait, which the
    emulated link's messages also pay)."""
    inter = dataclasses.replace(local.intra, bandwidth=link_bytes_per_s / ranks_per_node, efficiency=1.0,
                                reduce_scatter_bandwidth=0.0, all_gather_bandwidth=0.0)
    return dataclasses.replace(local, name="local-emulated-nodes", devices_per_node=ranks_per_node,
                               max_devices=devices,
                               description=f"{local.description}; {ranks_per_node} rank(s) a node, nodes linked "
                                           f"at {link_bytes_per_s * 8 / 1e6:.0f} Mbit/s", inter=inter)


def run_on_nodes(net: EmulatedNodes, case, steps: int, out: Path, name: str, ranks_per_node: int) -> float:
    """One case's `podscale train` run with its ranks on the emulated nodes, ``ranks_per_node`` a node -> its
    step time."""
    _, ov, gb, mb, lay, zero = case
    nproc = net.nodes * ranks_per_node
    worker = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "emulated_nodes.py"), net.tag,
              str(net.nodes), str(ranks_per_node), "-m", "podscale.cli",
              *train_args(ov, gb, mb, lay, zero, steps, out, name, nproc=nproc)]
    launch(sys.executable, worker, nproc=nproc, host=net.host_address, quiet=True,
           log_dir=str(out / f"{name}-logs"))
    return measured_step(out, name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--link-mbit", type=float, default=None,
                    help="the link between the nodes (default: a DGX A100's flops per element sent, scaled)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2, help="runs per case; the fastest counts")
    ap.add_argument("--only", default="", help="only the cases whose label contains this")
    ap.add_argument("--nproc", type=int, choices=(2, 4), default=2)
    ap.add_argument("--ranks-per-node", type=int, default=1, help="with --nproc 4: 2")
    ap.add_argument("--system", default=None, help="the calibrated system file (default: local; --nproc 4 needs a "
                                                   "calibration of 4 ranks)")
    a = ap.parse_args(argv)
    if a.nproc % a.ranks_per_node or a.nproc // a.ranks_per_node < 2:
        raise SystemExit(f"--nproc {a.nproc} does not split into 2 or more nodes of --ranks-per-node "
                         f"{a.ranks_per_node}")
    local = load_system_file(a.system) if a.system else load_system("local")
    calibrated = local.extra.get("calibration", {}).get("ranks")
    if calibrated != a.nproc:
        raise SystemExit(f"{local.source or 'local'} was calibrated with {calibrated} ranks, not {a.nproc}: run "
                         f"`python -m podscale.plan calibrate --ranks {a.nproc} --out FILE` and pass --system FILE")
    mbit = a.link_mbit or balanced_mbit("dgx-a100", local.device.peak_flops / 1e9, a.ranks_per_node)
    cases = SMALL_CASES if a.nproc == 2 else FOUR_RANK_CASES
    start = time.perf_counter()
    rows = []
    with EmulatedNodes(a.nproc // a.ranks_per_node, mbit) as net, tempfile.TemporaryDirectory() as tmp:
        measured_mbit = min(net.measure_mbit(0, 1), net.measure_mbit(1, 0))
        system = emulated_system(local, measured_mbit * 1e6 / 8, a.ranks_per_node, a.nproc)
        print(f"link set to {mbit:.0f} Mbit/s, measured {measured_mbit:.0f} Mbit/s; system: {system.description}")
        print(f"{f'layout ({a.nproc} ranks, {a.ranks_per_node} a node)':<40}{'measured s':>12}{'predicted s':>13}"
              f"{'pred/meas':>11}")
        for i, case in enumerate(cases):
            label, ov, gb, mb, lay, zero = case
            if a.only not in label:
                continue
            measured = min(run_on_nodes(net, case, a.steps, Path(tmp), f"case{i}-{r}", a.ranks_per_node)
                           for r in range(a.repeat))
            pred = predict(system, a.nproc, model_of(ov), as_trained(Layout(**lay, microbatch=mb, zero_stage=zero)),
                           gb)
            rows.append((label, measured, pred.step_time_s))
            print(f"{label:<40}{measured:>12.4f}{pred.step_time_s:>13.4f}{pred.step_time_s / measured:>11.2f}",
                  flush=True)
    worst = max(abs(p / m - 1) for _, m, p in rows)
    print(f"max |predicted/measured - 1| = {worst:.0%} ({len(rows)} layouts, {time.perf_counter() - start:.0f} s; "
          f"load average {os.getloadavg()[0]:.1f} at the end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
