"""Workers and a single-process reference for the sharded-table tests (importable by spawned ranks).

The model: several embedding-bag tables over Zipf-distributed arbitrary int64 ids, pooled, concatenated
and fed to a small MLP head; labels come from a hidden teacher (a fixed random score per key), so the
loss falls when the tables learn.  The reference is ``nn.EmbeddingBag`` on one process with the sparse
optimizer's updates written out plainly below.
"""
from __future__ import annotations

import functools
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from podscale.runtime import comm
from podscale.runtime.mesh import Mesh
from podscale.runtime.process import init_process
from podscale.table import LazyAdam, RowWiseAdagrad, ShardedEmbeddingBags, SparseSGD, TableError, TableSpec
from podscale.table.hashing import init_rows, name_seed
from podscale.table.embedding import plan_shards

SEED = 3
LR = {"sgd": 0.5, "adagrad": 0.1, "adam": 0.01}
DENSE_LR = 0.1


def make_optimizer(kind: str):
    return {"sgd": SparseSGD, "adagrad": RowWiseAdagrad, "adam": LazyAdam}[kind](LR[kind])


def default_specs() -> list[TableSpec]:
    return [TableSpec("users", 8, "sum", "row"), TableSpec("items", 4, "mean", "table"),
            TableSpec("tags", 6, "sum", "column")]


@functools.lru_cache(maxsize=16)
def _universe(name: str, card: int) -> np.ndarray:
    """``card`` arbitrary int64 keys for a table (sorted, unique, spread over [0, 2^62))."""
    rng = np.random.default_rng(abs(hash_name(name)) % (2 ** 32))
    keys = np.sort(rng.integers(0, 2 ** 62, size=card, dtype=np.int64))
    return keys[np.concatenate([[True], keys[1:] != keys[:-1]])]


def universe(name: str, card: int) -> np.ndarray:
    return _universe(name, card).copy()


def keys_of(spec: TableSpec, card: int) -> np.ndarray:
    """The keys a table's ids are drawn from: arbitrary int64 keys, or ``[0, card)`` for a dense-range
    table (``storage="dense"``)."""
    return np.arange(card, dtype=np.int64) if spec.storage == "dense" else universe(spec.name, card)


def dense_specs() -> list[TableSpec]:
    """default_specs() with the table- and column-wise tables in dense-range stores."""
    return [TableSpec("users", 8, "sum", "row"),
            TableSpec("items", 4, "mean", "table", num_keys=CARD["items"], storage="dense"),
            TableSpec("tags", 6, "sum", "column", num_keys=CARD["tags"], storage="dense")]


SPECS = {"default": default_specs, "dense": dense_specs}


def hash_name(name: str) -> int:
    return name_seed(0, name) >> 1


CARD = {"users": 400, "items": 60, "tags": 120}


def make_batch(step: int, batch: int, specs, max_len: int = 6, zipf: float = 1.3, card=None):
    """Global batch ``step``: per table (values, offsets) of arbitrary int64 keys, and labels."""
    card = card or CARD
    rng = np.random.default_rng(1000 + step)
    feats, score = {}, np.zeros(batch)
    for s in specs:
        keys = keys_of(s, card[s.name])
        lens = rng.integers(0, max_len + 1, size=batch)
        idx = (rng.zipf(zipf, size=int(lens.sum())) - 1) % len(keys)
        vals = keys[idx]
        offs = np.concatenate([[0], np.cumsum(lens)[:-1]])
        feats[s.name] = (torch.from_numpy(vals), torch.from_numpy(offs.astype(np.int64)))
        # hidden per-key score (of the table's arbitrary key at that rank, also for a dense-range table)
        teacher = ((universe(s.name, card[s.name])[idx] >> 7) % 5).astype(np.float64) - 2.0
        score += np.bincount(np.repeat(np.arange(batch), lens), weights=teacher, minlength=batch)
    labels = torch.from_numpy((score > 0).astype(np.float32))
    return feats, labels


def slice_batch(feats, labels, lo: int, hi: int):
    """Samples ``[lo, hi)`` of a global batch."""
    out = {}
    for name, (v, o) in feats.items():
        ends = torch.cat([o[1:], torch.tensor([len(v)])])
        a, b = int(o[lo]), int(ends[hi - 1])
        out[name] = (v[a:b], o[lo:hi] - a)
    return out, labels[lo:hi]


def head(in_dim: int) -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(in_dim, 16), nn.ReLU(), nn.Linear(16, 1))


