"""One MoE layer alone in one process: forward + backward time and the minor page faults a step takes.

A CPU step allocates its expert gradients afresh (the previous step's were freed by `zero_grad`), and glibc
returns large freed blocks to the OS, so fresh memory is faulted in again page by page. This prints, per step,
the median time and the minor faults (`getrusage`), and the share of the time spent in the expert kernel, for
the checkout it runs from; compare two commits by running it from a worktree of each, alternately.

`--rows-per-expert R ...` instead times the experts alone (forward + backward through the kernel, every expert
given R rows, the sizes taking turns) and fits the line `fixed + per row`: what an expert costs before any row
(on a CPU, streaming its weights in and its gradients out) and what each row adds.

    python bench/moe_alloc.py [--experts 32] [--tokens 950] [--top-k 1] [--steps 40]
    python bench/moe_alloc.py --rows-per-expert 1 5 10 20 30 40 [--experts 32]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from moe_time_split import SPENT, TimedKernel  # noqa: E402  (the CPU kernel, its calls timed into SPENT)

from podscale.parallel.moe import MoELayer  # noqa: E402
from podscale.parallel.moe.kernels import CacheTiledKernel  # noqa: E402


def per_expert_fit(a) -> dict:
    """The experts alone at each of ``a.rows_per_expert`` rows an expert; the least-squares line through the
    medians."""
    from podscale.parallel.moe.layer import Experts
    experts = Experts(a.d_model, a.d_hidden, a.experts, kernel=CacheTiledKernel())
    data = {r: (torch.randn(a.experts * r, a.d_model, requires_grad=True), torch.randn(a.experts * r, a.d_model))
            for r in a.rows_per_expert}
    times = {r: [] for r in a.rows_per_expert}
    for step in range(a.steps + 3):
        for r, (x, gy) in data.items():
            experts.zero_grad(set_to_none=True)
            x.grad = None
            t0 = time.perf_counter()
            (experts(x, [(j, r) for j in range(a.experts)]) * gy).sum().backward()
            if step >= 3:
                times[r].append(time.perf_counter() - t0)
    med = {r: 1e3 * statistics.median(t) for r, t in times.items()}
    rows = [a.experts * r for r in med]
    fit = torch.linalg.lstsq(torch.tensor([[1.0, m] for m in rows], dtype=torch.float64),
                             torch.tensor(list(med.values()), dtype=torch.float64).unsqueeze(1)).solution.squeeze(1)
    fixed_ms, per_row_ms = float(fit[0]), float(fit[1])
    print(f"{a.experts} experts, forward + backward: " + ", ".join(f"{r} rows each {m:.2f} ms" for r, m in med.items()))
    print(f"fit: {fixed_ms:.2f} ms + {1e3 * per_row_ms:.2f} us a row ({1e3 * fixed_ms / a.experts:.0f} us an expert "
          "before any row)")
    return {"medians_ms": med, "fixed_ms": fixed_ms, "per_row_us": 1e3 * per_row_ms}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=950)
    ap.add_argument("--top-k", type=int, default=1)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-hidden", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rows-per-expert", type=int, nargs="+", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(1)
    if a.rows_per_expert:
        return per_expert_fit(a)
    kernel = TimedKernel()
    layer = MoELayer(a.d_model, a.d_hidden, a.experts, top_k=a.top_k, capacity_factor=1.25, random_routing=False,
                     kernel=kernel)
    with torch.no_grad():       # bench/moe.py's uneven router
        layer.router.weight.normal_(0.0, 0.1)
    x = torch.randn(1, a.tokens, a.d_model, requires_grad=True)
    gy = torch.randn(1, a.tokens, a.d_model)
    times, faults, kernel_times = [], [], []
    for step in range(a.steps + 5):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        SPENT.clear()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        (layer(x)[0] * gy).sum().backward()
        if step >= 5:    # the first steps warm up
            times.append(time.perf_counter() - t0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            kernel_times.append(SPENT["experts"])
    res = {"step_ms": 1e3 * statistics.median(times), "kernel_ms": 1e3 * statistics.median(kernel_times),
           "faults_median": statistics.median(faults), "faults_mean": statistics.fmean(faults)}
    print(f"E={a.experts} tokens={a.tokens} k={a.top_k}: step {res['step_ms']:.2f} ms (expert kernel "
          f"{res['kernel_ms']:.2f}), minor faults a step: median {res['faults_median']:.0f}, mean "
          f"{res['faults_mean']:.0f}")
    return res


if __name__ == "__main__":
    main()
