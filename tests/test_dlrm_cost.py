"""The planner's DLRM cost model (podscale/plan/dlrm_cost.py): its table terms on constructed inputs, the
expected distinct count of a Zipf sample against sampled ones, and the quick path of the table
microbenchmarks `plan calibrate` runs."""
import dataclasses

import numpy as np
import pytest

from podscale.plan import predict
from podscale.plan.calibrate import calibrate_table
from podscale.plan.hardware import TABLE_OPS, TableRates, load_system, load_system_file
from podscale.plan.models import DLRM, ModelError, model_from_dict
from podscale.table.data import zipf_ranks
from podscale.table.estimate import expected_distinct, expected_new


def _rates(scale: float = 1.0) -> TableRates:
    """Constructed rates: every op costs 2 us a call, 20 ns a key, 1 ns a float (SSD ops 20 x dearer, creating
    a row 4 x)."""
    ops = {op: (2e-6, 20e-9, 1e-9) for op in TABLE_OPS}
    ops["dense_get"] = ops["dense_put"] = (2e-6, 0.0, 1e-9)      # no key index: the key is the slot
    ops["ssd_get"] = ops["ssd_put"] = (40e-6, 400e-9, 20e-9)
    ops["create"] = (2e-6, 80e-9, 4e-9)                        # a missing read, initial rows, two writes
    return TableRates({k: tuple(scale * x for x in v) for k, v in ops.items()})


def _system(rates: TableRates | None):
    return dataclasses.replace(load_system("dgx-a100-superpod"), table=rates, name="constructed")


def _model(**kw) -> DLRM:
    base = dict(tables=((100_000, 32),) * 4, bottom_mlp=(13, 64, 32), top_mlp=(64, 1), lookups_per_table=4)
    base.update(kw)
    if "dim" in base:
        d = base.pop("dim")
        base["tables"] = tuple((r, d) for r, _ in base["tables"])
        base["bottom_mlp"] = (13, 64, d)
    return DLRM(**base)