# --------------------------------------------------------------------------------------------------
# the single-process reference
# --------------------------------------------------------------------------------------------------
def reference_run(kind: str, specs, steps: int, batch: int, column_bounds: dict[str, list[int]]):
    """nn.EmbeddingBag tables + the same head, sparse updates written out plainly; losses and rows."""
    tables, keys = {}, {}
    for s in specs:
        keys[s.name] = torch.from_numpy(keys_of(s, CARD[s.name]))
        bag = nn.EmbeddingBag(len(keys[s.name]), s.dim, mode=s.pooling)
        with torch.no_grad():
            bag.weight.copy_(init_rows(name_seed(SEED, s.name), keys[s.name], 0, s.dim, 1 / s.dim ** 0.5))
        tables[s.name] = bag
    mlp = head(sum(s.dim for s in specs))
    state = {s.name: (torch.zeros_like(tables[s.name].weight), torch.zeros_like(tables[s.name].weight))
             for s in specs}
    acc = {s.name: torch.zeros_like(tables[s.name].weight) for s in specs}  # row-wise, per column block
    touched = {s.name: torch.zeros(len(keys[s.name]), dtype=torch.bool) for s in specs}
    losses = []
    for step in range(1, steps + 1):
        feats, labels = make_batch(step, batch, specs)
        pooled = []
        idx = {}
        for s in specs:
            v, o = feats[s.name]
            idx[s.name] = torch.searchsorted(keys[s.name], v)
            pooled.append(tables[s.name](idx[s.name], o))
        logits = mlp(torch.cat(pooled, dim=1)).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        for p in list(mlp.parameters()) + [t.weight for t in tables.values()]:
            p.grad = None
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p in mlp.parameters():
                p -= DENSE_LR * p.grad
            for s in specs:
                w, g = tables[s.name].weight, tables[s.name].weight.grad
                rows = torch.unique(idx[s.name])
                touched[s.name][rows] = True
                gr = g[rows]
                if kind == "sgd":
                    w[rows] -= LR[kind] * gr
                elif kind == "adagrad":
                    b = column_bounds[s.name]
                    for c0, c1 in zip(b[:-1], b[1:]):
                        a = acc[s.name][rows, c0] + gr[:, c0:c1].pow(2).mean(dim=1)
                        acc[s.name][rows, c0] = a
                        w[rows, c0:c1] -= LR[kind] * gr[:, c0:c1] / (a.sqrt()[:, None] + 1e-8)
                else:
                    m, v = state[s.name]
                    m[rows] = 0.9 * m[rows] + 0.1 * gr
                    v[rows] = 0.999 * v[rows] + 0.001 * gr * gr
                    mhat = m[rows] / (1 - 0.9 ** step)
                    vhat = v[rows] / (1 - 0.999 ** step)
                    w[rows] -= LR[kind] * mhat / (vhat.sqrt() + 1e-8)
    rows = {s.name: (keys[s.name][touched[s.name]], tables[s.name].weight.detach()[touched[s.name]])
            for s in specs}
    return losses, rows


# --------------------------------------------------------------------------------------------------
# workers
# --------------------------------------------------------------------------------------------------
def _setup():
    info = init_process()
    torch.set_num_threads(1)
    mesh = Mesh.build(info.device, dp=info.world_size)
    return info, mesh


def _train(emb, mesh, specs, steps, batch, prefetch: bool = False, stats: bool = False, card=None):
    """Data-parallel head + sharded tables; returns global losses (and per-step DRAM misses)."""
    n, r = mesh.size("dp"), mesh.local_rank("dp")
    mlp = head(sum(s.dim for s in specs))
    per = batch // n
    losses, misses, waits = [], [], []
    nxt = make_batch(1, batch, specs, card=card)
    if prefetch:
        emb.prefetch(slice_batch(*nxt, r * per, (r + 1) * per)[0])
    for step in range(1, steps + 1):
        feats, labels = nxt
        local, lab = slice_batch(feats, labels, r * per, (r + 1) * per)
        if stats:
            emb.reset_stats()
        pooled = emb(local)
        if stats:
            st = [tiers[0] for tiers in emb.tier_stats().values()]
            misses.append(sum(s.misses for s in st))
            waits.append(sum(s.prefetch_wait_s for s in st))
        if step < steps:
            nxt = make_batch(step + 1, batch, specs, card=card)
            if prefetch:  # announce batch i+1 while batch i trains
                emb.prefetch(slice_batch(*nxt, r * per, (r + 1) * per)[0])
        logits = mlp(torch.cat([pooled[s.name] for s in specs], dim=1)).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits, lab, reduction="sum") / batch
        for p in mlp.parameters():
            p.grad = None
        loss.backward()
        with torch.no_grad():
            for p in mlp.parameters():
                comm.all_reduce(p.grad, mesh, "dp")
                p -= DENSE_LR * p.grad
            total = loss.detach().clone()
            comm.all_reduce(total, mesh, "dp")
        losses.append(total.item())
    return losses, misses, waits


def train_sharded(kinds: list[str], steps: int, batch: int, spec_set: str = "default") -> list[dict]:
    """For each optimizer kind: losses, and this rank's rows of every table."""
    info, mesh = _setup()
    specs = SPECS[spec_set]()
    out = []
    for kind in kinds:
        emb = ShardedEmbeddingBags(specs, mesh, make_optimizer(kind), seed=SEED)
        losses, _, _ = _train(emb, mesh, specs, steps, batch)
        rows = {s.name: emb.local_rows(s.name) for s in specs}
        out.append({"losses": losses, "rows": rows, "comm": mesh.stats.snapshot()})
    return out


def column_bounds(specs, n: int) -> dict[str, list[int]]:
    out = {}
    for s, shards in zip(specs, plan_shards(specs, n)):
        out[s.name] = [sh.c0 for sh in shards] + [s.dim] if s.sharding == "column" else [0, s.dim]
    return out


