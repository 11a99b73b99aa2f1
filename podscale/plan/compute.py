"""Time of one device's kernels: matrix multiplies by shape, and memory-bound element-wise work.

A GEMM of (m x k) @ (k x n) in 16-bit does 2mkn FLOPs and moves at least 2(mk + kn + mn) bytes. Its
time is the roofline bound (Williams, Waterman, Patterson, "Roofline", CACM 2009) with the arithmetic
side quantised as a GPU runs it (the tile and wave quantisation of NVIDIA's "Matrix Multiplication
Background" guide, as Calculon (Isaev et al. SC'23) and vTrain (Bang et al. MICRO'24) model it):

    T = max( T_tiles,  2(mk + kn + mn) / (B_mem * e_mem) )
    T_tiles = min over tiles (tm x tn) of  waves * 2 tm tn (ceil(k / tk) tk + k0) / (F_sm * e_mm * e_tile)
    waves   = ceil( ceil(m/tm) ceil(n/tn) batch / SMs ),   F_sm = peak / SMs
    e_tile  = min(1, (tm tn / (tm + tn)) / (F_sm / B_L2,sm))     (operand loads of a tile per FLOP vs
                                                               what an SM's share of L2 can feed)

Every tile computes a full tm x tn x k block however little of it is inside the matrix (tile
quantisation), the last wave may leave SMs idle (wave quantisation), and each tile pays a fill and
drain of its software pipeline, ``k0`` in units of k (which is why GEMMs with a long inner dimension,
those of large models, run closer to peak). SM count and L2 bandwidth are datasheet numbers; the
achievable fraction e_mm of the tensor-core peak and k0 are the system's GEMM parameters. Without
``sm_count`` a system uses the plain roofline with peak * e_mm. On a calibrated machine (``local``)
the measured FLOP/s of the nearest measured shape (in log space) replaces the arithmetic side.

Element-wise kernels (layer norm, bias + GeLU, softmax, dropout, residual adds) are pure memory
traffic: T = bytes / (B_mem * e_mem); so are an MoE layer's routing, dispatch and combine (sorting, counting
and indexing over the tokens' choices and rows), each at its own measured rate on a calibrated CPU.
"""
from __future__ import annotations

import math
from functools import lru_cache

from .hardware import Device


def _log_interpolated(rows, point) -> tuple:
    """Rates at ``point`` from measured rows (coordinates..., rate, rate, ...) with ``len(point)``
    coordinates: inverse-distance weighting, in log space, of the seconds-per-FLOP of the 4 nearest rows
    (an exact match returns its own rates)."""
    logs = [math.log(x) for x in point]
    nd = len(point)
    near = sorted((sum((math.log(r[i]) - logs[i]) ** 2 for i in range(nd)), r[nd:]) for r in rows)[:4]
    if near[0][0] < 1e-12:
        return tuple(near[0][1])
    weights = [1.0 / d for d, _ in near]
    return tuple(sum(weights) / sum(w / rates[j] for w, (_, rates) in zip(weights, near))
                 for j in range(len(near[0][1])))


def _table_flops(device: Device, m: float, n: float, k: float) -> float:
    """FLOP/s at shape (m, n, k) from the measured table (:func:`_log_interpolated`)."""
    return _log_interpolated(device.matmul_table, (m, n, k))[0]


def tile_efficiency(device: Device, tm: int, tn: int) -> float:
    """Fraction of an SM's achievable rate a tm x tn tile sustains when its operand loads
    (tm + tn bytes-pairs per k step for 2 tm tn FLOPs) are fed from the SM's share of L2 bandwidth."""
    if not device.l2_bw:
        return 1.0
    need = device.peak_flops / device.l2_bw          # FLOP per byte of operands an SM must reach
    return min(1.0, (tm * tn / (tm + tn)) / need)


