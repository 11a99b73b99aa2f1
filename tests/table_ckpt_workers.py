"""Workers for the table checkpoint tests (importable by spawned ranks): train a few steps of sharded tables
under a fixed linear head, save full and incremental checkpoints, load them on another number of ranks and
another sharding, and report the next step's loss and the rows."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from podscale.runtime import comm
from podscale.runtime.mesh import Mesh
from podscale.runtime.process import init_process
from podscale.table import RowWiseAdagrad, ShardedEmbeddingBags, TableSpec
from podscale.table.checkpoint import TableCheckpointer

BATCH = 48
CARD = 300


DENSE_KEYS = (CARD - 1) * 7919 + 12  # the id range of batch(): (rank % CARD) * 7919 + 11


def specs(shardings: tuple[str, str], v_storage: str = "keyed") -> list[TableSpec]:
    return [TableSpec("u", 8, "sum", shardings[0], ttl_steps=1),  # TTL: the deltas carry deletions
            TableSpec("v", 6, "mean", shardings[1], storage=v_storage,
                      num_keys=DENSE_KEYS if v_storage == "dense" else None)]


def batch(step: int):
    rng = np.random.default_rng(500 + step)
    feats, score = {}, np.zeros(BATCH)
    for name in ("u", "v"):
        lens = rng.integers(1, 4, size=BATCH)
        ids = (rng.zipf(1.2, size=int(lens.sum())) - 1) % CARD * 7919 + 11
        offs = np.concatenate([[0], np.cumsum(lens)[:-1]])
        feats[name] = (torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(offs.astype(np.int64)))
        score += np.bincount(np.repeat(np.arange(BATCH), lens), weights=(ids % 5) - 2.0, minlength=BATCH)
    return feats, torch.from_numpy((score > 0).astype(np.float32))


def _share(feats, labels, lo, hi):
    out = {}
    for k, (v, o) in feats.items():
        ends = torch.cat([o[1:], torch.tensor([len(v)])])
        a, b = int(o[lo]), int(ends[hi - 1])
        out[k] = (v[a:b], o[lo:hi] - a)
    return out, labels[lo:hi]


def _step(emb, mesh, step: int, train: bool = True) -> float:
    """Loss of global batch ``step`` (the mean over all ranks' samples), then the update."""
    n, r = mesh.size("dp"), mesh.local_rank("dp")
    feats, labels = batch(step)
    f, y = _share(feats, labels, r * BATCH // n, (r + 1) * BATCH // n)
    g = torch.Generator().manual_seed(0)
    w = {"u": torch.randn(8, generator=g), "v": torch.randn(6, generator=g)}
    pooled = emb(f)
    logits = pooled["u"] @ w["u"] + pooled["v"] @ w["v"]
    loss = F.binary_cross_entropy_with_logits(logits, y, reduction="sum") / BATCH
    if train:
        loss.backward()
        emb.expire()
    total = loss.detach().reshape(1).clone()
    comm.all_reduce(total, mesh, "dp")
    return float(total)


def _rows(emb) -> dict:
    return {s.name: emb.local_rows(s.name) for s in emb.specs}


def run(phase: dict) -> dict:
    """``phase``: shardings, ``load`` (a checkpoint folder or None), ``first`` step, ``steps`` to train,
    ``saves`` {step: folder}, then the loss of the following step (reported, and trained)."""
    info = init_process()
    mesh = Mesh.build(info.device, dp=info.world_size)
    emb = ShardedEmbeddingBags(specs(tuple(phase["shardings"]), phase.get("v_storage", "keyed")), mesh,
                               RowWiseAdagrad(0.2), seed=1)
    ck = TableCheckpointer(emb, full_every=phase.get("full_every", 4))
    if phase.get("load"):
        ck.load(Path(phase["load"]))
    out = {"losses": [], "saved": {}}
    step = phase["first"]
    for _ in range(phase["steps"]):
        out["losses"].append(_step(emb, mesh, step))
        step += 1
        if str(step) in phase.get("saves", {}):
            d = Path(phase["saves"][str(step)])
            d.mkdir(parents=True, exist_ok=True)
            out["saved"][step] = ck.save(d, d.parent, step)
    out["rows"] = _rows(emb)  # the state the next step starts from
    out["next_loss"] = _step(emb, mesh, step, train=False)
    emb.close()
    return out
