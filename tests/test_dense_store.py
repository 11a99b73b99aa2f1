"""The dense-range row store (podscale/storage/dense.py): the key is the slot, every row exists from the
start with its deterministic initial value, and only written rows count as held (scan, len, checkpoints),
as in the keyed store.  In-process, no ranks: the sharded equality test with dense stores is
tests/test_table.py::test_sharded_tables_match_embedding_bag[2-dense]."""
import pytest
import torch

from podscale.storage.dense import DenseRowStore
from podscale.storage.rows import MemoryRowStore, StorageError
from podscale.table import TableError, TableSpec
from podscale.table.hashing import init_rows, name_seed

WIDTH = 5


def _init(keys: torch.Tensor) -> torch.Tensor:
    return init_rows(name_seed(1, "t"), keys, 0, WIDTH, 0.1)


def test_dense_store_reads_initial_rows_and_holds_only_written_ones():
    store = DenseRowStore(1000, WIDTH, _init)
    keys = torch.tensor([3, 999, 0, 41])
    rows, found = store.get(keys)
    assert found.all() and torch.equal(rows, _init(keys))
    assert len(store) == 0 and list(store.scan()) == []
    # the same writes into a keyed store and a dense one read back the same
    keyed = MemoryRowStore(WIDTH)
    new = torch.randn(4, WIDTH)
    for s in (store, keyed):
        s.put(keys, new)
    got, _ = store.get(keys)
    assert torch.equal(got, keyed.get(keys)[0])
    scanned = {int(k): r for ks, rs in store.scan(batch=3) for k, r in zip(ks, rs)}
    assert sorted(scanned) == sorted(keys.tolist()) and len(store) == 4
    assert all(torch.equal(scanned[int(k)], new[i]) for i, k in enumerate(keys))
    # a deleted row returns to its initial value and is no longer held
    store.delete(torch.tensor([3, 7]))
    assert torch.equal(store.get(torch.tensor([3]))[0], _init(torch.tensor([3])))
    assert len(store) == 3
    store.clear()
    assert len(store) == 0 and torch.equal(store.get(keys)[0], _init(keys))


def test_dense_store_rejects_keys_outside_its_range():
    store = DenseRowStore(10, WIDTH, _init)
    for bad in ([10], [-1]):
        with pytest.raises(StorageError, match=r"keys \[0, 10\)"):
            store.get(torch.tensor(bad))


@pytest.mark.parametrize("kw,part", [
    ({"sharding": "table"}, "needs the id range: set num_keys"),
    ({"sharding": "row", "num_keys": 10}, "needs table- or column-wise sharding"),
    ({"sharding": "table", "num_keys": 10, "admit_after": 3}, "admit_after, ttl_steps and dram_budget_bytes"),
    ({"sharding": "table", "num_keys": 10, "ttl_steps": 5}, "admit_after, ttl_steps and dram_budget_bytes"),
    ({"storage": "flat"}, "storage 'flat' must be one of keyed, dense"),
])
def test_dense_spec_errors_name_the_fix(kw, part):
    kw = {"storage": "dense", **kw}
    with pytest.raises(TableError, match=part) as e:
        TableSpec("t", 4, **kw).check()
    assert "\n" not in str(e.value)


def test_dlrm_dense_storage_config_errors_before_workers(tmp_path):
    from podscale.config import ConfigError, parse_config

    def cfg(**model):
        return {"run": {"name": "d", "out_dir": str(tmp_path)},
                "model": {"kind": "dlrm", "tables": [{"name": "a", "cardinality": 1000}],
                          "table_storage": "dense", **model},
                "train": {"global_batch": 64, "micro_batch": 32}, "parallel": {"nproc": 2}}

    ok = parse_config(cfg(declare_range=True, sharding="table"))
    from podscale.tasks.dlrm import DLRMTask
    assert [s.storage for s in DLRMTask(ok).table_specs()] == ["dense"]
    for model, part in [({"sharding": "table"}, "set model.declare_range = true"),
                        ({"declare_range": True}, "needs table- or column-wise sharding"),
                        ({"declare_range": True, "sharding": "column", "ttl_steps": 3}, "drop model.admit_after")]:
        with pytest.raises(ConfigError, match=part) as e:
            parse_config(cfg(**model))
        assert "\n" not in str(e.value)
