"""Local calibration measured as the trainer runs (issue 15): the GEMM grid in whole passes, each shape its
median pass, so a slow spell of a shared machine does not make one micro-batch size look dearer than another; and
the element-wise rate by activation size, interpolated by the layer's own activations."""
import math
import tomllib

import pytest

from podscale.plan import predict
from podscale.plan.auto import as_trained
from podscale.plan.calibrate import gemm_table_from_passes, system_toml
from podscale.plan.compute import elementwise_time, stream_time
from podscale.plan.gpt_cost import layer_elementwise_bytes
from podscale.plan.hardware import system_from_dict
from podscale.plan.layout import Layout
from podscale.plan.models import GPT

MODEL = GPT(layers=4, hidden=128, heads=4, seq=128, vocab=256)
SHAPES = [(m, n, k) for m in (64, 256, 1024, 4096) for n in (32, 128, 512) for k in (32, 128, 512)]
RATE = 1e11


def _system(matmul, elementwise=()):
    alpha, bw, n = 50e-6, 2e9, 2
    samples = [(s, 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bw) for s in (1 << 12, 1 << 16, 1 << 20, 1 << 24)]
    data = {"matmul": matmul, "memory_bw": 1e10, "elementwise_bw": 4e9, "elementwise": list(elementwise),
            "kernel_overhead": 5e-6, "allreduce": samples, "threads": 1, "nvme_bw": 1e9,
            "optimizer_bw": 8e9, "grad_pass_bw": 6e9}
    return system_from_dict(tomllib.loads(system_toml(data, n, quick=True)))


def _seconds(slow_m=None, factor=2.0):
    """One pass's seconds at RATE everywhere, ``factor`` x slower on the shapes with m == slow_m."""
    return [2.0 * m * n * k / RATE * (factor if m == slow_m else 1.0) for m, n, k in SHAPES]


def _gemm_ratio(system) -> float:
    """GEMM seconds of a step in two micro-batches of 4 over those of one micro-batch of 8 (same FLOPs)."""
    mb = {b: predict(system, 2, MODEL, as_trained(Layout(dp=2, microbatch=b)), 16).components_s["gemm"]
          for b in (4, 8)}
    return mb[4] / mb[8]


def test_each_gemm_shape_keeps_its_median_pass():
    """A slow spell hitting the m = 256 shapes in one pass made a micro-batch of 4 sequences (512 tokens,
    between the m = 256 and 1024 rows) look dearer than one of 8; the median of three passes, the spell in
    another part of the grid in the second and none in the third, prices them alike, as a machine without the
    spell runs them; and a shape that runs faster in only one pass keeps its usual rate (not the best)."""
    one_pass = gemm_table_from_passes(SHAPES, [_seconds(slow_m=256)])
    three = gemm_table_from_passes(SHAPES, [_seconds(slow_m=256), _seconds(slow_m=4096), _seconds()])
    assert [r[:3] for r in three] == [list(s) for s in SHAPES]
    assert all(r[3] == pytest.approx(RATE) for r in three)
    assert _gemm_ratio(_system(one_pass)) > 1.2
    assert _gemm_ratio(_system(three)) == pytest.approx(1.0, abs=0.01)
    lucky = gemm_table_from_passes(SHAPES, [_seconds(slow_m=64, factor=0.5), _seconds(), _seconds()])
    assert all(r[3] == pytest.approx(RATE) for r in lucky)


def test_the_overlap_fraction_is_the_median_round():
    """One round with a slow spell in the lone all-reduce (the fraction's denominator) does not move it."""
    from podscale.plan.calibrate import overlap_exposed
    rounds = [[0.010, 0.030, 0.033], [0.010, 0.030, 0.034], [0.002, 0.030, 0.033], [0.010, 0.031, 0.034],
              [0.030, 0.030, 0.031]]
    got = overlap_exposed({"sync": {"bucket_allreduce_s": 0.01, "bucket_mm_s": 0.03, "bucket_overlapped_s": 0.033,
                                    "bucket_rounds": rounds}})
    assert got == pytest.approx(0.3)
    # a file written before the rounds: the one measurement
    assert overlap_exposed({"sync": {"bucket_allreduce_s": 0.01, "bucket_mm_s": 0.03,
                                     "bucket_overlapped_s": 0.035}}) == pytest.approx(0.5)


