"""Time of one device's kernels: matrix multiplies by shape, and memory-bound element-wise work.

A GEMM of (m x k) @ (k x n) in 16-bit does 2mkn FLOPs and moves at least 2(mk + kn + mn) bytes. Its
time is the roofline bound (Williams, Waterman, Patterson, "Roofline", CACM 2009)

    T = max( 2mkn / (peak * e_mm),  2(mk + kn + mn) / (B_mem * e_mem) )

so large transformer GEMMs run at the achievable fraction e_mm of peak while the attention GEMMs,
whose inner dimension is the head size (64-160), become bandwidth-bound: that is the "achieved
matmul efficiency as a function of shape". On a calibrated machine (``local``) the measured FLOP/s
of the nearest measured shape (in log space) replaces peak * e_mm.

Element-wise kernels (layer norm, bias + GeLU, softmax, dropout, residual adds) are pure memory
traffic: T = bytes / (B_mem * e_mem).
"""
from __future__ import annotations

import math

from .hardware import Device


def _table_flops(device: Device, m: float, n: float, k: float) -> float:
    """FLOP/s at shape (m, n, k) from the measured table: inverse-distance weighting, in log space, of
    the seconds-per-FLOP of the 4 nearest measured shapes (an exact match returns its own rate)."""
    lm, ln, lk = math.log(m), math.log(n), math.log(k)
    near = sorted(((math.log(tm) - lm) ** 2 + (math.log(tn) - ln) ** 2 + (math.log(tk) - lk) ** 2, f)
                  for tm, tn, tk, f in device.matmul_table)[:4]
    if near[0][0] < 1e-12:
        return near[0][1]
    weights = [1.0 / d for d, _ in near]
    sec_per_flop = sum(w / f for w, (_, f) in zip(weights, near)) / sum(weights)
    return 1.0 / sec_per_flop


def gemm_time(device: Device, m: float, n: float, k: float, batch: float = 1.0,
              bytes_per_element: int = 2) -> float:
    """Seconds for ``batch`` independent (m x k) @ (k x n) products on one device."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    flops = 2.0 * m * n * k * batch
    if device.matmul_table:
        rate = _table_flops(device, m, n, k)
    else:
        rate = device.peak_flops * device.matmul_efficiency
    traffic = bytes_per_element * (m * k + k * n + m * n) * batch
    return max(flops / rate, traffic / (device.memory_bw * device.memory_efficiency))


def stream_time(device: Device, nbytes: float) -> float:
    """Seconds to stream ``nbytes`` through device memory (element-wise kernels, optimizer step)."""
    bw = device.elementwise_bw or device.memory_bw * device.memory_efficiency
    return nbytes / bw


def linear_time(device: Device, tokens: float, n_out: float, k_in: float, batch: float = 1.0,
                bytes_per_element: int = 2) -> tuple[float, float]:
    """(forward, backward) seconds of a linear layer y = x W on ``tokens`` rows: forward (T x k)(k x n);
    backward the input gradient (T x n)(n x k) and the weight gradient (k x T)(T x n), whose shapes
    differ from the forward's (matters on calibrated CPUs; the roofline is symmetric in them)."""
    e = bytes_per_element
    fwd = gemm_time(device, tokens, n_out, k_in, batch, e)
    bwd = gemm_time(device, tokens, k_in, n_out, batch, e) + gemm_time(device, k_in, n_out, tokens, batch, e)
    return fwd, bwd
