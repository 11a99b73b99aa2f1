"""Optimizer step over N fp32 parameters: podscale's flat AdamW vs torch's fused AdamW over per-tensor
parameters (and DeepSpeedCPUAdam when DeepSpeed is importable), against the machine's memory-bandwidth
roofline (an Adam step moves 28 bytes per parameter: read param, grad, m, v; write param, m, v).

    python bench/adam.py --params 100e6 [--repeat 5] [--device cuda]

Prints step times (best of ``--repeat``), the ratios and the fraction of the roofline reached.  Roofline bandwidth is
measured here with an in-place ``a += b`` over arrays of the same size (12 bytes per element, best of
the repeats).
"""
from __future__ import annotations

import argparse
import time

import torch

from podscale.optim.flat_adam import FlatAdamW, Segment


DEVICE = torch.device("cpu")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def timeit(fn, repeat: int) -> float:
    fn()  # warm-up (first-touch of the moments)
    ts = []
    for _ in range(repeat):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        ts.append(time.perf_counter() - t0)
    return min(ts)  # best of: the machine is shared, and interference only ever adds time


def bandwidth(n: int, repeat: int) -> float:
    """In-place ``a += b`` (read a, b; write a: 12 bytes per element, no write-allocate traffic — in place,
    like the Adam update), best of ``repeat``."""
    a, b = torch.rand(n, device=DEVICE), torch.rand(n, device=DEVICE)
    return 12 * n / timeit(lambda: a.add_(b, alpha=1e-9), repeat)


def per_tensor_shapes(n: int, width: int = 1024) -> list[tuple[int, ...]]:
    """A GPT-like mix: matrices of width x 4width and width x width plus vectors, totalling ~n."""
    shapes, total = [], 0
    while total < n:
        for s in ((width, 3 * width), (3 * width,), (width, width), (width,), (4 * width, width),
                  (4 * width,), (width, 4 * width), (width,), (width,), (width,)):
            shapes.append(s)
            total += torch.Size(s).numel()
    return shapes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (DeepSpeedCPUAdam runs on the CPU only)")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    n = int(args.params)
    where = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"{n / 1e6:.0f}M fp32 parameters, {where}")
    bw = bandwidth(n, args.repeat)
    roof = 28 * n / bw
    results = {}

    # podscale: one flat shard, two segments (decay / no decay) as ZeRO's step sees it
    p, g = torch.rand(n, device=DEVICE), torch.rand(n, device=DEVICE) * 1e-3
    m, v = torch.zeros(n, device=DEVICE), torch.zeros(n, device=DEVICE)
    cut = int(n * 0.99)
    segs = [Segment(p[:cut], g[:cut], m[:cut], v[:cut], 0.1, torch.zeros((), device=DEVICE)),
            Segment(p[cut:], g[cut:], m[cut:], v[cut:], 0.0, torch.zeros((), device=DEVICE))]
    opt = FlatAdamW([segs], (0.9, 0.95), 1e-8)
    results["podscale FlatAdamW"] = timeit(lambda: opt.step(1e-4), args.repeat)
    del p, g, m, v, segs, opt

    # torch.optim.AdamW(fused=True) over per-tensor parameters (what DDP/FSDP users step)
    params = [torch.nn.Parameter(torch.rand(s, device=DEVICE)) for s in per_tensor_shapes(n)]
    for q in params:
        q.grad = torch.rand_like(q) * 1e-3
    tot = sum(q.numel() for q in params)
    topt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    results["torch AdamW fused"] = timeit(topt.step, args.repeat) * n / tot
    del params, topt

    try:
        if DEVICE.type != "cpu":
            raise RuntimeError("DeepSpeedCPUAdam steps CPU tensors only")
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        params = [torch.nn.Parameter(torch.rand(n))]
        params[0].grad = torch.rand(n) * 1e-3
        dopt = DeepSpeedCPUAdam(params, lr=1e-4, weight_decay=0.1, adamw_mode=True)
        results["DeepSpeedCPUAdam"] = timeit(dopt.step, args.repeat)
        del params, dopt
    except Exception as err:  # not installed, or its C++ op cannot build here
        print(f"DeepSpeedCPUAdam: not run ({type(err).__name__}: {str(err).splitlines()[0][:100]})")

    print(f"memory bandwidth (in-place add, 12 B/elem): {bw / 1e9:.2f} GB/s -> Adam roofline {roof * 1e3:.1f} ms")
    for k, t in results.items():
        print(f"{k:22s} {t * 1e3:8.1f} ms   {28 * n / t / 1e9:6.2f} GB/s   {roof / t:5.0%} of roofline")
    ours = results["podscale FlatAdamW"]
    peers = {k: t for k, t in results.items() if not k.startswith("podscale")}
    best = min(peers, key=peers.get)
    print(f"speed vs fastest peer ({best}): {peers[best] / ours:.2f}x;  roofline fraction {roof / ours:.0%}")


if __name__ == "__main__":
    main()
