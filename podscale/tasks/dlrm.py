"""The DLRM task (``[model] kind = "dlrm"``): click prediction with DLRM over sharded embedding tables.

DLRM (Naumov et al. 2019) under the hybrid parallelism of its section 4: the MLPs are dense parameters
trained by podscale's data-parallel strategy (replicated, or ZeRO), the embedding tables are a
:class:`~podscale.table.ShardedEmbeddingBags` over the ``dp`` ranks whose rows are updated by their owners
with a sparse optimizer inside backward -- the Baidu parameter server's pull/push (Zhao et al., MLSys 2020)
with all-to-all in place of RPCs, and with a DRAM cache over an SSD tier when ``dram_budget_mb`` is set.

The trunk sees only the dense model; the tables are attached in :meth:`DLRMTask.bind`, saved and loaded
by :meth:`DLRMTask.save_state`/:meth:`DLRMTask.load_state` (:mod:`podscale.table.checkpoint`: full and
incremental, reshardable) and report their tiers in :meth:`DLRMTask.step_metrics`.  Each rank's loss is its
share's mean; the pooled embeddings' gradients are divided by the dp size so that every row's summed
gradient is that of the global batch's mean loss, as the dense gradients' all-reduce mean is.

Data (``model.data_format``): the Criteo-like generator of :mod:`podscale.table.data` (no file); a Criteo
TSV file (Criteo's Kaggle/Terabyte layout: label, 13 integer features, 26 categorical features as 32-bit
hex strings, tab-separated, empty fields allowed); MovieLens-100K's ``u.data`` (user, item, rating,
timestamp; click = rating >= 4) with ``u.user`` and ``u.item`` beside it when present.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from podscale.models.dlrm import DLRM, DLRMDense
from podscale.runtime import comm
from podscale.table import LazyAdam, RowWiseAdagrad, ShardedEmbeddingBags, SparseSGD, TableSpec
from podscale.runtime.errors import InputError
from podscale.table.checkpoint import TableCheckpointer
from podscale.table.data import CriteoLike, make_batch, slice_batch
from podscale.tasks.base import Task

Sparse = dict[str, tuple[torch.Tensor, torch.Tensor]]

CRITEO_DENSE, CRITEO_SPARSE = 13, 26
ML_GENRES = 19
VAL_STEP = 1 << 40  # generated validation batches are drawn from steps no training run reaches


# -- data ------------------------------------------------------------------------------------------------
def split_indices(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples (of ``n``, in file order) that :meth:`ClickArrays.split` keeps for training and holds
    out: a seeded permutation, its last ``val_fraction`` (at least one) held out."""
    perm = torch.from_numpy(np.random.default_rng(seed).permutation(n))
    n_val = max(1, int(round(n * val_fraction)))
    return perm[:-n_val], perm[-n_val:]


class ClickArrays:
    """A click log in memory: dense ``[N, d]``, per table jagged ids (values + offsets over N samples) and
    labels; :meth:`take` gathers any samples as one batch."""

    def __init__(self, dense: np.ndarray, sparse: dict[str, tuple[np.ndarray, np.ndarray]], labels: np.ndarray):
        self.dense = torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32))
        self.labels = torch.from_numpy(np.ascontiguousarray(labels, dtype=np.float32))
        self.sparse = {k: (torch.from_numpy(v.astype(np.int64)), torch.from_numpy(o.astype(np.int64)))
                       for k, (v, o) in sparse.items()}
        self.names = list(sparse)

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, idx: torch.Tensor):
        sparse = {}
        for k, (v, o) in self.sparse.items():
            ends = torch.cat([o[1:], torch.tensor([len(v)])])
            lens = (ends - o)[idx]
            starts = o[idx]
            offs = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)[:-1]])
            pos = torch.repeat_interleave(starts - offs, lens) + torch.arange(int(lens.sum()))
            sparse[k] = (v[pos], offs)
        return self.dense[idx], sparse, self.labels[idx]

    def split(self, val_fraction: float, seed: int) -> tuple["ClickArrays", "ClickArrays"]:
        """(train, validation): a seeded shuffle, the last ``val_fraction`` held out."""
        train, val = split_indices(len(self), val_fraction, seed)
        return self._subset(train), self._subset(val)

    def _subset(self, idx: torch.Tensor) -> "ClickArrays":
        d, s, y = self.take(idx)
        return ClickArrays(d.numpy(), {k: (v.numpy(), o.numpy()) for k, (v, o) in s.items()}, y.numpy())