def test_elementwise_rate_follows_the_activation_size():
    """Measured at several activation sizes, the element-wise rate is interpolated (log-log) by the layer's
    activation bytes and held at the end rates beyond the measured sizes; without a table, one rate."""
    table = [(1 << 17, 20e9), (1 << 20, 10e9), (1 << 23, 5e9)]
    dev = _system([[64, 64, 64, RATE]], table).device
    assert dev.elementwise_table == tuple((float(a), r) for a, r in table)
    nbytes = 1e8
    assert elementwise_time(dev, nbytes, 1 << 17) == pytest.approx(nbytes / 20e9)
    assert elementwise_time(dev, nbytes, 1 << 10) == pytest.approx(nbytes / 20e9)      # below: the end rate
    assert elementwise_time(dev, nbytes, 1 << 26) == pytest.approx(nbytes / 5e9)       # above: the end rate
    mid = math.sqrt((1 << 17) * (1 << 20))
    assert elementwise_time(dev, nbytes, mid) == pytest.approx(nbytes / math.sqrt(20e9 * 10e9))
    flat = _system([[64, 64, 64, RATE]]).device
    assert elementwise_time(flat, nbytes, 1 << 17) == stream_time(flat, nbytes) == pytest.approx(nbytes / 4e9)


def test_the_planner_prices_each_micro_batch_at_its_own_element_wise_rate():
    """A micro-batch of 4 sequences (256 KiB activations) runs its element-wise kernels at the rate measured
    for that size, one of 8 (512 KiB) at its own: the step's element-wise term follows the table."""
    table = [(1 << 18, 8e9), (1 << 19, 4e9)]
    system = _system([[64, 64, 64, RATE], [4096, 512, 512, RATE]], table)
    ew = {b: predict(system, 2, MODEL, as_trained(Layout(dp=2, microbatch=b)), 16).components_s["elementwise"]
          for b in (4, 8)}
    fwd_bytes = layer_elementwise_bytes(4 * 128, 128, 512, dtype_bytes=4)     # one micro-batch of 4, one layer
    assert ew[4] == pytest.approx(2 * MODEL.layers * 3 * fwd_bytes / 8e9, rel=1e-6)   # 2 micro-batches, fwd + 2 bwd
    assert ew[8] == pytest.approx(MODEL.layers * 3 * 2 * fwd_bytes / 4e9, rel=1e-6)
    assert ew[8] == pytest.approx(2 * ew[4], rel=1e-6)


def test_a_weight_gradient_is_read_from_the_table_at_the_shape_autograd_issues():
    """nn.Linear stores its weight (out x in), so autograd's dW = dY^T X is (out x tokens)(tokens x in): the
    table is read at m = out, n = in, not the transpose (a CPU's rates are not symmetric in m and n)."""
    from podscale.plan.compute import gemm_time, linear_time
    tokens, n_out, k_in = 512, 2048, 512
    fast, slow = 1e11, 2.5e10
    rows = [[m, n, k, fast if (m, n) == (n_out, k_in) else slow]
            for m in (512, 2048) for n in (512, 2048) for k in (512, 2048)]
    dev = _system(rows).device
    fwd, bwd = linear_time(dev, tokens, n_out, k_in, bytes_per_element=4)
    flops = 2.0 * tokens * n_out * k_in
    assert fwd == pytest.approx(flops / slow)
    assert bwd == pytest.approx(flops / slow + flops / fast)               # input gradient + weight gradient
    assert gemm_time(dev, k_in, n_out, tokens, bytes_per_element=4) == pytest.approx(flops / slow)


