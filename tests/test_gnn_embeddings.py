"""Learnable node embeddings of the GNN task (``model.node_embedding_dim``): rows of the sharded table,
fetched by node id in the sampled blocks and updated by their owners with the table's sparse optimizer.

* Over 2 METIS partitions (one launch of ``podscale train``) the run follows the one-process run of the same
  config step by step: the losses within 1e-4 (relative) and, at the end, every node's embedding row within
  1e-5 (the rows read back from both runs' table checkpoints, keyed by original node id).
* On an SBM graph with no features at all the embeddings alone learn the communities: test accuracy above
  0.5 with 4 balanced classes (chance 0.25).  Why 0.5: a test node's only input is its own embedding and its
  neighbours', which training moves only through the training nodes' 2-hop neighbourhoods; at homophily 0.8
  a majority vote of a node's neighbours' communities is right about 0.9 of the time, and this run measured
  0.78 (seed 5, under load); a model that learned nothing scores ~0.25 (std ~0.02 over 700 test nodes), so
  0.5 is more than 10 standard deviations from chance and well under what is reached.
* Bad settings fail with one line before workers start.
"""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from podscale.config import ConfigError, parse_config
from podscale.graph import sbm
from podscale.graph.partition import assign, load_book, write_partitions
from podscale.graph.store import NodeEmbeddings
from podscale.table.hashing import init_rows, name_seed
from podscale.table.checkpoint import export_tables
from podscale.train.loop import run_worker
from graph_workers import metric_rows, train_launched

STEPS = 6


def _config(out: Path, name: str, nproc: int, partitions: str | None, **model) -> dict:
    m = {"kind": "graphsage", "graph": "sbm", "nodes": 600, "features": 8, "classes": 4, "graph_seed": 3,
         "hidden": 16, "dropout": 0.0, "fanouts": [100, 100], "partitions": partitions,
         "node_embedding_dim": 8, "node_embedding_lr": 0.1}
    m.update(model)
    return {"run": {"name": name, "out_dir": str(out), "steps": STEPS, "log_every": 1, "eval_every": STEPS,
                    "seed": 5},
            "model": m, "parallel": {"nproc": nproc}, "checkpoint": {"at_end": True},
            "train": {"global_batch": 120, "micro_batch": 120 // nproc, "lr": 0.01, "min_lr": 0.001,
                      "warmup_steps": 0, "weight_decay": 0.0, "grad_clip": 0.0}}


def _embeddings(run: Path, out: Path) -> tuple[np.ndarray, np.ndarray]:
    """(keys, rows) of the node embeddings in the run's last checkpoint, through the serving export."""
    step = sorted((run / "checkpoints").glob("step_*"))[-1]
    index = json.loads((export_tables(step, out) / "index.json").read_text())
    t = load_file(out / index["tables"][0]["files"][0])
    return t["keys"].numpy(), t["weights"].numpy()


def test_embeddings_on_two_partitions_follow_one_process(tmp_path):
    """fan-outs above the graph's largest in-degree sample every neighbour and 120 seeds a step (60 a rank)
    take every training node (60), so each step is the same full-batch step on one process and over 2
    partitions; the embeddings (here beside 8 features) then move identically."""
    g = sbm(600, blocks=4, features=8, seed=3)
    assert int(np.diff(g.indptr).max()) < 100 and len(g.splits["train"]) == 60
    parts = tmp_path / "sbm-2"
    write_partitions(g, assign(g, 2, "metis"), parts)
    run_worker(parse_config(_config(tmp_path, "one", 1, None)))
    train_launched(tmp_path, _config(tmp_path, "two", 2, str(parts)))
    a, b = metric_rows(tmp_path / "one"), metric_rows(tmp_path / "two")
    assert len(a) == len(b) == STEPS
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-4 * max(1.0, abs(x["loss"])), (x["loss"], y["loss"])
    assert a[-1]["loss"] < a[0]["loss"]
    k1, w1 = _embeddings(tmp_path / "one", tmp_path / "export-one")
    k2, w2 = _embeddings(tmp_path / "two", tmp_path / "export-two")
    assert np.array_equal(k1, np.arange(g.num_nodes)) and np.array_equal(np.sort(k2), np.arange(g.num_nodes))
    orig = load_book(parts)["orig_id"]
    by_orig = np.empty_like(w2)
    by_orig[orig[k2]] = w2          # the 2-partition run keys rows by new id
    assert np.abs(by_orig - w1).max() <= 1e-5
    # the rows moved: the embeddings did train (the rows' initial values are drawn in [-1/sqrt(8), 1/sqrt(8)))
    start = init_rows(name_seed(5, NodeEmbeddings.NAME), torch.arange(g.num_nodes), 0, 8, 8 ** -0.5).numpy()
    assert np.abs(w1 - start).max() > 1e-2


def test_embeddings_learn_a_featureless_graph(tmp_path):
    d = _config(tmp_path, "featureless", 1, None, features=0, nodes=1000, node_embedding_dim=16)
    d["model"]["fanouts"] = [10, 5]
    d["run"].update(steps=30, eval_every=30)
    d["checkpoint"]["at_end"] = False
    d["train"].update(global_batch=100, micro_batch=100)
    run_worker(parse_config(d))
    last = metric_rows(tmp_path / "featureless")[-1]
    print(f"featureless SBM, embeddings only: test accuracy {last['val_test_accuracy']:.3f}")
    assert last["val_test_accuracy"] > 0.5, last


def test_bad_embedding_configs_are_one_line(tmp_path):
    cases = [
        ({"features": 0, "node_embedding_dim": 0}, {}, "has no node features: set node_embedding_dim"),
        ({"node_embedding_dim": -1}, {}, "node_embedding_dim"),
        ({"node_embedding_lr": 0.0}, {}, "node_embedding_lr"),
        ({"node_embedding_optimizer": "rmsprop"}, {}, "node_embedding_optimizer"),
        ({}, {"precision": "fp16"}, "the loss scale would reach the embeddings' sparse optimizer"),
        ({}, {"micro_batch": 60}, "a step takes one micro-batch: set train.micro_batch = 120"),
    ]
    for model, train, message in cases:
        d = _config(tmp_path, "bad", 1, None, **model)
        d["train"].update(train)
        with pytest.raises(ConfigError) as err:
            parse_config(d).check_layout(1)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