def _one_per_sample(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return ids.astype(np.int64), np.arange(len(ids), dtype=np.int64)


def read_criteo_tsv(path: str | Path) -> ClickArrays:
    """A Criteo-format TSV file: ``label``, 13 integer features (missing or negative: 0; used as
    ``log(1 + x)`` as DLRM does), 26 categorical hex ids (tables ``C1``..``C26``; a missing one is an empty
    bag).  Raises ValueError naming the line for a malformed one."""
    labels, dense, cats = [], [], [[] for _ in range(CRITEO_SPARSE)]
    with open(path, encoding="ascii", errors="replace") as f:
        for n, line in enumerate(f, 1):
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 1 + CRITEO_DENSE + CRITEO_SPARSE:
                raise ValueError(f"line {n} has {len(parts)} tab-separated fields, not {1 + CRITEO_DENSE + CRITEO_SPARSE} "
                                 "(label, 13 integers, 26 hex categories)")
            try:
                labels.append(float(int(parts[0])))
                dense.append([max(0, int(x)) if x else 0 for x in parts[1: 1 + CRITEO_DENSE]])
                for j, x in enumerate(parts[1 + CRITEO_DENSE:]):
                    v = int(x, 16) if x else -1
                    if x and (v < 0 or x.startswith(("+", "-"))):
                        raise ValueError
                    cats[j].append(v)
            except ValueError:
                raise ValueError(f"line {n} is not a Criteo record (an integer label and features, hex "
                                 "categories)") from None
    sparse = {}
    for j, c in enumerate(cats):
        ids = np.asarray(c, dtype=np.int64)
        present = ids >= 0
        lens = present.astype(np.int64)
        sparse[f"C{j + 1}"] = (ids[present], np.concatenate([[0], np.cumsum(lens)[:-1]]))
    return ClickArrays(np.log1p(np.asarray(dense, dtype=np.float64)), sparse, np.asarray(labels))


def _ml_table(path: Path) -> tuple[list[str], list[list[str]]]:
    """A RecBole atomic file (``name:type`` header, tab-separated): (column names, rows)."""
    lines = path.read_text(encoding="latin-1").splitlines()
    head = [h.split(":")[0] for h in lines[0].split("\t")]
    return head, [line.split("\t") for line in lines[1:] if line]


def read_movielens(path: str | Path) -> ClickArrays:
    """MovieLens-100K; click = rating >= 4.  Either GroupLens' layout -- ``u.data`` (user, item, rating,
    timestamp) with ``u.user`` and ``u.item`` (``|``-separated, 19 genre flags) beside it -- or RecBole's
    atomic files -- ``ml-100k.inter`` with ``ml-100k.user`` and ``ml-100k.item`` (``name:type`` headers,
    genres as a space-separated ``class``).  Tables: ``user``, ``item``, ``genre`` (a bag of the item's
    genres), ``age`` (decade), ``gender``, ``occupation``, ``zip`` (first digit); dense: age / 50, the
    item's release year offset, its genre count, the hour of day.  Attribute files are optional."""
    path = Path(path)
    users: dict[int, tuple] = {}
    items: dict[int, tuple] = {}
    if path.suffix == ".inter":
        head, rows = _ml_table(path)
        col = {h: i for i, h in enumerate(head)}
        if not {"user_id", "item_id", "rating"} <= set(col):
            raise ValueError(f"{path} lacks user_id, item_id or rating columns (a RecBole .inter file)")
        raw = np.array([[int(r[col["user_id"]]), int(r[col["item_id"]]), int(float(r[col["rating"]])),
                         int(float(r[col["timestamp"]])) if "timestamp" in col else 0] for r in rows], dtype=np.int64)
        if path.with_suffix(".user").is_file():
            h, rs = _ml_table(path.with_suffix(".user"))
            c = {x: i for i, x in enumerate(h)}
            for r in rs:
                users[int(r[c["user_id"]])] = (int(r[c["age"]]), r[c["gender"]], r[c["occupation"]],
                                               r[c["zip_code"]][:1])
        if path.with_suffix(".item").is_file():
            h, rs = _ml_table(path.with_suffix(".item"))
            c = {x: i for i, x in enumerate(h)}
            for r in rs:
                year = r[c["release_year"]] if "release_year" in c and len(r) > c["release_year"] else ""
                genres = r[c["class"]].split() if "class" in c and len(r) > c["class"] else []
                items[int(r[c["item_id"]])] = (int(year) if year.isdigit() else 1990, genres)
    else:
        raw = np.loadtxt(path, dtype=np.int64, delimiter="\t", ndmin=2)
        if raw.shape[1] != 4:
            raise ValueError(f"{path} has {raw.shape[1]} columns, not 4 (user, item, rating, timestamp)")
        if (path.parent / "u.user").is_file():
            for line in (path.parent / "u.user").read_text(encoding="latin-1").splitlines():
                f = line.split("|")
                if len(f) >= 5:
                    users[int(f[0])] = (int(f[1]), f[2], f[3], f[4][:1])
        if (path.parent / "u.item").is_file():
            for line in (path.parent / "u.item").read_text(encoding="latin-1").splitlines():
                f = line.split("|")
                if len(f) >= 5 + ML_GENRES:
                    year = f[2][-4:]
                    items[int(f[0])] = (int(year) if year.isdigit() else 1990,
                                        [str(g) for g in range(ML_GENRES) if f[5 + g] == "1"])
    user, item, rating, ts = raw.T

    def code(s: str) -> int:
        return int.from_bytes(s.encode()[:7].ljust(7, b"\0"), "big")

    u_info = [users.get(int(u), (30, "?", "?", "?")) for u in user]
    i_info = [items.get(int(i), (1990, [])) for i in item]
    genre_lens = np.array([len(g) for _, g in i_info], dtype=np.int64)
    genre_vals = np.array([code(g) for _, gs in i_info for g in gs], dtype=np.int64)
    sparse = {"user": _one_per_sample(user), "item": _one_per_sample(item),
              "genre": (genre_vals, np.concatenate([[0], np.cumsum(genre_lens)[:-1]])),
              "age": _one_per_sample(np.array([a // 10 for a, *_ in u_info])),
              "gender": _one_per_sample(np.array([code(g) for _, g, _, _ in u_info])),
              "occupation": _one_per_sample(np.array([code(o) for _, _, o, _ in u_info])),
              "zip": _one_per_sample(np.array([code(z) for *_, z in u_info]))}
    hour = (ts // 3600) % 24
    dense = np.stack([np.array([a for a, *_ in u_info]) / 50.0,
                      (np.array([y for y, _ in i_info]) - 1990) / 10.0, genre_lens / 3.0, hour / 24.0], axis=1)
    return ClickArrays(dense, sparse, (rating >= 4).astype(np.float32))


def check_data_file(fmt: str, path: Path, head: bytes) -> None:
    """ValueError (the rest of a one-line message) when ``path``'s first line is not ``fmt``."""
    first = head.split(b"\n", 1)[0].decode("latin-1")
    if fmt == "generated":
        raise ValueError("is set but model.data_format = 'generated' reads no file: remove data.path or set "
                         "model.data_format to 'criteo-tsv' or 'movielens'")
    if fmt == "criteo-tsv" and len(first.split("\t")) != 1 + CRITEO_DENSE + CRITEO_SPARSE:
        raise ValueError(f"is not a Criteo TSV file: its first line has {len(first.split(chr(9)))} tab-separated "
                         "fields, not 40 (label, 13 integers, 26 hex categories)")
    if fmt == "movielens":
        f = first.split("\t")
        recbole = path.suffix == ".inter" and {"user_id", "item_id", "rating"} <= {x.split(":")[0] for x in f}
        if not recbole and (len(f) != 4 or not all(x.strip().isdigit() for x in f)):
            raise ValueError("is not MovieLens' u.data (user, item, rating, timestamp, tab-separated) nor a "
                             "RecBole .inter file: point data.path at u.data or ml-100k.inter")


class ClickSource:
    """Global batches by step: from the generator (a pure function of the step) or from arrays (epochs of
    a seeded permutation)."""

    def __init__(self, gen: CriteoLike | None = None, arrays: ClickArrays | None = None, seed: int = 0,
                 step_offset: int = 0):
        self.gen, self.arrays, self.seed, self.step_offset = gen, arrays, seed, step_offset

    def batch(self, step: int, size: int):
        if self.gen is not None:
            return make_batch(self.gen, self.step_offset + step, size)
        n = len(self.arrays)
        first = step * size
        idx = []
        while len(idx) < size:
            epoch, pos = divmod(first + len(idx), n)
            perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            idx.extend(perm[pos: pos + size - len(idx)].tolist())
        return self.arrays.take(torch.tensor(idx, dtype=torch.int64))


@dataclass
class ClickBatch:
    """One rank's share of a batch; ``next_sparse``: its share of the next batch's ids (prefetch)."""

    dense: torch.Tensor
    sparse: Sparse
    labels: torch.Tensor
    next_sparse: Sparse | None = None


class ClickLoader:
    """This rank's share of global batch ``step`` (the DataSource of the task), with the next batch's ids
    for prefetch; its position is the step."""

    def __init__(self, source: ClickSource, global_batch: int, dp_rank: int, dp_size: int):
        self.source, self.global_batch = source, global_batch
        self.lo = dp_rank * global_batch // dp_size
        self.hi = (dp_rank + 1) * global_batch // dp_size
        self.step = 0
        self._ahead = None

    def _share(self, step: int):
        return slice_batch(*self.source.batch(step, self.global_batch), self.lo, self.hi)

    def next_step(self) -> list[ClickBatch]:
        cur = self._ahead if self._ahead is not None and self._ahead[0] == self.step else (self.step,
                                                                                          self._share(self.step))
        nxt = (self.step + 1, self._share(self.step + 1))
        self._ahead = nxt
        self.step += 1
        d, s, y = cur[1]
        return [ClickBatch(d, s, y, nxt[1][1])]

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"step"}:
            raise ValueError(f"loader state {sorted(state)} is not a DLRM loader's (step): resume a DLRM run")
        self.step, self._ahead = int(state["step"]), None


# -- the task --------------------------------------------------------------------------------------------
def auc_score(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: the Mann-Whitney rank statistic, ties given their mean rank."""
    s = scores.double()
    order = torch.argsort(s)
    sorted_s = s[order]
    ranks = torch.empty_like(s)
    ranks[order] = torch.arange(1, len(s) + 1, dtype=torch.float64)
    # mean ranks over ties
    uniq, inv, counts = torch.unique(sorted_s, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    mean_rank = ends - (counts.double() - 1) / 2
    ranks[order] = mean_rank[inv]
    pos = labels > 0.5
    n1, n0 = int(pos.sum()), int((~pos).sum())
    if n1 == 0 or n0 == 0:
        return float("nan")
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


class DLRMTask(Task):
    """DLRM on click logs: batches are :class:`ClickBatch`; throughput in samples."""

    throughput_unit = "samples"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.m = cfg.model
        self.tables: ShardedEmbeddingBags | None = None
        self.checkpointer: TableCheckpointer | None = None
        self._arrays: tuple[ClickArrays, ClickArrays] | None = None
        self._steps = 0
        self.mesh = None

    # data ----------------------------------------------------------------------------------------------
    def generator(self) -> CriteoLike | None:
        m = self.m
        if m.data_format != "generated":
            return None
        if m.tables is None:
            return CriteoLike(num_dense=m.num_dense, alpha=m.alpha, min_ids=m.min_ids, max_ids=m.max_ids,
                              seed=m.data_seed, teacher_scale=m.teacher_scale)
        return CriteoLike(num_dense=m.num_dense, cardinalities=tuple(t.cardinality for t in m.tables),
                          names=tuple(t.name for t in m.tables), alpha=m.alpha, min_ids=m.min_ids,
                          max_ids=m.max_ids, seed=m.data_seed, teacher_scale=m.teacher_scale,
                          ranks_as_ids=m.declare_range)

    def arrays(self) -> tuple[ClickArrays, ClickArrays]:
        """(train, validation) of a file data set, read once."""
        if self._arrays is None:
            reader = read_criteo_tsv if self.m.data_format == "criteo-tsv" else read_movielens
            try:
                data = reader(self.cfg.data.path)
            except (ValueError, OSError) as err:  # damaged past the first line, or gone since the check
                raise InputError(f"data.path '{self.cfg.data.path}': {err}: fix or remove that record, or point "
                                 "data.path at an intact file") from None
            self._arrays = data.split(self.cfg.data.val_fraction, self.cfg.run.seed)
        return self._arrays

    def feature_names(self) -> list[str]:
        gen = self.generator()
        if gen is not None:
            return list(gen.names)
        if self.m.data_format == "criteo-tsv":
            return [f"C{j + 1}" for j in range(CRITEO_SPARSE)]
        return ["user", "item", "genre", "age", "gender", "occupation", "zip"]

    def num_dense(self) -> int:
        return {"generated": self.m.num_dense, "criteo-tsv": CRITEO_DENSE, "movielens": 4}[self.m.data_format]

    def train_data(self, dp_rank: int, dp_size: int) -> ClickLoader:
        gen = self.generator()
        src = ClickSource(gen=gen) if gen is not None else ClickSource(arrays=self.arrays()[0], seed=self.cfg.run.seed)
        return ClickLoader(src, self.cfg.train.global_batch, dp_rank, dp_size)

    def eval_data(self, dp_rank: int, dp_size: int) -> list[ClickBatch]:
        """``val_samples`` held-out samples (generated: from steps no training reaches; files: the split),
        in ``run.eval_batches`` batches, each rank its equal share."""
        gen = self.generator()
        if gen is not None:
            total = self.m.val_samples
            src = ClickSource(gen=gen, step_offset=VAL_STEP)
            full = [src.batch(b, total // self.cfg.run.eval_batches) for b in range(self.cfg.run.eval_batches)]
        else:
            val = self.arrays()[1]
            nb = self.cfg.run.eval_batches
            per = len(val) // nb
            full = [val.take(torch.arange(b * per, (b + 1) * per)) for b in range(nb)]
        out = []
        for d, s, y in full:
            per = len(y) // dp_size  # equal shares, so the scores gather evenly
            out.append(ClickBatch(*slice_batch(d, s, y, dp_rank * per, (dp_rank + 1) * per)))
        return out

    def to_device(self, batch: ClickBatch, device: torch.device) -> ClickBatch:
        # the ids stay on the host: the table's owners look them up there
        return ClickBatch(batch.dense.to(device, non_blocking=True), batch.sparse,
                          batch.labels.to(device, non_blocking=True), batch.next_sparse)

    # the model -----------------------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        m = self.m
        names = self.feature_names()
        dense = DLRMDense(self.num_dense(), len(names), m.embedding_dim, tuple(m.bottom_mlp), tuple(m.top_mlp))
        return DLRM(None, dense, names)

    def table_specs(self) -> list[TableSpec]:
        m = self.m
        budget = None if m.dram_budget_mb is None else int(m.dram_budget_mb * 2 ** 20)
        ssd = None if m.ssd_path is None else str(Path(m.ssd_path).expanduser() / self.cfg.run.name)
        sharding = {t.name: t.sharding for t in (m.tables or []) if t.sharding}
        cards = dict(zip(self.feature_names(), self.generator().cardinalities)) \
            if self.generator() is not None else {}
        return [TableSpec(name, m.embedding_dim, m.pooling, sharding.get(name, m.sharding),
                          num_keys=cards.get(name) if m.declare_range else None,
                          admit_after=m.admit_after, ttl_steps=m.ttl_steps, dram_budget_bytes=budget,
                          ssd_path=ssd, cache_policy=m.cache_policy, ssd_engine=m.ssd_engine,
                          storage=m.table_storage)
                for name in self.feature_names()]

    def sparse_optimizer(self):
        m = self.m
        return {"adagrad": RowWiseAdagrad, "sgd": SparseSGD, "adam": LazyAdam}[m.sparse_optimizer](m.sparse_lr)

    def bind(self, model: nn.Module, mesh) -> None:
        """The sharded tables over ``dp`` (fresh: any rows an earlier run left in the SSD tier are removed;
        a resumed run then loads its checkpoint's)."""
        self.mesh = mesh
        self.tables = ShardedEmbeddingBags(self.table_specs(), mesh, self.sparse_optimizer(), seed=self.cfg.run.seed,
                                           axes="dp")
        self.tables.clear()
        model.attach_tables(self.tables, grad_divisor=mesh.size("dp"))
        self.checkpointer = TableCheckpointer(self.tables, full_every=self.m.full_checkpoint_every)

    def model_config(self) -> dict:
        return self.m.model_dump()

    def describe(self, model: nn.Module) -> str:
        n = sum(p.numel() for p in model.parameters())
        return (f"DLRM {len(self.feature_names())} tables x dim {self.m.embedding_dim} ({self.m.sharding}-wise), "
                f"{n / 1e3:.1f}K dense params, global batch {self.cfg.train.global_batch} samples")

    # loss and metrics ---------------------------------------------------------------------------------
    def loss(self, module: nn.Module, batch: ClickBatch) -> torch.Tensor:
        logits = module(batch.dense, batch.sparse)
        if self.m.prefetch and batch.next_sparse is not None and torch.is_grad_enabled():
            self.tables.prefetch(batch.next_sparse)  # promoted while this batch's dense part trains
        return F.binary_cross_entropy_with_logits(logits.float(), batch.labels)

    def evaluate(self, engine, batches: list[ClickBatch]) -> dict[str, float]:
        """Log loss and AUC over the whole validation set (scores gathered over dp)."""
        scores, labels = [], []

        def metric(module, batch):
            logits = module(batch.dense, batch.sparse).float()
            scores.append(logits.detach())
            labels.append(batch.labels)
            return F.binary_cross_entropy_with_logits(logits, batch.labels)

        logloss = engine.evaluate(batches, self.on_device(metric, self.cfg.train.precision, engine.device))
        s, y = torch.cat(scores), torch.cat(labels)
        n = self.mesh.size("dp")
        both = torch.stack([s, y.to(s.dtype)])
        out = torch.empty(n * both.numel(), dtype=both.dtype, device=both.device)
        comm.all_gather(out, both.reshape(-1).contiguous(), self.mesh, "dp")
        g = out.reshape(n, 2, -1)
        return {"loss": logloss, "auc": auc_score(g[:, 0].reshape(-1).cpu(), g[:, 1].reshape(-1).cpu())}

    def step_metrics(self, model: nn.Module, mesh) -> dict[str, float]:
        """Per step, summed over ranks: the DRAM hit rate, rows read from the SSD synchronously (misses)
        and in all (with prefetch), and the bytes each tier holds (``bytes/tier0`` the top one)."""
        stats = self.tables.tier_stats()
        tiers = self.tables.tier_bytes()
        levels = max((len(b) for b in tiers.values()), default=1)
        v = [0.0] * (3 + levels)
        for st in stats.values():
            if st:
                v[0] += st[0].hits
                v[1] += st[0].misses
                v[2] += st[0].prefetched
        for b in tiers.values():
            for i, x in enumerate(b):
                v[3 + i] += x
        t = torch.tensor(v, dtype=torch.float64, device=self.mesh.device)
        comm.all_reduce(t, self.mesh, "dp")
        self.tables.reset_stats()
        hits, misses, pre = t[0].item(), t[1].item(), t[2].item()
        out = {f"bytes/tier{i}": float(x) for i, x in enumerate(t[3:].tolist())}
        if hits + misses:
            out.update({"tables/dram_hit_rate": hits / (hits + misses), "tables/ssd_reads_per_step": misses + pre,
                        "tables/ssd_sync_reads": misses})
        return out

    def units_per_sample(self) -> float:
        return 1

    def flops_per_sample(self) -> float:
        dense = sum(p.numel() for p in self.build_model().parameters())
        n = 1 + len(self.feature_names())
        interaction = 2 * n * n * self.m.embedding_dim
        return 6 * dense + 3 * interaction

    # tables in checkpoints ------------------------------------------------------------------------------
    def save_state(self, step_dir: Path, root: Path, step: int) -> None:
        self.checkpointer.save(step_dir, root, step)

    def load_state(self, step_dir: Path) -> None:
        self.checkpointer.load(step_dir)

    def close(self) -> None:
        if self.tables is not None:
            self.tables.close()