def test_zero_collectives_are_priced_at_their_own_measured_bandwidth():
    """podscale's reduce-scatter on gloo is a reduce per rank, not half a ring all-reduce (measured: about a
    whole all-reduce's time): calibration fits its own bandwidth (and the all-gather's) in the half-ring
    model, the planner prices ZeRO's collectives with it, and files without it price the ring."""
    from podscale.plan import network as net
    from podscale.plan.calibrate import fit_ring, sharded_bandwidth
    alpha, bw, n = 50e-6, 2e9, 2
    ar = [(s, 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bw) for s in (1 << 12, 1 << 16, 1 << 20, 1 << 24)]
    rs_bw, ag_bw = 0.5e9, 1.5e9
    half = {name: [(s, (n - 1) * alpha + (n - 1) / n * s / b) for s in (1 << 20, 1 << 22, 1 << 24)]
            for name, b in (("reduce_scatter", rs_bw), ("all_gather", ag_bw))}
    data = {"matmul": [[64, 64, 64, RATE], [4096, 512, 512, RATE]], "memory_bw": 1e10, "elementwise_bw": 4e9,
            "kernel_overhead": 5e-6, "allreduce": ar, "threads": 1, "nvme_bw": 1e9, "optimizer_bw": 8e9,
            "grad_pass_bw": 6e9, **half}
    assert fit_ring(ar, n)[0] == pytest.approx(alpha, rel=1e-6)
    assert sharded_bandwidth(data, "reduce_scatter", n) == pytest.approx(rs_bw, rel=1e-6)
    measured = system_from_dict(tomllib.loads(system_toml(data, n, quick=True)))
    ring = system_from_dict(tomllib.loads(system_toml({k: v for k, v in data.items() if k not in half}, n, True)))
    assert measured.intra.reduce_scatter_bandwidth == pytest.approx(rs_bw, rel=1e-5)
    assert ring.intra.reduce_scatter_bandwidth == 0 and ring.intra.all_gather_bandwidth == 0
    s = 1 << 24
    assert net.reduce_scatter_time(measured, s, 2) == pytest.approx(alpha + s / 2 / rs_bw, rel=1e-5)
    assert net.all_gather_time(measured, s, 2) == pytest.approx(alpha + s / 2 / ag_bw, rel=1e-5)
    assert net.reduce_scatter_time(ring, s, 2) == pytest.approx(net.all_reduce_time(ring, s, 2) / 2, rel=1e-9)
    assert net.all_reduce_time(measured, s, 2) == net.all_reduce_time(ring, s, 2)
    lay = as_trained(Layout(dp=2, microbatch=8, zero_stage=2))
    z2 = {sys_.name + str(i): predict(sys_, 2, MODEL, lay, 16).time_breakdown_s["dp_communication"]
          for i, sys_ in enumerate((measured, ring))}
    assert z2["local0"] > z2["local1"]                  # slower reduce-scatter: ZeRO-2 waits longer
    z0 = as_trained(Layout(dp=2, microbatch=8))
    assert predict(measured, 2, MODEL, z0, 16).step_time_s == predict(ring, 2, MODEL, z0, 16).step_time_s


def test_zero_1_and_2_pay_the_reduce_scatter_and_the_all_gather_each_at_its_own_bandwidth():
    """A slower measured all-gather lengthens ZeRO-1/2's step by exactly the longer parameter all-gather after
    the optimizer step; the gradients' reduce-scatter is priced as itself (it was the all-reduce less the
    all-gather, right only when both are ring halves)."""
    import dataclasses
    from podscale.plan import network as net
    base = _system([[64, 64, 64, RATE], [4096, 512, 512, RATE]])
    slow_ag = dataclasses.replace(base, intra=dataclasses.replace(base.intra, all_gather_bandwidth=0.25e9),
                                  inter=dataclasses.replace(base.inter, all_gather_bandwidth=0.25e9))
    grad_bytes = 4 * (MODEL.params)                        # fp32 gradients of the whole model (dp = 2, pp = 1)
    extra = net.all_gather_time(slow_ag, grad_bytes, 2) - net.all_gather_time(base, grad_bytes, 2)
    assert extra > 0
    for stage in (1, 2):
        lay = as_trained(Layout(dp=2, microbatch=8, zero_stage=stage))
        a = predict(base, 2, MODEL, lay, 16).time_breakdown_s["dp_communication"]
        b = predict(slow_ag, 2, MODEL, lay, 16).time_breakdown_s["dp_communication"]
        assert b - a == pytest.approx(extra, rel=1e-6)


def test_gemm_operands_are_cycled_out_of_the_cores_cache():
    """Each calibrated GEMM shape reads its operands from the next of enough copies to fill COLD_BYTES, as a
    training step's GEMMs find theirs written by other kernels since their last use; a shape whose operands
    alone fill it uses one set."""
    from podscale.plan.calibrate import COLD_BYTES, gemm_operand_sets
    for m, n, k in [(64, 32, 32), (1024, 384, 128), (256, 2048, 2048), (4096, 2048, 2048)]:
        sets = gemm_operand_sets(m, n, k)
        one = 4 * (2 * m * k + 2 * n * k + n)
        assert sets * one >= COLD_BYTES and (sets == 1 or (sets - 1) * one < COLD_BYTES)
    assert gemm_operand_sets(4096, 2048, 2048) == 1
