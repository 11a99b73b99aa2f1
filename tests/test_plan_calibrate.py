"""`podscale plan calibrate --quick` measures this machine and writes a usable `local` system."""
import tomllib

import pytest

from podscale.plan import predict
from podscale.plan.calibrate import expected_time, fit_ring, overlap_penalty, sync_wait, system_toml
from podscale.plan.hardware import system_from_dict
from podscale.plan.layout import Layout
from podscale.plan.cli import main
from podscale.plan.hardware import load_system


def test_fit_ring_recovers_latency_and_bandwidth():
    alpha, bw, n = 50e-6, 2e9, 2
    samples = [(s, 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bw) for s in (1 << 12, 1 << 16, 1 << 20, 1 << 24)]
    a, b = fit_ring(samples, n)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bw, rel=1e-6)


def test_quick_calibration_writes_a_local_system(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PODSCALE_CACHE", str(tmp_path))
    swap = tmp_path / "swap"
    swap.mkdir()
    assert main(["plan", "calibrate", "--quick", "--swap-dir", str(swap)]) == 0
    assert not list(swap.iterdir())  # the bandwidth probe leaves nothing behind
    path = tmp_path / "local.toml"
    data = tomllib.loads(path.read_text())
    assert data["name"] == "local" and data["topology"] == "host"
    assert all(f > 1e8 for *_, f in data["device"]["matmul_table"])        # > 0.1 GFLOP/s, measured
    assert data["device"]["memory_bw_gbps"] > 0.1
    assert data["intra_node"]["bandwidth_gbps"] > 0 and data["intra_node"]["latency_us"] >= 0
    assert len(data["calibration"]["allreduce_bytes_seconds"]) >= 3
    # ZeRO's reduce-scatter and all-gather as podscale issues them on gloo, measured on their own
    assert data["intra_node"]["reduce_scatter_gbps"] > 0.001 and data["intra_node"]["all_gather_gbps"] > 0.001
    assert data["calibration"]["sync_wait_us"] >= 0 and data["device"]["overlap_penalty_us"] >= 0
    assert data["device"]["optimizer_gbps"] > 0.01 and data["device"]["grad_pass_gbps"] > 0.01
    assert data["device"]["first_touch_gbps"] > 0.01      # re-faulting trimmed pages (ZeRO-3 on a CPU)
    assert data["device"]["overlap_exposed"] >= 0
    assert data["device"]["elementwise_gbps"] > 0.01 and data["device"]["kernel_overhead_us"] > 0
    sizes = data["device"]["elementwise_table"]          # the element-wise rate at >= 2 activation sizes
    assert len(sizes) >= 2 and len({a for a, _ in sizes}) == len(sizes) and all(r > 0.01 for _, r in sizes)
    assert len(data["device"]["attention_table"]) >= 4
    assert all(f > 1e7 and b > 1e7 for *_, f, b in data["device"]["attention_table"])   # measured FLOP/s
    assert data["host"]["nvme_gbps"] > 0.01  # the swap folder's disk, measured (was a fixed 1 GB/s)
    local = load_system("local")
    assert local.device.dtype_bytes == 4 and local.device.matmul_table
    tiny = {"layers": 2, "hidden": 128, "heads": 4, "seq": 128, "vocab": 256}
    p = predict(local, 2, tiny, {"tp": 1, "pp": 1, "dp": 2, "microbatch": 4}, 16)
    q = predict(local, 2, tiny, {"tp": 2, "pp": 1, "dp": 1, "microbatch": 4}, 16)
    assert 1e-4 < p.step_time_s < 10 and q.time_breakdown_s["tp_communication"] > 0


def test_the_wait_of_a_collective_between_kernels_is_paid_once_by_every_collective():
    """A collective issued after a multiply costs the pair's time less the multiply's: its excess over the
    ring model's time for its size (fitted to back-to-back samples) is the links' ``sync_wait_us``, beside the
    ring's per-step latency; none measured, none added.  Every collective and message pays it once, whatever
    its kind: an all-gather's or all-to-all's ranks wait for the last one as an all-reduce's do.  A file written
    when the wait was spread over an all-reduce's 2 (n - 1) latencies is read the same."""
    from podscale.plan import network as net
    from podscale.plan.hardware import system_from_dict
    alpha, bw, n = 50e-6, 2e9, 2
    samples = [(s, 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bw) for s in (1 << 12, 1 << 16, 1 << 20, 1 << 24)]
    data = {"matmul": [[64, 64, 64, 1e10]], "memory_bw": 1e10, "elementwise_bw": 5e9, "kernel_overhead": 5e-6,
            "allreduce": samples, "threads": 1, "nvme_bw": 1e9,
            "sync": {"bytes": 1 << 19, "pair_s": 3.0e-3, "mm_s": 2.0e-3, "allreduce_s": 0.4e-3}}
    ring = 2 * alpha + (1 << 19) / bw                 # t(512 KiB) on 2 ranks: 0.362 ms
    wait = 1.0e-3 - ring
    assert sync_wait(data, n) == pytest.approx(wait)
    text = system_toml(data, n, quick=True)
    link = tomllib.loads(text)["intra_node"]
    assert link["latency_us"] == pytest.approx(alpha * 1e6, rel=1e-3)
    assert link["sync_wait_us"] == pytest.approx(wait * 1e6, rel=1e-3)
    system = system_from_dict(tomllib.loads(text))
    assert system.collective_wait == pytest.approx(wait, rel=1e-3)
    lat = system.intra.latency
    assert net.all_reduce_time(system, 0, 2) == pytest.approx(2 * lat + wait, rel=1e-3)
    assert net.all_gather_time(system, 0, 2) == pytest.approx(lat + wait, rel=1e-3)
    assert net.all_to_all_time(system, 0, 2) == pytest.approx(lat + wait, rel=1e-3)
    assert net.all_reduce_time(system, 1 << 20, 1) == 0.0          # a group of one waits for nobody
    # the earlier format: latency_us = alpha + wait / (2 (n - 1)), the wait in [calibration] alone
    old = tomllib.loads(text)
    for key in ("intra_node", "inter_node"):
        old[key]["latency_us"] = (alpha + wait / 2) * 1e6
        del old[key]["sync_wait_us"]
    before = system_from_dict(old)
    assert before.intra.latency == pytest.approx(lat, rel=1e-3) and before.collective_wait == pytest.approx(wait, rel=1e-3)
    data["sync"]["pair_s"] = 2.3e-3                    # faster than its parts: noise, no negative wait
    assert sync_wait(data, n) == 0.0
    del data["sync"]                                   # files calibrated before this measurement existed
    assert tomllib.loads(system_toml(data, n, quick=True))["intra_node"]["latency_us"] == pytest.approx(50, rel=1e-3)


def test_an_all_reduce_overlapped_with_a_matmul_costs_its_measured_penalty_in_the_tp_backward():
    """podscale's column-parallel backward all-reduces the input gradient under the weight-gradient matmul;
    on a CPU whose cores all compute, that costs more than the longer of the two (the measured penalty),
    which the tensor-parallel backward pays once per overlapped collective (two per layer)."""
    alpha, bw, n = 50e-6, 2e9, 2
    samples = [(s, 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bw) for s in (1 << 12, 1 << 16, 1 << 20, 1 << 24)]
    data = {"matmul": [[64, 64, 64, 1e10], [1024, 1024, 1024, 1e10]], "memory_bw": 1e10, "elementwise_bw": 5e9,
            "kernel_overhead": 5e-6, "allreduce": samples, "threads": 1, "nvme_bw": 1e9,
            "sync": {"bytes": 1 << 19, "pair_s": 1.4e-3, "mm_s": 1.0e-3, "allreduce_s": 0.4e-3,
                     "overlapped_s": 2.5e-3}}
    assert overlap_penalty(data) == pytest.approx(1.5e-3)
    with_penalty = system_from_dict(tomllib.loads(system_toml(data, n, quick=True)))
    assert with_penalty.device.overlap_penalty == pytest.approx(1.5e-3, rel=1e-3)
    data["sync"]["overlapped_s"] = 0.9e-3                     # faster than the matmul alone: noise, no penalty
    without = system_from_dict(tomllib.loads(system_toml(data, n, quick=True)))
    assert without.device.overlap_penalty == 0.0
    tiny = {"layers": 4, "hidden": 128, "heads": 4, "seq": 128, "vocab": 256}
    lay = Layout(tp=2, microbatch=8, tp_overlap=True)
    a = predict(with_penalty, 2, tiny, lay, 16).time_breakdown_s["tp_communication"]
    b = predict(without, 2, tiny, lay, 16).time_breakdown_s["tp_communication"]
    assert a - b == pytest.approx(2 * 4 * 2 * 1.5e-3, rel=1e-6)     # 2 per layer x 4 layers x 2 micro-batches
    # a layout that does not overlap pays nothing extra
    plain = Layout(tp=2, microbatch=8)
    assert predict(with_penalty, 2, tiny, plain, 16).step_time_s == predict(without, 2, tiny, plain, 16).step_time_s


def test_calibrate_rejects_a_missing_swap_dir(tmp_path, capsys):
    assert main(["plan", "calibrate", "--quick", "--swap-dir", str(tmp_path / "nope")]) != 0
    assert "not an existing folder" in capsys.readouterr().err


def test_gemm_shape_model_parameters_are_recovered_from_measured_gemms():
    """`plan calibrate --gpu` fits e_mm and k0 of the tile/wave-quantised roofline to measured GEMMs;
    on times generated by the model itself (with 3 % noise) the fit finds its parameters again."""
    import random
    from podscale.plan.calibrate import GPU_GEMM_SHAPES, GPU_TILES, fit_gemm_shape_model
    from podscale.plan.compute import tiled_gemm_time
    from podscale.plan.hardware import Device
    dev = Device(name="gpu", peak_flops=312e12, memory_bytes=80 * 2**30, memory_bw=2.0e12, matmul_efficiency=1.0,
                 memory_efficiency=1.0, reserved_bytes=0, sm_count=108, gemm_tiles=GPU_TILES, gemm_tile_k=32)
    rng = random.Random(0)
    samples = [(m, n, k, max(tiled_gemm_time(dev, m, n, k, 1.0, 0.81, 128), 2 * (m * k + k * n + m * n) / 2.0e12)
                * (1 + 0.03 * (2 * rng.random() - 1))) for m, n, k in GPU_GEMM_SHAPES]
    e, k0, err = fit_gemm_shape_model(samples, dev)
    assert e == pytest.approx(0.81, abs=0.02) and k0 == pytest.approx(128, abs=48) and err < 0.03


def test_gemm_shape_model_quantises_tiles_and_waves():
    from podscale.plan.compute import gemm_time
    a100 = load_system("dgx-a100-80g").device
    big = gemm_time(a100, 8192, 8192, 8192)
    # one more row than a tile multiple costs a whole extra tile row (and here a wave)
    assert gemm_time(a100, 8192 + 1, 8192, 8192) > 1.003 * big
    # a long inner dimension amortises each tile's fill and drain: closer to the per-SM rate
    rate = lambda k: 2 * 8192 * 8192 * k / gemm_time(a100, 8192, 8192, k)
    assert rate(512) < rate(4096) < rate(32768) <= a100.peak_flops * a100.matmul_efficiency


def test_calibrate_gpu_without_cuda_is_one_line(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert main(["plan", "calibrate", "--gpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("podscale: error: ") and "CUDA" in err and err.count("\n") == 1


def test_a_collective_is_timed_by_its_mean_not_by_a_low_percentile():
    """On gloo a collective's time is two-valued (its thread hand-offs now and then wait for a scheduler
    tick: ~0.5 ms or ~4 ms). A step with tens of collectives pays the mean, which is what the wait between
    kernels is taken from; a median of such samples reads one mode or the other (here the fast one, 0.5 ms,
    with 40 % of the calls at 4 ms). The slowest 2 % (stalls of other processes) are left out."""
    times = [0.5e-3] * 58 + [4.0e-3] * 40 + [50e-3] * 2
    assert expected_time(times) == pytest.approx((58 * 0.5e-3 + 40 * 4.0e-3) / 98)
    assert sorted(times)[len(times) // 2] == 0.5e-3
    assert expected_time([1.0]) == 1.0
    data = {"sync": {"bytes": 1 << 19, "pair_s": 3.0e-3, "mm_s": 2.0e-3, "allreduce_s": 0.4e-3,
                     "overlapped_s": 2.5e-3}}
    assert overlap_penalty(data) == pytest.approx(0.5e-3)   # beyond the longer of the matmul and the collective
    data["sync"]["pair_s"] = 5.0e-3                          # the collective between kernels (3 ms) is longer
    assert overlap_penalty(data) == 0.0
    data["sync"]["overlapped_s"] = 3.4e-3
    assert overlap_penalty(data) == pytest.approx(0.4e-3)