def _vm_hwm_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


BIG_DIM = 32
BIG_ROWS = 400_000


def big_specs(budget: int | None, path: str | None, engine: str = "log") -> list[TableSpec]:
    return [TableSpec("big", BIG_DIM, "sum", "row", dram_budget_bytes=budget, ssd_path=path, ssd_engine=engine)]


def train_big(budget: int | None, path: str | None, steps: int, batch: int, prefetch: bool = False,
              engine: str = "log"):
    """A table of BIG_ROWS rows loaded first, then trained; peak RSS growth from after the imports."""
    info, mesh = _setup()
    specs = big_specs(budget, path and os.path.join(path, f"r{info.rank}"), engine)
    card = {"big": BIG_ROWS}
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS counter (Linux >= 4.0)
    base_kb = _vm_hwm_kb()
    emb = ShardedEmbeddingBags(specs, mesh, RowWiseAdagrad(0.1), seed=SEED)
    keys = torch.from_numpy(universe("big", BIG_ROWS))
    chunk = 8192
    for i in range(0, len(keys), chunk):  # load in chunks, as a reader of a file would
        k = keys[i: i + chunk]
        emb.load_rows("big", k, init_rows(name_seed(SEED, "big"), k, 0, BIG_DIM, 1 / BIG_DIM ** 0.5))
    losses, misses, waits = _train(emb, mesh, specs, steps, batch, prefetch=prefetch,
                                   stats=budget is not None, card=card)
    peak_kb = _vm_hwm_kb()
    held = sum(len(s) for s in emb.stores.values())
    emb.close()
    return {"losses": losses, "growth_mb": (peak_kb - base_kb) / 1024, "misses": misses, "waits": waits,
            "rows_here": held, "row_bytes": 4 * emb.row_floats(0, emb.shards[0][0])}


def bad_inputs(ssd_root: str) -> dict[str, str]:
    """Each bad input on one rank only; every rank must raise the same line, and the store stay intact."""
    info, mesh = _setup()
    r = info.rank
    out = {}
    specs = [TableSpec("t", 4, "sum", "row", num_keys=1000)]
    emb = ShardedEmbeddingBags(specs, mesh, SparseSGD(0.1), seed=SEED)
    good = {"t": (torch.tensor([1, 2, 3, 500]), torch.tensor([0, 2]))}
    emb(good)["t"].sum().backward()
    before = emb.local_rows("t")

    def attempt(label, fn):
        try:
            fn()
            out[label] = "no error"
        except TableError as e:
            out[label] = str(e)

    neg = {"t": (torch.tensor([1, -5] if r == 1 else [1, 2]), torch.tensor([0, 1]))}
    attempt("negative", lambda: emb(neg))
    big = {"t": (torch.tensor([1, 1000] if r == 1 else [1, 2]), torch.tensor([0, 1]))}
    attempt("range", lambda: emb(big))
    offs = {"t": (torch.tensor([1, 2]), torch.tensor([0, 5] if r == 1 else [0, 1]))}
    attempt("offsets", lambda: emb(offs))
    after = emb.local_rows("t")
    out["consistent"] = all(torch.equal(a[0], b[0]) and torch.equal(a[3], b[3]) for a, b in zip(before, after))
    emb(good)["t"].sum().backward()  # the table still works after the errors
    out["steps_after"] = emb.step_count
    # a DRAM budget of 4 rows per shard, a batch that needs more
    tiny = [TableSpec("t", 4, "sum", "row", dram_budget_bytes=4 * 4 * (4 + 1) * 4,
                      ssd_path=os.path.join(ssd_root, f"budget{r}"))]
    emb2 = ShardedEmbeddingBags(tiny, mesh, SparseSGD(0.1), seed=SEED)
    ids = torch.arange(100) + 1000 * r
    attempt("budget", lambda: emb2({"t": (ids, torch.tensor([0]))}))
    out["budget_rows"] = sum(len(s) for s in emb2.stores.values())
    emb2.close()
    # an SSD path that cannot be created on rank 1
    blocker = os.path.join(ssd_root, "a-file")
    open(blocker, "w").close()
    path = os.path.join(blocker, "sub") if r == 1 else os.path.join(ssd_root, "ok")
    attempt("ssd", lambda: ShardedEmbeddingBags(
        [TableSpec("t", 4, dram_budget_bytes=1 << 16, ssd_path=path)], mesh, SparseSGD(0.1)))
    return out


def ssd_overwriter(path: str, engine: str, args: dict, ready) -> None:
    """Overwrite the same 2000 rows of an SSD store with generation 1, 2, 3, ... (one atomic write batch
    each) until killed; ``ready`` is set once 3 batches are written."""
    from podscale.storage import SSD_ENGINES

    s = SSD_ENGINES[engine](path, 64, **args)
    keys = torch.arange(2000, dtype=torch.int64)
    g = 0
    while True:
        g += 1
        s.put(keys, torch.full((2000, 64), float(g)))
        if g == 3:
            ready.set()
