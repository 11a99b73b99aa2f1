"""Hardware catalog: every built-in system loads, user TOML systems, device-count rules, networks."""
import pytest

from podscale.plan import network as net
from podscale.plan.hardware import BUILTIN_DIR, CatalogError, load_system, system_names

BUILTIN = ["dgx-a100-40g", "dgx-a100-80g", "dgx-h100", "dgx-a100-superpod", "dgx-h100-superpod",
           "tpu-v3-pod", "tpu-v4-pod", "cerebras-cs2", "jean-zay-a100"]


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_system_loads_with_sources(name):
    s = load_system(name)
    assert s.name == name
    assert s.device.peak_flops > 1e13 and s.device.memory_bytes > 1e10 and s.device.memory_bw > 1e11
    text = (BUILTIN_DIR / f"{name}.toml").read_text()
    assert text.count("#") >= 5          # numbers carry their sources in comments


def test_catalog_names_and_datasheet_numbers():
    assert set(BUILTIN) | {"local"} <= set(system_names())
    a100 = load_system("dgx-a100-80g")
    assert a100.device.peak_flops == 312e12 and a100.devices_per_node == 8
    assert a100.inter.bandwidth == 25e9                     # 200 Gb/s HDR per GPU
    assert load_system("dgx-a100-superpod").max_devices == 140 * 8
    assert load_system("dgx-h100").device.peak_flops == 989e12
    assert load_system("tpu-v4-pod").torus == (16, 16, 16)
    assert load_system("cerebras-cs2").data_parallel_only
    # which descriptions were checked against published runs (plan validate), which were not
    # (the rule, a published run within 10 %, is tested against the validation set in test_plan_validate_search)
    assert load_system("dgx-a100-80g").validated and load_system("tpu-v4-pod").validated
    assert not load_system("dgx-h100").validated and not load_system("jean-zay-a100").validated
    assert a100.device.sm_count == 108 and a100.device.gemm_tiles[0] == (256, 128)


def test_user_toml_system_by_path_and_by_name(tmp_path, monkeypatch):
    text = (BUILTIN_DIR / "dgx-a100-80g.toml").read_text().replace('name = "dgx-a100-80g"', 'name = "my-pod"')
    text = text.replace("peak_tflops = 312", "peak_tflops = 400")
    path = tmp_path / "my-pod.toml"
    path.write_text(text)
    assert load_system(str(path)).device.peak_flops == 400e12
    monkeypatch.setenv("PODSCALE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "systems").mkdir(parents=True)
    (tmp_path / "cache" / "systems" / "my-pod.toml").write_text(text)
    assert "my-pod" in system_names()
    assert load_system("my-pod").name == "my-pod"


def test_bad_systems_give_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("PODSCALE_CACHE", str(tmp_path))
    with pytest.raises(CatalogError, match="unknown system 'dgx-z9'.*dgx-a100-80g"):
        load_system("dgx-z9")
    with pytest.raises(CatalogError, match="podscale plan calibrate"):
        load_system("local")
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\n[device]\npeak_tflops = 1\n')
    with pytest.raises(CatalogError, match="lacks key"):
        load_system(str(bad))
    s = load_system("dgx-a100-superpod")
    with pytest.raises(CatalogError, match="at most 1120"):
        s.check_devices(2048)
    with pytest.raises(CatalogError, match="multiple of 8"):
        load_system("dgx-a100-80g").check_devices(12)


def test_hierarchical_allreduce_inside_vs_across_nodes():
    s = load_system("dgx-a100-80g")
    size = 1e9
    inside = net.all_reduce_time(s, size, 8, 1)
    assert inside == pytest.approx(2 * 7 / 8 * size / (300e9 * 0.77) + 14 * 10e-6)
    # 8 ranks one per node: every byte crosses the per-GPU NIC share (25 GB/s).
    across = net.all_reduce_time(s, size, 8, 8)
    assert across == pytest.approx(2 * 7 / 8 * size / (25e9 * 0.92) + 14 * 6e-6)
    # 64 ranks, 8 per node: reduce-scatter in the node first, the NICs carry 1/8 of the data.
    hier = net.all_reduce_time(s, size, 64, 1)
    assert inside < hier < across


def test_torus_rings_use_both_directions():
    s = load_system("tpu-v3-pod")
    link = 82e9 * 0.85
    t = net.all_reduce_time(s, 1e9, 32, 1)                   # one full ring of the 32 x 32 torus
    assert t == pytest.approx(2 * 31 / 32 * 1e9 / (2 * link) + 62 * 2e-6)
    t2 = net.all_reduce_time(s, 1e9, 1024, 1)                # 2-D: second dimension on 1/32 of the data
    assert t2 == pytest.approx(t + 2 * 31 / 32 * 1e9 / 32 / (2 * link) + 62 * 2e-6)


def test_torus_group_that_does_not_align_uses_one_shared_link():
    s = load_system("tpu-v4-pod")
    link = 50e9 * 0.85
    # 2 members 56 chips apart: 56 is not a multiple of the 16-chip dimension
    assert net.all_reduce_time(s, 1e9, 2, 56) == pytest.approx(1e9 / link + 2 * 2e-6 * 56)
    with pytest.raises(ValueError):
        net.all_reduce_time(s, 1e9, 4096, 2)
