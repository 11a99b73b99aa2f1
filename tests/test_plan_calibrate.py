"""`podscale plan calibrate --quick` measures this machine and writes a usable `local` system."""
import tomllib

import pytest

from podscale.plan import predict
from podscale.plan.calibrate import fit_ring
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
    assert data["host"]["nvme_gbps"] > 0.01  # the swap folder's disk, measured (was a fixed 1 GB/s)
    local = load_system("local")
    assert local.device.dtype_bytes == 4 and local.device.matmul_table
    tiny = {"layers": 2, "hidden": 128, "heads": 4, "seq": 128, "vocab": 256}
    p = predict(local, 2, tiny, {"tp": 1, "pp": 1, "dp": 2, "microbatch": 4}, 16)
    q = predict(local, 2, tiny, {"tp": 2, "pp": 1, "dp": 1, "microbatch": 4}, 16)
    assert 1e-4 < p.step_time_s < 10 and q.time_breakdown_s["tp_communication"] > 0


def test_calibrate_rejects_a_missing_swap_dir(tmp_path, capsys):
    assert main(["plan", "calibrate", "--quick", "--swap-dir", str(tmp_path / "nope")]) != 0
    assert "not an existing folder" in capsys.readouterr().err