def _step(model: DLRM, rates=_rates(), batch: int = 512, n: int = 2):
    return predict(_system(rates), n, model, {"tp": 1, "pp": 1, "dp": n, "microbatch": batch // n}, batch)


def _tables(p) -> float:
    return sum(v for k, v in p.time_breakdown_s.items() if k.startswith("table_"))


def test_expected_distinct_matches_sampled_zipf():
    rng = np.random.default_rng(3)
    for n, alpha, draws in [(100_000, 1.05, 4096), (2_000, 1.05, 10_000), (1_000_000, 1.3, 20_000)]:
        sampled = np.mean([len(np.unique(zipf_ranks(rng, draws, n, alpha))) for _ in range(8)])
        assert expected_distinct(n, alpha, draws) == pytest.approx(sampled, rel=0.03), (n, alpha, draws)
    assert expected_distinct(50, 1.05, 10_000) <= 50


def test_expected_new_keys_match_sampled_steps():
    """Ids of step s that no earlier step drew: the rows a keyed store creates in that step."""
    rng = np.random.default_rng(5)
    n, alpha, draws, steps = 50_000, 1.05, 2048, 12
    counts = np.zeros(steps)
    for _ in range(6):
        seen = set()
        for s in range(steps):
            step_ids = set(np.unique(zipf_ranks(rng, draws, n, alpha)).tolist())
            counts[s] += len(step_ids - seen) / 6
            seen |= step_ids
    for s in (1, 4, 12):
        assert expected_new(n, alpha, draws, s) == pytest.approx(counts[s - 1], rel=0.05), s
    assert expected_new(n, alpha, draws, 1) == pytest.approx(expected_distinct(n, alpha, draws))


def test_early_steps_dearer_in_keyed_store_only():
    """New keys create rows in a keyed store; a dense store has every row from the start."""
    early, late = _step(_model(step=2)), _step(_model(step=200))
    assert early.time_breakdown_s["table_store"] > late.time_breakdown_s["table_store"]
    dense = [_step(_model(sharding="table", storage="dense", step=s)).step_time_s for s in (2, 200)]
    assert dense[0] == pytest.approx(dense[1])


@pytest.mark.parametrize("sharding", ["row", "table", "column"])
def test_table_time_grows_with_ids_dims_and_batch(sharding):
    base = _tables(_step(_model(sharding=sharding)))
    assert _tables(_step(_model(sharding=sharding, lookups_per_table=12))) > base
    assert _tables(_step(_model(sharding=sharding, dim=128))) > base
    assert _tables(_step(_model(sharding=sharding), batch=2048)) > base
    assert _tables(_step(_model(sharding=sharding, tables=((100_000, 32),) * 8))) > base
    # a more skewed id law leaves fewer distinct rows to look up and update
    assert _tables(_step(_model(sharding=sharding, alpha=1.4))) < base


def test_dense_store_cheaper_than_keyed():
    for sharding in ("table", "column"):
        keyed = _step(_model(sharding=sharding)).time_breakdown_s["table_store"]
        dense = _step(_model(sharding=sharding, storage="dense")).time_breakdown_s["table_store"]
        assert dense < keyed


def test_ssd_tier_dearer_with_smaller_budget():
    times = [_step(_model(dram_budget_mb=b)).step_time_s for b in (None, 64.0, 4.0, 0.5)]
    assert times == sorted(times) and times[0] < times[-1], times


def test_host_model_named_and_bandwidth_model_without_rates():
    host, bw = _step(_model()), _step(_model(), rates=None)
    assert "host model" in host.notes[0] and "table_store" in host.time_breakdown_s
    assert "bandwidth model" in bw.notes[0] and "embedding" in bw.time_breakdown_s
    # slower rates, slower tables: the host model reads the rates it is given
    assert _tables(_step(_model(), rates=_rates(3.0))) == pytest.approx(3 * _tables(host), rel=1e-6)


@pytest.mark.parametrize("kw, words", [
    ({"sharding": "diagonal"}, "sharding 'diagonal'"),
    ({"storage": "dense"}, "storage 'dense' needs table- or column-wise"),
    ({"dram_budget_mb": -1.0}, "dram_budget_mb=-1.0 must be positive"),
    ({"sharding": "table", "storage": "dense", "dram_budget_mb": 8.0}, "with storage='keyed'"),
    ({"cache_policy": "fifo"}, "cache_policy 'fifo'"),
    ({"step": 0}, "step=0 must be >= 1"),
])
def test_bad_dlrm_record_is_one_line(kw, words):
    with pytest.raises(ModelError, match=words) as e:
        _model(**kw)
    assert "\n" not in str(e.value)
    with pytest.raises(ModelError):
        model_from_dict({"kind": "dlrm", "tables": [[10, 4]], "bottom_mlp": [13, 4], "top_mlp": [1], **kw})


def test_calibrate_table_quick_path_round_trips(tmp_path):
    """`plan calibrate --table-only --quick`: the ranks measure at once and the [table] section of the
    system file is replaced (a stale one is dropped), then read back as the system's TableRates."""
    path = tmp_path / "local.toml"
    stale = "\n".join(f"{op} = [1, 1, 1]" for op in TABLE_OPS)
    path.write_text('name = "local"\ntopology = "host"\n[device]\npeak_tflops = 1\nmemory_gib = 1\n'
                    'memory_bw_gbps = 1\n[table]\n' + stale + '\n[intra_node]\nbandwidth_gbps = 1\n'
                    '[inter_node]\nbandwidth_gbps = 1\n')
    calibrate_table(str(path), quick=True, log=lambda *_: None)
    text = path.read_text()
    assert text.count("[table]") == 1 and "[1, 1, 1]" not in text and "[intra_node]" in text
    rates = load_system_file(path).table
    assert set(rates.ops) == set(TABLE_OPS)
    assert all(len(v) == 3 and min(v) >= 0 and sum(v) > 0 for v in rates.ops.values())
    # more rows cost more: the keyed store's read of 4096 rows over that of 256
    assert rates.time("keyed_get", 4096, 4096 * 34) > rates.time("keyed_get", 256, 256 * 34)