def tiled_gemm_time(device: Device, m: float, n: float, k: float, batch: float = 1.0,
                    e_mm: float | None = None, k0: float | None = None) -> float:
    """The arithmetic side of a GEMM with tile and wave quantisation (module docstring)."""
    e_mm = device.matmul_efficiency if e_mm is None else e_mm
    k0 = device.gemm_tile_overhead_k if k0 is None else k0
    return _tiled(device, float(m), float(n), float(k), float(batch), e_mm, k0)


@lru_cache(maxsize=65536)
def _tiled(device: Device, m: float, n: float, k: float, batch: float, e_mm: float, k0: float) -> float:
    sms, tk = device.sm_count, device.gemm_tile_k
    per_sm = device.peak_flops / sms * e_mm
    k_work = math.ceil(k / tk) * tk + k0
    best = math.inf
    for tm, tn in device.gemm_tiles:
        for a, c in ((tm, tn), (tn, tm)):                 # either orientation of the output tile
            waves = math.ceil(math.ceil(m / a) * math.ceil(n / c) * batch / sms)
            best = min(best, waves * 2.0 * a * c * k_work / (per_sm * tile_efficiency(device, a, c)))
    return best


def gemm_rate(device: Device, m: float, n: float, k: float, batch: float = 1.0) -> float:
    """FLOP/s of the arithmetic side of a GEMM (the measured table, the tile model, or peak * e_mm)."""
    flops = 2.0 * m * n * k * batch
    if device.matmul_table:
        return _table_flops(device, m, n, k)
    if device.sm_count:
        return flops / tiled_gemm_time(device, m, n, k, batch)
    return device.peak_flops * device.matmul_efficiency


def gemm_time(device: Device, m: float, n: float, k: float, batch: float = 1.0,
              bytes_per_element: int = 2) -> float:
    """Seconds for ``batch`` independent (m x k) @ (k x n) products on one device."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    arith = 2.0 * m * n * k * batch / gemm_rate(device, m, n, k, batch)
    traffic = bytes_per_element * (m * k + k * n + m * n) * batch
    return max(arith, traffic / (device.memory_bw * device.memory_efficiency))


def attention_time(device: Device, seq: float, head_dim: float, heads: float) -> tuple[float, float] | None:
    """(forward, backward) seconds of a fused causal attention kernel over ``heads`` (batch x heads) of
    ``seq`` x ``head_dim`` from the measured attention table, or None where none was measured (the caller
    then prices its GEMMs and softmax). A CPU's fused attention (torch's flash-attention loop) runs far
    below its matmul rate: its blocks are small GEMMs with a softmax between them, and its backward
    recomputes the scores, so the table is measured on the kernel itself (``plan calibrate``)."""
    if not device.attention_table:
        return None
    fwd_rate, bwd_rate = _log_interpolated(device.attention_table, (seq, head_dim))
    flops = 2.0 * seq * seq * head_dim * heads       # QK^T and PV on the unmasked half of the s x s scores
    return flops / fwd_rate, flops / bwd_rate


def stream_time(device: Device, nbytes: float) -> float:
    """Seconds to stream ``nbytes`` through device memory (element-wise kernels, optimizer step)."""
    bw = device.elementwise_bw or device.memory_bw * device.memory_efficiency
    return nbytes / bw


def elementwise_time(device: Device, nbytes: float, activation_bytes: float) -> float:
    """Seconds of a layer's element-wise kernels moving ``nbytes`` whose activations (one tokens x hidden
    tensor) are ``activation_bytes``: at the rate measured for that activation size (``elementwise_table``,
    log-log linear between the two measured sizes around it, the end rates beyond them), else
    :func:`stream_time`. On a CPU these kernels run faster while the activations they pass between them
    stay in a core's cache, so one rate measured at one size misprices smaller and larger micro-batches."""
    if not device.elementwise_table:
        return stream_time(device, nbytes)
    return nbytes / _rate_at(device.elementwise_table, activation_bytes)


