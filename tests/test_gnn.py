"""The GNN task ([model] kind = "graphsage" / "gcn"): GraphSAGE reaches the published accuracy on Cora and
CiteSeer (standard Planetoid splits, mean over seeds); mini-batch training on 2 METIS partitions (one launch of
`podscale train`) follows the single-process run of the same config step by step (losses within 1e-4, test
accuracy within 1 point); bad GNN configs fail with one line before workers start."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from podscale.config import ConfigError, parse_config
from podscale.graph import load_planetoid
from podscale.graph.partition import assign, write_partitions
from podscale.graph.sampler import full_block
from podscale.models.graphsage import GNN, GNNConfig
from podscale.runtime.launcher import launch
from podscale.train.loop import run_worker
from graph_workers import exact_blocks, planetoid_accuracies

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
SEEDS = 3


def test_exact_blocks_compute_the_full_graph():
    g = load_planetoid(DATA / "cora.npz")
    x = torch.from_numpy(g.features)
    torch.manual_seed(0)
    model = GNN(GNNConfig("graphsage", x.shape[1], 16, g.num_classes, 2, 0.0))
    full = full_block(g.indptr, g.indices)
    seeds = g.splits["test"]
    blocks = exact_blocks(g, seeds)
    with torch.no_grad():
        assert torch.allclose(model(blocks, x[blocks[0].src_ids]), model([full, full], x)[seeds], atol=1e-5)


@pytest.fixture(scope="module")
def planetoid_runs():
    """Every (graph, seed) run of the accuracy test, trained in 2 worker processes (each run alone on one
    intra-op thread, as in this process: the same numbers, the machine's 2 cores both busy); a CiteSeer seed
    costs about twice a Cora one, so each worker gets a balanced share."""
    jobs = [[("citeseer", 0), ("citeseer", 1), ("cora", 0)], [("citeseer", 2), ("cora", 1), ("cora", 2)]]
    assert sorted(j for js in jobs for j in js) == sorted((n, s) for n in ("cora", "citeseer") for s in range(SEEDS))
    results = launch(planetoid_accuracies, (jobs,), nproc=2)
    return {job: acc for r in results.values() for job, acc in r.items()}


@pytest.mark.parametrize("name,goal", [("cora", 0.80), ("citeseer", 0.70)])
def test_graphsage_planetoid_accuracy(name, goal, planetoid_runs):
    """The issue's bars, unchanged.  CiteSeer's margin is small but not a matter of luck: over seeds 0-4 this
    protocol measured 0.702, 0.701, 0.703, 0.701, 0.703 (std 0.001, so the 3-seed mean's 0.2-point margin is
    about 3.5 standard errors); 200 epochs with the model chosen at every epoch did not do better (0.700 on
    seed 0): mean-aggregator GraphSAGE sits at about 70 % on CiteSeer's standard split."""
    accs = [planetoid_runs[(name, s)] for s in range(SEEDS)]
    print(f"GraphSAGE {name}: test accuracy {np.mean(accs):.4f} (seeds {accs})")
    assert np.mean(accs) >= goal, accs


def _config(out: Path, name: str, nproc: int, partitions: str | None) -> dict:
    return {"run": {"name": name, "out_dir": str(out), "steps": 8, "log_every": 1, "eval_every": 8, "seed": 5},
            "model": {"kind": "graphsage", "graph": "planetoid", "graph_path": str(DATA / "cora.npz"),
                      "hidden": 32, "dropout": 0.0, "fanouts": [200, 200], "partitions": partitions,
                      "feature_cache_rows": 100},
            "parallel": {"nproc": nproc}, "checkpoint": {"at_end": False},
            "train": {"global_batch": 160, "micro_batch": 160 // nproc, "lr": 0.01, "min_lr": 0.001,
                      "warmup_steps": 0, "weight_decay": 0.0, "grad_clip": 0.0}}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_partitions_follow_one_process(tmp_path):
    """fan-outs above Cora's largest degree sample every neighbour and 160 seeds a step take every training
    node, so each step is the same full-batch step on one process and over 2 partitions."""
    g = load_planetoid(DATA / "cora.npz")
    parts = tmp_path / "cora-2"
    write_partitions(g, assign(g, 2, "metis"), parts)
    one = parse_config(_config(tmp_path, "one", 1, None))
    run_worker(one)
    cfg = tmp_path / "two.json"
    cfg.write_text(json.dumps(_config(tmp_path, "two", 2, str(parts))))
    toml = tmp_path / "two.toml"
    toml.write_text(_toml(json.loads(cfg.read_text())))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "podscale", "train", str(toml)], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert len(a) == len(b) == 8
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-4 * max(1.0, abs(x["loss"])), (x["loss"], y["loss"])
    assert a[-1]["loss"] < a[0]["loss"]
    assert abs(a[-1]["val_test_accuracy"] - b[-1]["val_test_accuracy"]) <= 0.01
    assert b[-1]["val_remote_bytes_per_epoch"] > 0 and a[-1]["val_remote_bytes_per_epoch"] == 0
    assert b[-1]["val_sampled_edges_per_s"] > 0 and b[-1]["val_epoch_time_s"] > 0


def _toml(d: dict) -> str:
    lines = []
    for sec, vals in d.items():
        lines.append(f"[{sec}]")
        for k, v in vals.items():
            if v is None:
                continue
            lines.append(f"{k} = {json.dumps(v) if not isinstance(v, bool) else str(v).lower()}")
    return "\n".join(lines) + "\n"


def test_bad_gnn_configs_are_one_line(tmp_path):
    g = load_planetoid(DATA / "cora.npz")
    parts = tmp_path / "cora-2"
    write_partitions(g, assign(g, 2, "random"), parts)
    cases = [
        ({"fanouts": [10, 0]}, 1, "model.fanouts=[10, 0]: every fan-out must be a positive"),
        ({"fanouts": [10]}, 1, "has 1 entries but model.layers=2"),
        ({"partitions": str(parts)}, 4, "holds 2 partitions but there are 4 ranks"),
        ({"partitions": None}, 2, "dp=2 trains on partitions"),
        ({"graph": "sbm", "partitions": str(parts)}, 2, "partitions a graph of 2708 nodes"),
        ({"fanouts": [], "partitions": None}, 2, "dp=2 trains on partitions"),
    ]
    for change, nproc, message in cases:
        d = _config(tmp_path, "bad", nproc, str(parts))
        d["model"].update(change)
        d["train"]["micro_batch"] = 160 // nproc
        with pytest.raises(ConfigError) as err:
            c = parse_config(d)
            c.check_layout(nproc)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    # features of the wrong shape in an OGB-style folder
    raw = tmp_path / "ogb" / "raw"
    raw.mkdir(parents=True)
    np.savetxt(raw / "edge.csv", np.array([[0, 1], [1, 2]]), fmt="%d", delimiter=",")
    np.save(raw / "node-feat.npy", np.zeros((2, 4), dtype=np.float32))
    np.savetxt(raw / "node-label.csv", np.array([0, 1, 0]), fmt="%d")
    d = _config(tmp_path, "bad", 1, None)
    d["model"].update(graph="ogb", graph_path=str(tmp_path / "ogb"))
    with pytest.raises(ConfigError, match=r"features have shape \(2, 4\) but the graph has 3 nodes"):
        parse_config(d).check_layout(1)
