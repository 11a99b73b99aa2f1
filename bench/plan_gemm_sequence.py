"""The GEMMs of one GPT layer as `podscale train` issues them, timed on this CPU beside the calibrated table.

Issue 15's open question (b): after `plan calibrate`, the 12-layer 640-wide GPT's GEMM term alone (2.23 s) was
larger than the whole measured step (2.13 s), and the table's entries at n = 2048, k >= 512 (~55 GFLOP/s with
both ranks measuring at once) were half what one process reaches. This script tells the table's error from
the trainer's: it runs a layer's twelve GEMMs (QKV, attention output, MLP in and out; each forward addmm with
the bias and the transposed weight, input gradient dY W, weight gradient dY^T X, as autograd issues them) in
the trainer's order, on ``--ranks`` processes at once with cores/ranks threads each as the trainer runs them
(and on one process with all the cores, for the contention between ranks), ``--rounds`` times, and prints
each GEMM's rate (its 20th-percentile time over the rounds, the calibration's statistic) beside the `local`
table's rate for the same shape (`podscale.plan.compute.gemm_time`, the planner's own lookup).

    python -m podscale.plan calibrate                  # on an idle machine
    python bench/plan_gemm_sequence.py [--hidden 640] [--tokens 512] [--rounds 10]

The table/measured ratio of the layer's sum is what the planner's GEMM term over- or under-prices; a ratio that
differs between the concurrent and the single-process run is contention between the ranks. On a shared machine
the figures are noise; run it idle.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from podscale.plan.calibrate import low_percentile


def layer_gemms(torch, tokens: int, hidden: int) -> list:
    """(label, (m, n, k), fn) of one dense GPT layer's GEMMs, forward then backward, as autograd issues them
    for nn.Linear weights stored (out x in)."""
    ops = []
    for name, n_out, k_in in (("qkv", 3 * hidden, hidden), ("attn_out", hidden, hidden), ("fc", 4 * hidden, hidden),
                              ("proj", hidden, 4 * hidden)):
        w, b = torch.randn(n_out, k_in), torch.randn(n_out)
        x, dy = torch.randn(tokens, k_in), torch.randn(tokens, n_out)
        ops.append((f"{name} fwd", (tokens, n_out, k_in), lambda x=x, w=w, b=b: torch.addmm(b, x, w.t())))
        ops.append((f"{name} dX", (tokens, k_in, n_out), lambda dy=dy, w=w: torch.mm(dy, w)))
        ops.append((f"{name} dW", (n_out, k_in, tokens), lambda dy=dy, x=x: torch.mm(dy.t(), x)))
    return ops


def _worker(rank: int, ranks: int, tokens: int, hidden: int, rounds: int, out: str) -> None:
    import torch
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    ops = layer_gemms(torch, tokens, hidden)
    for _, _, fn in ops:
        fn()
    times = {label: [] for label, _, _ in ops}
    for _ in range(rounds):
        for label, _, fn in ops:
            t0 = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({label: low_percentile(t) for label, t in times.items()}, f)


def run(ranks: int, tokens: int, hidden: int, rounds: int) -> dict:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gemms.json")
        mp.start_processes(_worker, args=(ranks, tokens, hidden, rounds, out), nprocs=ranks, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=640)
    ap.add_argument("--tokens", type=int, default=512, help="micro-batch x sequence (default 4 x 128)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--system", default="local")
    args = ap.parse_args(argv)
    import torch
    from podscale.plan import load_system
    from podscale.plan.compute import gemm_time
    dev = load_system(args.system).device
    shapes = {label: mnk for label, mnk, _ in layer_gemms(torch, args.tokens, args.hidden)}
    together = run(args.ranks, args.tokens, args.hidden, args.rounds)
    alone = run(1, args.tokens, args.hidden, args.rounds)
    print(f"{'GEMM':<14}{'(m, n, k)':<22}{'table':>9}{f'{args.ranks} ranks':>10}{'1 rank':>10}   GFLOP/s")
    sums = [0.0, 0.0, 0.0]
    for label, (m, n, k) in shapes.items():
        flops = 2.0 * m * n * k
        t = (gemm_time(dev, m, n, k, bytes_per_element=dev.dtype_bytes), together[label], alone[label])
        sums = [a + b for a, b in zip(sums, t)]
        print(f"{label:<14}{str((m, n, k)):<22}" + "".join(f"{flops / x / 1e9:>10.1f}" for x in t))
    print(f"layer: table {sums[0] * 1e3:.1f} ms, {args.ranks} ranks {sums[1] * 1e3:.1f} ms, 1 rank with all cores "
          f"{sums[2] * 1e3:.1f} ms; table / {args.ranks} ranks = {sums[0] / sums[1]:.2f} "
          f"(load average {os.getloadavg()[0]:.1f}: figures are final only on an idle machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
