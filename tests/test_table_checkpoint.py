"""Table checkpoints (issue 13): a full save then an incremental one (with TTL deletions) on 2 ranks,
loaded on 1 rank with every table table-wise, saved again and loaded on 4 ranks with the shardings swapped
(column- and row-wise): the next step's loss and the rows are those of the run that saved them.  The
checkpoint holds only safetensors and JSON, and exports a serving copy."""
import json
from pathlib import Path

import torch

from podscale.runtime.launcher import launch
from podscale.table.checkpoint import export_tables
from table_ckpt_workers import run

# Rows are copied bit for bit between shardings (asserted exactly below); only the order in which the next
# step's loss is summed over ranks differs, hence a tolerance on the loss.
LOSS_TOL = 1e-6


def _gather(results, name):
    """{key: full row} of table ``name`` from every rank's pieces (column blocks joined)."""
    rows = {}
    for res in results.values():
        for keys, c0, c1, w in res["rows"][name]:
            for k, r in zip(keys.tolist(), w):
                rows.setdefault(k, {})[c0] = r
    return {k: torch.cat([parts[c] for c in sorted(parts)]) for k, parts in rows.items()}


def _same_rows(a, b):
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_reshard_two_to_one_to_four_ranks_and_export(tmp_path, capsys):
    ck1, ck2 = tmp_path / "c1", tmp_path / "c2"
    # 2 ranks, u row-wise and v column-wise: full save after step 2, incremental after 4
    a = launch(run, ({"shardings": ["row", "column"], "first": 0, "steps": 4,
                      "saves": {"2": str(ck1 / "step_2"), "4": str(ck1 / "step_4")}},), nproc=2)
    manifest = json.loads((ck1 / "step_4" / "tables.json").read_text())
    assert [c["full"] for c in manifest["chain"]] == [True, False] and manifest["clock"]["step_count"] == 4
    assert a[0]["losses"][-1] < a[0]["losses"][0]
    files = [p for p in ck1.rglob("*") if p.is_file()]
    assert files and all(p.suffix in (".safetensors", ".json") for p in files)  # nothing to unpickle
    # the delta holds only the rows steps 3-4 wrote, fewer than the tables hold, and the TTL's deletions
    from safetensors.torch import load_file
    delta = [load_file(str(p)) for p in (ck1 / manifest["chain"][1]["segment"]).glob("*.safetensors")]
    held = sum(len(k) for res in a.values() for name in ("u", "v") for k, c0, _, _ in res["rows"][name] if c0 == 0)
    assert 0 < sum(len(d["keys"]) for d in delta if d["rows"].shape[1] in (8 + 2, 6 + 2)) < held
    assert sum(len(d.get("deleted", [])) for d in delta) > 0

    # 1 rank, both tables table-wise: the next step's loss and every row as the 2 ranks had them
    b = launch(run, ({"shardings": ["table", "table"], "first": 4, "steps": 1, "load": str(ck1 / "step_4"),
                      "saves": {"5": str(ck2 / "step_5")}},), nproc=1)
    assert abs(b[0]["losses"][0] - a[0]["next_loss"]) < LOSS_TOL
    # 4 ranks, u column-wise and v row-wise, from the 1-rank checkpoint
    c = launch(run, ({"shardings": ["column", "row"], "first": 5, "steps": 0, "load": str(ck2 / "step_5")},),
               nproc=4)
    assert abs(c[0]["next_loss"] - b[0]["next_loss"]) < LOSS_TOL
    for name in ("u", "v"):
        assert _same_rows(_gather(b, name), _gather(c, name)) == 0.0

    # serving export: sorted keys and weights per table, equal to the trained rows
    out = export_tables(ck2 / "step_5", tmp_path / "serve")
    index = json.loads((out / "index.json").read_text())
    from safetensors.torch import load_file
    for t in index["tables"]:
        parts = [load_file(str(out / f)) for f in t["files"]]
        keys = torch.cat([p["keys"] for p in parts])
        weights = torch.cat([p["weights"] for p in parts])
        assert torch.equal(keys, torch.sort(keys).values) and weights.shape == (t["rows"], t["dim"])
        want = _gather(b, t["name"])
        assert set(keys.tolist()) == set(want)
        assert max((weights[i] - want[k]).abs().max().item() for i, k in enumerate(keys.tolist())) == 0.0

    # the same export from the command line, and one line (exit 2) where a checkpoint holds no tables
    from podscale.cli import main
    assert main(["export", str(ck2 / "step_5"), str(tmp_path / "serve2"), "--tables"]) == 0
    assert json.loads((tmp_path / "serve2" / "index.json").read_text()) == index
    for t in index["tables"]:
        for f in t["files"]:
            a, b = load_file(str(tmp_path / "serve2" / f)), load_file(str(out / f))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["export", str(tmp_path), str(tmp_path / "serve3"), "--tables"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checkpoint with sharded tables" in err[0]


def test_dense_store_checkpoint_loads_into_keyed_and_dense_shards(tmp_path):
    """Table v in dense-range stores (column-wise, 2 ranks): its checkpoint holds the rows training wrote,
    and loads into keyed table-wise shards on 1 rank and dense table-wise shards on 2 ranks with the same
    next-step loss and rows."""
    ck = tmp_path / "c"
    a = launch(run, ({"shardings": ["row", "column"], "v_storage": "dense", "first": 0, "steps": 3,
                      "saves": {"3": str(ck / "step_3")}},), nproc=2)
    assert a[0]["losses"][-1] < a[0]["losses"][0]
    b = launch(run, ({"shardings": ["table", "table"], "first": 3, "steps": 0, "load": str(ck / "step_3")},),
               nproc=1)
    c = launch(run, ({"shardings": ["row", "table"], "v_storage": "dense", "first": 3, "steps": 0,
                      "load": str(ck / "step_3")},), nproc=2)
    for other in (b, c):
        assert abs(other[0]["next_loss"] - a[0]["next_loss"]) < LOSS_TOL
        for name in ("u", "v"):
            assert _same_rows(_gather(a, name), _gather(other, name)) == 0.0
