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
    best, best_d = None, math.inf
    lm, ln, lk = math.log(m), math.log(n), math.log(k)
    for tm, tn, tk, f in device.matmul_table:
        d = (math.log(tm) - lm) ** 2 + (math.log(tn) - ln) ** 2 + (math.log(tk) - lk) ** 2
        if d < best_d:
            best, best_d = f, d
    return best


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
    return nbytes / (device.memory_bw * device.memory_efficiency)