def routing_time(device: Device, nbytes: float, size_bytes: float) -> float:
    """Seconds of an MoE layer's routing, dispatch and combine kernels moving ``nbytes`` (a pass of them; the
    layer's forward and backward together move ``size_bytes``, the size the rate is read at): at the rate
    ``plan calibrate`` measured for them in the layer itself, its bookkeeping between them included
    (``routing_table``, log-log linear between the measured sizes, the end rates beyond them), else
    :func:`stream_time`. On a CPU they are many small sorting, counting and indexing kernels whose cost per
    byte falls with their size."""
    if not device.routing_table:
        return stream_time(device, nbytes)
    return nbytes / _rate_at(device.routing_table, size_bytes)


def _rate_at(rows, size: float) -> float:
    """The rate of measured ``rows`` (size, rate) at ``size``: log-log linear between the two measured sizes
    around it, the end rates beyond them."""
    table = sorted(rows)
    x = math.log(max(size, 1.0))
    if x <= math.log(table[0][0]) or len(table) == 1:
        return table[0][1]
    if x >= math.log(table[-1][0]):
        return table[-1][1]
    for (a0, r0), (a1, r1) in zip(table, table[1:]):
        if x <= math.log(a1):
            w = (x - math.log(a0)) / (math.log(a1) - math.log(a0))
            return math.exp((1 - w) * math.log(r0) + w * math.log(r1))
    raise AssertionError("unreachable")


def weight_grad_time(device: Device, tokens: float, n_out: float, k_in: float, batch: float = 1.0,
                     bytes_per_element: int = 2) -> float:
    """Seconds of a linear layer's weight gradient as autograd issues it for a weight stored (out x in),
    as torch's nn.Linear stores it: dW = dY^T X, an (n_out x tokens) @ (tokens x k_in) product, so m is the
    output width and n the input width. A roofline is symmetric in m and n; a CPU's measured rates are not
    (in one profiled step of a 640-wide GPT, under load, its MLP's two weight gradients, the same FLOPs with
    m and n swapped, took 0.58 s and 0.88 s), so the table is read at the shape the trainer runs."""
    return gemm_time(device, n_out, k_in, tokens, batch, bytes_per_element)


def linear_time(device: Device, tokens: float, n_out: float, k_in: float, batch: float = 1.0,
                bytes_per_element: int = 2) -> tuple[float, float]:
    """(forward, backward) seconds of a linear layer y = x W^T on ``tokens`` rows: forward (T x k)(k x n);
    backward the input gradient (T x n)(n x k) and the weight gradient (:func:`weight_grad_time`), whose
    shapes differ from the forward's (matters on calibrated CPUs; the roofline is symmetric in them)."""
    e = bytes_per_element
    fwd = gemm_time(device, tokens, n_out, k_in, batch, e)
    bwd = gemm_time(device, tokens, k_in, n_out, batch, e) + weight_grad_time(device, tokens, n_out, k_in, batch, e)
    return fwd, bwd


def optimizer_time(device: Device, nbytes: float) -> float:
    """Seconds of the optimizer step's ``nbytes`` of traffic at its measured rate (a fused AdamW streams
    its state at close to the copy bandwidth, well above the rate of the compute-bound element-wise
    kernels of a CPU), else at the device's memory bandwidth."""
    return nbytes / (device.optimizer_bw or device.memory_bw * device.memory_efficiency)


def grad_pass_time(device: Device, nbytes: float) -> float:
    """Seconds of the per-step passes over the gradients (global norm, clipping, zeroing) at their
    measured rate, else at the device's memory bandwidth."""
    return nbytes / (device.grad_pass_bw or device.memory_bw * device.memory_efficiency)


def overlapped_exposed(device: Device, comm: float, window: float) -> float:
    """What a collective of ``comm`` seconds overlapped with ``window`` seconds of compute adds to the
    step: at least what the window does not cover, and at least the measured ``overlap_exposed``
    fraction of its own time (its work competes with the compute for a CPU's cores)."""
    return max(comm - window, device.overlap_exposed * comm, 0.0)
