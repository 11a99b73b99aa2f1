"""Sharded key -> row tables over the mesh: pooled embedding bags for recommendation, rows by key for GNNs.

One sharded table (DESIGN.md, principle 5).  Several tables, each of ``dim`` columns, keyed by arbitrary
int64 ids: a shard maps key -> row in its :class:`~podscale.storage.rows.RowStore` and grows as new keys
arrive, so there is no hashing into a fixed row space and no collision.  Rows are placed

* row-wise: each key lives on rank ``hash(key) mod n`` (:func:`~podscale.table.hashing.owner_of`);
* table-wise: the whole table on one rank (tables spread round-robin);
* column-wise: the table's columns cut into blocks, each block (all keys) on its own rank.

A lookup (``forward``) deduplicates each rank's ids per table, sends them to their owners with one
``all_to_all_single`` (ids, with occurrence counts for admission), and receives the rows with a second one;
the bags are then pooled (sum or mean, as ``nn.EmbeddingBag``) over the jagged per-sample id lists
(``values`` + ``offsets``).  In backward the summed gradient of each deduplicated row goes back to its
owner with a third ``all_to_all_single`` and the owner applies the sparse optimizer to the touched rows
only, fused into the push (no gradient tensor for the table ever exists).  This is the data flow of
DLRM's model-parallel embeddings (Naumov et al., "Deep Learning Recommendation Model for Personalization
and Recommendation Systems", 2019, section 4) and of the Baidu parameter server's pull/push (Zhao et al.,
MLSys 2020), with all-to-all in place of parameter-server RPCs.

Table- and column-wise bags take the *pooled exchange* instead (TorchRec's data flow for those shardings):
each bag's ids go to the owner, the owner deduplicates them over all sources, pools the bags over its rows
and returns ``[bags, width]`` per table; in backward the bags' gradients go back to the owner, which
expands them to rows (:meth:`Dedup.rows_grad`) and applies the sparse update.  Under Zipf ids a bag's
pooled row is fewer bytes than its distinct rows, and the pooling runs where the rows are.  Row-wise
tables keep the row exchange (a bag spans owners).  Both ride the same collectives: one id exchange, one
reply and one gradient exchange per step for all tables.

A shard's rows live in a :class:`~podscale.storage.rows.RowStore` chosen from its spec: the keyed store
(arbitrary int64 keys, rows created as keys arrive; admission, TTL and the SSD tier) or, for a table that
declares ``num_keys`` and ``storage="dense"``, :class:`~podscale.storage.dense.DenseRowStore` (the key is
the slot and every row exists from the start: no index search and no row creation in a step).

Rows start from :func:`~podscale.table.hashing.init_rows` of (seed, table, key, column), so any sharding
of any world size holds identical rows.  Admission (a key gets a row only after ``admit_after``
occurrences and reads zeros until then, as Monolith and PaddlePaddle do) and TTL expiry are per table.

Bad input -- negative ids, ids outside a declared range, a batch whose rows do not fit a shard's DRAM
budget, an SSD path that cannot be written -- raises :class:`TableError` with the same one-line message
on every rank: each rank's verdict on its ids travels with the split sizes of the first ``all_to_all`` (so
agreeing costs no collective of its own), the verdicts on the budget and the stores (only for tables with
a cache tier) with a 4-integer all-gather, each before the collective that would otherwise hang, and
nothing is written to a store before the verdict on the ids and the budget.  A store
that fails while reading or creating rows is agreed before the row exchange; one that fails while writing
the update (after the step's last collective) is recorded and raised by every rank at the next lookup.
Each write to the SSD tier is one atomic RocksDB write batch and a cache keeps a copy of each dirty row it
evicts until that row is written down (written in the background; a failed write keeps it, readable, and is
raised at the next lookup), so a failure leaves every row at its old or its new value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from podscale.runtime import comm
from podscale.runtime.errors import InputError
from podscale.sortunique import argsort_unique, unique
from podscale.storage.dense import DenseRowStore
from podscale.storage import SSD_ENGINES
from podscale.storage.rows import CachedRowStore, MemoryRowStore, RowStore, StorageError, TierStats
from podscale.table.base import ShardedTable
from podscale.table.hashing import KeyOwner, init_rows, name_seed, owner_of
from podscale.table.optim import SparseOptimizer

SHARDINGS = ("row", "table", "column")
POOLINGS = ("sum", "mean")
STORAGES = ("keyed", "dense")


class TableError(InputError):
    """Bad ids or a table configuration that cannot work, raised on every rank with the same line."""


@dataclass(frozen=True)
class TableSpec:
    """One table.  ``num_keys`` declares the id range ``[0, num_keys)`` (None: any non-negative int64).

    Storage: without ``dram_budget_bytes`` every row of a shard is in memory; with it, a shard keeps at
    most that many bytes of rows (weights, optimizer state and a last-used step) in a DRAM cache over an
    SSD tier in ``ssd_path/<table>/shard-<rank>``, whose engine is ``ssd_engine``: ``"log"`` (the default,
    storage/log.py: an append-only log of row records, its key index in DRAM) or ``"rocksdb"`` (RocksDB
    through rocksdict: the index on disk too, for more keys than DRAM can index).  ``device_budget_bytes``
    adds a cache on the mesh's GPU above the DRAM tier (ignored on a CPU).
    """

    name: str
    dim: int
    pooling: str = "sum"
    sharding: str = "row"
    column_blocks: int | None = None  # column-wise: number of blocks (default: the number of ranks)
    num_keys: int | None = None
    init_scale: float | None = None   # rows start uniform in [-s, s); default 1/sqrt(dim)
    trainable: bool = True
    admit_after: int = 0              # occurrences before a key gets a row (0 or 1: at once)
    ttl_steps: int | None = None      # rows unused for this many steps are removed by expire()
    dram_budget_bytes: int | None = None
    ssd_path: str | None = None
    cache_policy: str = "lru"
    ssd_engine: str = next(iter(SSD_ENGINES))
    device_budget_bytes: int | None = None
    storage: str = "keyed"            # "dense": ids in [0, num_keys), rows created up front (storage/dense.py)

    def check(self) -> None:
        """Raise TableError (one line, the fix) for settings that cannot work; same on every rank."""
        where = f"table '{self.name}'"
        if self.dim < 1:
            raise TableError(f"{where}: dim={self.dim} must be a positive integer")
        if self.pooling not in POOLINGS:
            raise TableError(f"{where}: pooling '{self.pooling}' must be one of {', '.join(POOLINGS)}")
        if self.sharding not in SHARDINGS:
            raise TableError(f"{where}: sharding '{self.sharding}' must be one of {', '.join(SHARDINGS)}")
        if self.num_keys is not None and self.num_keys < 1:
            raise TableError(f"{where}: num_keys={self.num_keys} must be positive (or None for any id)")
        if self.dram_budget_bytes is not None and self.ssd_path is None:
            raise TableError(f"{where}: dram_budget_bytes needs an SSD tier below it: set ssd_path")
        if self.cache_policy not in ("lru", "lfu"):
            raise TableError(f"{where}: cache_policy '{self.cache_policy}' must be lru or lfu")
        if self.ssd_engine not in SSD_ENGINES:
            raise TableError(f"{where}: ssd_engine '{self.ssd_engine}' must be one of {', '.join(SSD_ENGINES)}")
        if self.storage not in STORAGES:
            raise TableError(f"{where}: storage '{self.storage}' must be one of {', '.join(STORAGES)}")
        if self.storage == "dense":
            fix = "use storage='keyed'"
            broken = dense_store_rule_broken(self.num_keys is not None, self.sharding == "row",
                                             self.admit_after > 1 or self.ttl_steps is not None
                                             or self.dram_budget_bytes is not None)
            if broken == "range":
                raise TableError(f"{where}: storage='dense' needs the id range: set num_keys (or {fix})")
            if broken == "row-wise":
                raise TableError(f"{where}: storage='dense' needs table- or column-wise sharding (a row-wise "
                                 f"shard holds hashed keys, not a range): change sharding or {fix}")
            if broken == "tiers":
                raise TableError(f"{where}: storage='dense' holds every row in memory from the start, so "
                                 f"admit_after, ttl_steps and dram_budget_bytes do not apply: {fix}")


def dense_store_rule_broken(declared_range: bool, row_wise: bool, admits_expires_or_budgets: bool) -> str | None:
    """The dense-range store's rules, written once (``TableSpec.check`` and the DLRM config word them in their
    own keys): the id is the slot, so the range must be declared ("range"); a row-wise shard holds hashed keys,
    not a range ("row-wise"); every row exists from the start, so admission, TTL and a DRAM budget have nothing
    to act on ("tiers").  Returns the first rule broken, or None."""
    if not declared_range:
        return "range"
    if row_wise:
        return "row-wise"
    if admits_expires_or_budgets:
        return "tiers"
    return None


@dataclass(frozen=True)
class Shard:
    """A piece of one table: all of its keys (or those hashing to ``rank``) and columns ``[c0, c1)``."""

    table: int
    index: int
    rank: int      # index of the owner in the table group
    c0: int
    c1: int
    hashed: bool   # row-wise: holds only the keys with owner_of(key) == rank

    @property
    def width(self) -> int:
        return self.c1 - self.c0


def plan_shards(specs: list[TableSpec], n: int) -> list[list[Shard]]:
    """The shards of every table on ``n`` ranks (the same on every rank)."""
    out: list[list[Shard]] = []
    load = [0] * n  # columns placed per rank, to spread table-wise tables by size
    for t, s in enumerate(specs):
        if s.sharding == "row":
            shards = [Shard(t, r, r, 0, s.dim, True) for r in range(n)]
        elif s.sharding == "table":
            r = min(range(n), key=lambda i: (load[i], i))
            load[r] += s.dim
            shards = [Shard(t, 0, r, 0, s.dim, False)]
        else:
            blocks = min(s.column_blocks or n, s.dim)
            bounds = [round(s.dim * j / blocks) for j in range(blocks + 1)]
            shards = [Shard(t, j, (t + j) % n, bounds[j], bounds[j + 1], False) for j in range(blocks)]
        out.append(shards)
    return out


@dataclass
class _Segment:
    """Ids of one table sent to one shard: positions in that table's deduplicated ids."""

    table: int
    shard: Shard
    pos: torch.Tensor
    whole: bool = False  # pos is every deduplicated id of the table, in order (slices, not gathers)


@dataclass
class _Received:
    """What an owner received for one local shard in this step."""

    keys: torch.Tensor          # deduplicated keys, sorted
    rows: torch.Tensor          # full stored rows [n, width + state + 1]
    admitted: torch.Tensor      # bool [n]: has a row (created now or before)
    every: bool = False         # admitted.all(): no masking needed
    parts: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)  # (src, start, count, inv)


@dataclass
class _Bags:
    """The bags of one table- or column-wise shard this rank owns, from every source, in one step: the
    owner pools them (the pooled exchange) and, in backward, expands their gradients to rows."""

    rec: _Received              # the bags' ids deduplicated over all sources, and their rows
    ids: "Dedup"                # every received id (sources in rank order) against rec.keys
    offsets: torch.Tensor       # each received bag's start in the ids


@dataclass
class _Step:
    """One lookup's routing, kept for its backward push."""

    tables: list[int]
    uniq: dict[int, torch.Tensor]
    segments: list[list[_Segment]]   # per destination
    send_floats: list[int]           # row floats this rank receives from each destination
    recv_floats: list[int]           # row floats this rank sends to each source
    received: dict[tuple[int, int], _Received]
    src_layout: list[list[tuple[tuple[int, int], int]]]  # per source: (shard key, count) in arrival order
    # the pooled exchange (table- and column-wise bags)
    bag_tables: list[int] = field(default_factory=list)
    bag_sent: list[list[tuple[Shard, int]]] = field(default_factory=list)  # per destination: (shard, bags)
    bags: dict[tuple[int, int], _Bags] = field(default_factory=dict)
    bag_from: list[list[tuple[tuple[int, int], int]]] = field(default_factory=list)  # per source: (key, bags)


class _Exchange(torch.autograd.Function):
    """Identity on the looked-up rows whose backward pushes their gradients to the owners."""

    @staticmethod
    def forward(ctx, anchor, owner, step, *rows):
        ctx.owner, ctx.step = owner, step
        return tuple(r.clone() for r in rows)

    @staticmethod
    def backward(ctx, *grads):
        ctx.owner._push(ctx.step, grads)
        return (None, None, None) + (None,) * len(grads)


class _BagPool(torch.autograd.Function):
    """Pooled bags (``nn.EmbeddingBag``'s sum or mean) of deduplicated ``rows`` over ``offsets`` (``ids``:
    the batch's ids against the rows), whose backward sums each row's share of its bags' gradients with
    :meth:`Dedup.rows_grad` (the ids are sorted already, so ATen's dense embedding-bag backward, which sorts
    and counts them first, would repeat that work)."""

    @staticmethod
    def forward(ctx, rows, ids, offsets, mode):
        ctx.save_for_backward(offsets)
        ctx.mode, ctx.ids = mode, ids
        return F.embedding_bag(ids.inv, rows, offsets, mode=mode)

    @staticmethod
    def backward(ctx, g):
        (offsets,) = ctx.saved_tensors
        return ctx.ids.rows_grad(g, offsets, ctx.mode), None, None, None


def _distinct(keys: torch.Tensor) -> torch.Tensor:
    """The distinct ``keys``, sorted (:func:`podscale.sortunique.unique`: one sort)."""
    return torch.from_numpy(unique(keys.numpy()))


@dataclass
class Dedup:
    """Distinct ids of a batch by one sort: ``keys`` (sorted), each id's position ``inv`` in them, the
    sorting permutation ``perm`` and each distinct key's first place ``starts`` in the sorted ids."""

    keys: torch.Tensor
    inv: torch.Tensor
    perm: torch.Tensor
    starts: torch.Tensor

    @staticmethod
    def of(ids: torch.Tensor) -> "Dedup":
        # numpy's introsort (podscale.sortunique): a few times faster here than torch.unique on the CPU
        return Dedup(*(torch.from_numpy(x) for x in argsort_unique(ids.numpy())))

    def counts(self) -> torch.Tensor:
        return torch.diff(self.starts, append=self.starts.new_tensor([len(self.inv)]))

    def rows_grad(self, g: torch.Tensor, offsets: torch.Tensor, mode: str) -> torch.Tensor:
        """The gradient of the distinct rows from that of the bags ``g [bags, dim]`` the ids were pooled
        into (``offsets``: each bag's first id): each row gathers its ids' bags in sorted order, so the
        sum is one ``embedding_bag`` over ``g`` (ATen's fused CPU kernel) instead of a scatter-add."""
        if len(self.inv) == 0:
            return g.new_zeros(0, g.shape[1])
        lengths = torch.diff(offsets, append=offsets.new_tensor([len(self.inv)]))
        col = torch.repeat_interleave(torch.arange(len(offsets)), lengths)[self.perm]
        weights = None
        if mode == "mean":
            weights = (1.0 / lengths.clamp(min=1).to(g.dtype))[col]
        return F.embedding_bag(col, g.contiguous(), self.starts, mode="sum", per_sample_weights=weights)


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def scale_grad(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """``rows`` unchanged; their gradient multiplied by ``scale`` on the way back.  A model whose dense
    parameters are averaged over dp ranks scales its looked-up rows' gradients by ``1 / dp`` this way, so
    the owners' sparse optimizer sees the same mean gradient (DLRM's pooled bags, GNN node embeddings)."""
    return _ScaleGrad.apply(rows, scale)


class ShardedEmbeddingBags(nn.Module, ShardedTable):
    """Several sharded tables over the ranks of ``axes`` of ``mesh``; every rank calls every method.

    ``forward({name: (values, offsets)})`` returns ``{name: [batch, dim]}`` pooled bags; ``lookup({name:
    ids})`` returns ``{name: [len(ids), dim]}`` rows (the feature-store read).  Both are differentiable for
    trainable tables: backward updates the owners' rows with ``optimizer``.
    """

    def __init__(self, specs: list[TableSpec], mesh, optimizer: SparseOptimizer | None = None,
                 seed: int = 0, axes: str | tuple[str, ...] = "dp", owner: KeyOwner | None = None):
        super().__init__()
        # row-wise placement: hash(key) mod n by default; a caller that knows where its keys belong passes
        # its own (the GNN feature store: the partition book, so each node's row lives with its partition)
        self._owner: KeyOwner = owner or owner_of
        self.specs = list(specs)
        self.mesh, self.axes, self.seed = mesh, axes, seed
        self.optimizer = optimizer
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise TableError(f"table names {names} repeat: give every table its own name")
        for s in self.specs:
            s.check()
        if optimizer is None and any(s.trainable for s in self.specs):
            raise TableError("trainable tables need a sparse optimizer: pass optimizer=RowWiseAdagrad(lr) "
                             "(or SparseSGD / LazyAdam), or set trainable=False")
        self.index = {s.name: t for t, s in enumerate(self.specs)}
        ax = (axes,) if isinstance(axes, str) else tuple(axes)
        self.n = mesh.size(*ax)
        self.me = mesh.local_rank(*ax)
        self.shards = plan_shards(self.specs, self.n)
        # any table with a cache tier over a lower one (the same on every rank: it follows the specs)
        self._tiered = any(s.dram_budget_bytes is not None or
                           (s.device_budget_bytes is not None and mesh.device.type == "cuda") for s in self.specs)
        self._seeds = [name_seed(seed, s.name) for s in self.specs]
        self._updates = [0] * len(self.specs)   # per table: optimizer steps so far (Adam's bias correction)
        self.step_count = 0                      # training lookups so far (the clock of TTL)
        self._deferred = (0, 0, 0)               # a store error of the last update, raised at the next lookup
        self._deferred_text = ""
        self._counts: dict[tuple[int, int], dict[int, int]] = {}  # admission: occurrences of unadmitted keys
        self.stores: dict[tuple[int, int], RowStore] = {}
        # incremental checkpoints: per local shard, keys written / deleted since the last mark_saved()
        self._changed: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._deleted: dict[tuple[int, int], list[torch.Tensor]] = {}
        # A store that cannot be opened on one rank is an error on all of them.
        err = (0, 0, 0)
        for t, shards in enumerate(self.shards):
            for sh in shards:
                if sh.rank == self.me:
                    try:
                        self.stores[(t, sh.index)] = self._make_store(self.specs[t], sh)
                        self._counts[(t, sh.index)] = {}
                        self._changed[(t, sh.index)] = []
                        self._deleted[(t, sh.index)] = []
                    except StorageError:
                        err = (5, t, 0)
        try:
            self._agree(*err)
        except TableError:
            self.close()
            raise
        # An anchor parameter-free tensor that requires grad, so backward reaches _Exchange.
        self._anchor = torch.zeros((), requires_grad=True)

    # -- construction ---------------------------------------------------------------------------------
    def row_floats(self, t: int, sh: Shard) -> int:
        """Floats stored per row of shard ``sh``: weights, optimizer state, last-used step."""
        state = self.optimizer.state_width(sh.width) if self.specs[t].trainable else 0
        return sh.width + state + 1

    def _make_store(self, spec: TableSpec, sh: Shard) -> RowStore:
        width = self.row_floats(sh.table, sh)
        if spec.storage == "dense":
            store: RowStore = DenseRowStore(spec.num_keys, width, lambda keys: self._fresh_rows(sh, keys))
        elif spec.dram_budget_bytes is None:
            store: RowStore = MemoryRowStore(width)
        else:
            path = Path(spec.ssd_path) / spec.name / f"shard-{sh.index}"
            store = CachedRowStore(SSD_ENGINES[spec.ssd_engine](path, width), spec.dram_budget_bytes,
                                   spec.cache_policy)
        if spec.device_budget_bytes is not None and self.mesh.device.type == "cuda":
            store = CachedRowStore(store, spec.device_budget_bytes, spec.cache_policy, device=self.mesh.device)
        return store

    # -- agreement ------------------------------------------------------------------------------------
    def _exchange(self, send: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        """``all_to_all_single`` of host tensor ``send`` over the table's axes, through the mesh's device
        (NCCL exchanges only device tensors; the shards' rows live on the host); the result on the host."""
        dev = self.mesh.device
        out = torch.empty(sum(out_splits), dtype=send.dtype, device=dev)
        comm.all_to_all(out, send.contiguous().to(dev), self.mesh, self.axes, out_splits, in_splits)
        return out.cpu()

    def _agree(self, code: int, t: int, value: int) -> None:
        """Exchange every rank's verdict; raise the first rank's error on all ranks."""
        mine = torch.tensor([code, t, value, self.me], dtype=torch.int64, device=self.mesh.device)
        allv = torch.empty(4 * self.n, dtype=torch.int64, device=self.mesh.device)
        comm.all_gather(allv, mine, self.mesh, self.axes)
        allv = allv.cpu()
        for r in range(self.n):
            c, tt, v, rank = allv[4 * r: 4 * r + 4].tolist()
            if c:
                raise TableError(self._message(c, tt, v, rank))

    def _message(self, code: int, t: int, v: int, rank: int) -> str:
        s = self.specs[t]
        where = f"table '{s.name}'"
        if code == 1:
            return f"{where}: id {v} on rank {rank} is negative: ids are non-negative int64 keys"
        if code == 2:
            return (f"{where}: id {v} on rank {rank} is outside the declared range [0, {s.num_keys}): "
                    "fix the ids or raise num_keys")
        if code == 3:
            sh = self.shards[t][v // (1 << 40)]
            rows = v % (1 << 40)
            per = 4 * self.row_floats(t, sh)
            return (f"{where}: one batch needs {rows} rows in shard {sh.index} (rank {sh.rank}) but its DRAM "
                    f"budget of {s.dram_budget_bytes} B holds {s.dram_budget_bytes // per}: raise "
                    f"dram_budget_bytes to at least {rows * per} B or use smaller batches")
        if code == 4:
            return f"{where}: offsets on rank {rank} are not non-decreasing and within the values: fix the batch"
        if code == 6:
            local = f" ({self._deferred_text})" if self._deferred_text else ""
            return (f"{where}: the last update could not be written to the SSD tier on rank {rank}{local}: "
                    "free space on that disk or move ssd_path, then resume from the last checkpoint")
        if code == 7:
            local = f" ({self._deferred_text})" if self._deferred_text else ""
            return (f"{where}: a lookup could not read or write the SSD tier on rank {rank}{local}: free space "
                    "on that disk or move ssd_path")
        if code == 5:
            return (f"{where}: the SSD tier under {s.ssd_path} is not writable on rank {rank}: set ssd_path "
                    "to a writable directory")
        return f"{where}: error {code} on rank {rank}"

    def _check_ids(self, t: int, ids: torch.Tensor) -> tuple[int, int, int]:
        if len(ids) == 0:
            return 0, 0, 0
        s = self.specs[t]
        lo = int(ids.min())
        if lo < 0:
            return 1, t, lo
        if s.num_keys is not None:
            hi = int(ids.max())
            if hi >= s.num_keys:
                return 2, t, hi
        return 0, 0, 0

    # -- routing ----------------------------------------------------------------------------------------
    def _route(self, ids: dict[int, torch.Tensor]):
        """Deduplicate per table (a :class:`Dedup` per table: the pooling and its backward reuse it) and
        split into per-destination segments."""
        uniq, inv, counts = {}, {}, {}
        segments: list[list[_Segment]] = [[] for _ in range(self.n)]
        for t, v in ids.items():
            dd = Dedup.of(v)
            uniq[t], inv[t], counts[t] = dd.keys, dd, dd.counts()
            u = dd.keys
            shards = self.shards[t]
            if shards[0].hashed:
                own = self._owner(u, self.n)
                for sh in shards:
                    pos = (own == sh.rank).nonzero().reshape(-1)
                    if len(pos):
                        segments[sh.rank].append(_Segment(t, sh, pos))
            else:
                pos = torch.arange(len(u))
                for sh in shards:
                    if len(pos):
                        segments[sh.rank].append(_Segment(t, sh, pos, whole=True))
        return uniq, inv, counts, segments

    def _route_bags(self, bags: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        """The pooled exchange's requests: per destination, for each table- or column-wise shard it owns
        (tables in order), ``[bags, ids, lengths..., ids...]`` (int64) -- each bag's ids go to the owner,
        which pools them (TorchRec's table- and column-wise data flow: fewer bytes back than the
        deduplicated rows, and the pooling runs where the rows are)."""
        payload: list[list[torch.Tensor]] = [[] for _ in range(self.n)]
        sent: list[list[tuple[Shard, int]]] = [[] for _ in range(self.n)]
        for t in sorted(bags):
            v, o = bags[t]
            lengths = torch.diff(o, append=o.new_tensor([len(v)]))
            seg = torch.cat([torch.tensor([len(o), len(v)], dtype=torch.int64), lengths, v])
            for sh in self.shards[t]:
                payload[sh.rank].append(seg)
                sent[sh.rank].append((sh, len(o)))
        return payload, sent

    def _parse_bags(self, bag_tables: list[int], per_src: list[torch.Tensor]):
        """Per local shard, the bags every source sent (sources in rank order): ``(lengths, ids)`` lists,
        and per source the ``(shard key, bags)`` in arrival order."""
        got: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        bag_from: list[list[tuple[tuple[int, int], int]]] = []
        mine = [(t, sh.index) for t in bag_tables for sh in self.shards[t] if sh.rank == self.me]
        for x in per_src:
            pos, layout = 0, []
            for key in mine:
                b, nv = x[pos: pos + 2].tolist()
                got.setdefault(key, []).append((x[pos + 2: pos + 2 + b], x[pos + 2 + b: pos + 2 + b + nv]))
                layout.append((key, b))
                pos += 2 + b + nv
            bag_from.append(layout)
        return got, bag_from

    def _exchange_ids(self, uniq, counts, segments, err: tuple[int, int, int] = (0, 0, 0),
                      bag_payload: list[list[torch.Tensor]] | None = None):
        """Send (shard, key, count) triples to owners, followed by the pooled exchange's bags; returns the
        triples this rank received and their number per source, and each source's bag payload.

        The split sizes travel with each rank's verdict on its input (``err``): every rank receives every
        other rank's verdict in that first exchange and raises the first rank's error before the ids move,
        so agreeing costs no collective of its own."""
        send, send_tri, send_bag = [], [], []
        for d in range(self.n):
            nt = 0
            for seg in segments[d]:
                tri = torch.stack([torch.full_like(seg.pos, seg.shard.table * 4096 + seg.shard.index),
                                   uniq[seg.table][seg.pos], counts[seg.table][seg.pos]], dim=1)
                send.append(tri.reshape(-1))
                nt += 3 * len(seg.pos)
            bp = bag_payload[d] if bag_payload else []
            send.extend(bp)
            send_tri.append(nt)
            send_bag.append(sum(len(b) for b in bp))
        send_t = torch.cat(send) if send else torch.zeros(0, dtype=torch.int64)
        head = torch.tensor([[a, b, *err] for a, b in zip(send_tri, send_bag)], dtype=torch.int64).reshape(-1)
        got = self._exchange(head, [5] * self.n, [5] * self.n).reshape(self.n, 5).tolist()
        for r, (_, _, code, t, v) in enumerate(got):
            if code:
                raise TableError(self._message(code, t, v, r))
        recv_n = [g[0] + g[1] for g in got]
        recv_t = self._exchange(send_t, recv_n, [a + b for a, b in zip(send_tri, send_bag)])
        tri, bags, off = [], [], 0
        for a, b, *_ in got:
            tri.append(recv_t[off: off + a])
            bags.append(recv_t[off + a: off + a + b])
            off += a + b
        return torch.cat(tri).reshape(-1, 3), [g[0] // 3 for g in got], bags

    def _group_received(self, tri: torch.Tensor, per_src: list[int]):
        """Per local shard: deduplicated keys, total counts and each source's slice of the triples."""
        by_shard: dict[tuple[int, int], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
        src_layout: list[list[tuple[tuple[int, int], int]]] = []
        off = 0
        for src, n in enumerate(per_src):
            chunk = tri[off: off + n]
            layout = []
            if n:
                sid = chunk[:, 0]
                # triples arrive grouped by shard, in the sender's segment order
                change = torch.nonzero(sid[1:] != sid[:-1]).reshape(-1) + 1
                starts = [0] + change.tolist()
                ends = change.tolist() + [n]
                for a, b in zip(starts, ends):
                    code = int(sid[a])
                    key = (code // 4096, code % 4096)
                    by_shard.setdefault(key, []).append((src, off + a, chunk[a:b, 1], chunk[a:b, 2]))
                    layout.append((key, b - a))
            src_layout.append(layout)
            off += n
        return by_shard, src_layout

    # -- lookup -----------------------------------------------------------------------------------------
    def _lookup(self, ids: dict[int, torch.Tensor], train: bool, err: tuple[int, int, int] = (0, 0, 0),
                bags: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None):
        """Rows of ``ids`` (deduplicated, per table) and the pooled ``bags`` of table- and column-wise
        tables, with one id exchange and one reply exchange for all of them."""
        bags = bags or {}
        if self._deferred[0]:
            err = self._deferred
        for t, v in list(ids.items()) + [(t, v) for t, (v, _) in bags.items()]:
            e = self._check_ids(t, v)
            if e[0] and not err[0]:
                err = e
        uniq, inv, counts, segments = self._route(ids)
        bag_payload, bag_sent = self._route_bags(bags)
        tri, per_src, bag_in = self._exchange_ids(uniq, counts, segments, err, bag_payload)
        by_shard, src_layout = self._group_received(tri, per_src)
        bag_tables = sorted(bags)
        bag_parts, bag_from = self._parse_bags(bag_tables, bag_in)
        # owners: deduplicate across sources and check the working set before touching any store
        merged = {}
        err = (0, 0, 0)
        for key, parts in by_shard.items():
            keys = torch.cat([p[2] for p in parts])
            cnt = torch.cat([p[3] for p in parts])
            dd = Dedup.of(keys)
            u, i = dd.keys, dd.inv
            total = torch.zeros(len(u), dtype=torch.int64).index_add_(0, i, cnt)
            merged[key] = (u, i, total, parts)
        bag_merged = {}
        for key, parts in bag_parts.items():
            lengths = torch.cat([p[0] for p in parts])
            dd = Dedup.of(torch.cat([p[1] for p in parts]))
            offsets = torch.cumsum(lengths, 0) - lengths
            bag_merged[key] = (dd.keys, dd, dd.counts(), offsets)
        for key, (u, *_rest) in list(merged.items()) + list(bag_merged.items()):
            cap = self.stores[key].capacity()
            if cap is not None and len(u) > cap and not err[0]:
                err = (3, key[0], key[1] * (1 << 40) + len(u))
        if self._tiered:  # only a cache tier has a capacity, only a store on disk fails while reading
            self._agree(*err)
        self.step_count += int(train)
        fetched, err = {}, (0, 0, 0)
        for key, (u, _i, total, _p) in list(merged.items()) + list(bag_merged.items()):
            try:
                fetched[key] = self._fetch(key, u, total, train)
            except StorageError as e:  # agreed below, before the row exchange the other ranks wait in
                err, self._deferred_text = (7, key[0], 0), str(e)
                break
        if self._tiered:
            self._agree(*err)
        received: dict[tuple[int, int], _Received] = {}
        for key, (u, i, total, parts) in merged.items():
            rows, admitted = fetched[key]
            rec = _Received(u, rows, admitted, bool(admitted.all()))
            start = 0
            for src, _, k, _c in parts:
                rec.parts.append((src, start, len(k), i[start: start + len(k)]))
                start += len(k)
            received[key] = rec
        # owners of bags pool them over their rows (zeros for keys without a row)
        owned: dict[tuple[int, int], _Bags] = {}
        pooled: dict[tuple[int, int], torch.Tensor] = {}
        for key, (u, dd, _total, offsets) in bag_merged.items():
            rows, admitted = fetched[key]
            rec = _Received(u, rows, admitted, bool(admitted.all()))
            owned[key] = _Bags(rec, dd, offsets)
            w = rows[:, : self.shards[key[0]][key[1]].width].contiguous()  # (ATen's fast path wants it)
            if not rec.every:
                w = torch.where(admitted[:, None], w, torch.zeros_like(w))
            pooled[key] = (F.embedding_bag(dd.inv, w, offsets, mode=self.specs[key[0]].pooling) if len(offsets)
                           else w.new_zeros(0, w.shape[1]))
        # reply with each source's rows (weights only), in the order it asked, then its pooled bags
        out_chunks, recv_floats = [], []
        bag_start = {key: 0 for key in owned}
        for src in range(self.n):
            nf = 0
            for key, count in src_layout[src]:
                rec = received[key]
                sh = self.shards[key[0]][key[1]]
                part = next(p for p in rec.parts if p[0] == src)
                w = rec.rows[:, : sh.width].index_select(0, part[3])
                if not rec.every:
                    w = torch.where(rec.admitted[part[3], None], w, torch.zeros_like(w))
                out_chunks.append(w.reshape(-1))
                nf += count * sh.width
            for key, b in bag_from[src]:
                a = bag_start[key]
                out_chunks.append(pooled[key][a: a + b].reshape(-1))
                bag_start[key] = a + b
                nf += b * self.shards[key[0]][key[1]].width
            recv_floats.append(nf)
        send_rows = torch.cat(out_chunks) if out_chunks else torch.zeros(0)
        send_floats = [sum(len(s.pos) * s.shard.width for s in segments[d]) +
                       sum(b * sh.width for sh, b in bag_sent[d]) for d in range(self.n)]
        got = self._exchange(send_rows, send_floats, recv_floats)
        # assemble each table's deduplicated rows (the segments cover every id and column: no zero fill)
        rows = {t: torch.empty(len(uniq[t]), self.specs[t].dim) for t in ids}
        out = {t: torch.empty(len(o), self.specs[t].dim) for t, (_, o) in bags.items()}
        off = 0
        for d in range(self.n):
            for seg in segments[d]:
                w = seg.shard.width
                n = len(seg.pos) * w
                if seg.whole:
                    rows[seg.table][:, seg.shard.c0: seg.shard.c1] = got[off: off + n].reshape(-1, w)
                else:
                    rows[seg.table][seg.pos, seg.shard.c0: seg.shard.c1] = got[off: off + n].reshape(-1, w)
                off += n
            for sh, b in bag_sent[d]:
                n = b * sh.width
                out[sh.table][:, sh.c0: sh.c1] = got[off: off + n].reshape(b, sh.width)
                off += n
        step = _Step(list(ids), uniq, segments, send_floats, recv_floats, received, src_layout,
                     bag_tables, bag_sent, owned, bag_from)
        return rows, inv, out, step

    def _fresh_rows(self, sh: Shard, keys: torch.Tensor) -> torch.Tensor:
        """New full stored rows of ``keys`` in shard ``sh``: the deterministic per-key initial weights,
        fresh optimizer state and the current step as last use."""
        spec = self.specs[sh.table]
        scale = spec.init_scale if spec.init_scale is not None else 1.0 / math.sqrt(spec.dim)
        fresh = torch.empty(len(keys), self.row_floats(sh.table, sh))
        fresh[:, : sh.width] = init_rows(self._seeds[sh.table], keys, sh.c0, sh.c1, scale)
        if spec.trainable:
            fresh[:, sh.width: -1] = self.optimizer.init_state(len(keys), sh.width)
        fresh[:, -1] = float(self.step_count)
        return fresh

    def _fetch(self, key, u: torch.Tensor, total: torch.Tensor, train: bool):
        """Full stored rows of ``u`` in shard ``key``, creating admitted new keys (train only)."""
        t, _ = key
        spec, sh = self.specs[t], self.shards[t][key[1]]
        store = self.stores[key]
        rows, found = store.get(u)
        rows = rows.cpu()
        admitted = found.clone()
        new = ~found
        if new.any() and spec.trainable and train:
            nk = u[new]
            if spec.admit_after > 1:
                seen = self._counts[key]
                tot = total[new].tolist()
                ok = []
                for j, k in enumerate(nk.tolist()):
                    c = seen.get(k, 0) + tot[j]
                    if c >= spec.admit_after:
                        seen.pop(k, None)
                        ok.append(True)
                    else:
                        seen[k] = c
                        ok.append(False)
                ok_t = torch.tensor(ok, dtype=torch.bool)
            else:
                ok_t = torch.ones(len(nk), dtype=torch.bool)
            if ok_t.any():
                ck = nk[ok_t]
                fresh = self._fresh_rows(sh, ck)
                idx = new.nonzero().reshape(-1)[ok_t]
                rows[idx] = fresh
                admitted[idx] = True
                store.put(ck, fresh)
                self._mark(key, ck)
        return rows, admitted

    # -- backward: push gradients, owners update ------------------------------------------------------
    def _push(self, step: _Step, grads) -> None:
        """Send each row's gradient (row path) and each bag's (pooled exchange) to its owner, in one
        exchange; owners sum them per row and apply the sparse optimizer to the touched rows."""
        trainable = [s.trainable for s in self.specs]
        row_grads = dict(zip(step.tables, grads[: len(step.tables)]))
        bag_grads = dict(zip(step.bag_tables, grads[len(step.tables):]))
        chunks, send_f = [], []
        for d in range(self.n):
            nf = 0
            for seg in step.segments[d]:
                if not trainable[seg.table]:  # read-only rows (features) send no gradient back
                    continue
                g = row_grads[seg.table]
                if g is None:
                    g = torch.zeros(len(step.uniq[seg.table]), self.specs[seg.table].dim)
                g = g[:, seg.shard.c0: seg.shard.c1]
                chunks.append((g if seg.whole else g.index_select(0, seg.pos)).reshape(-1))
                nf += len(seg.pos) * seg.shard.width
            for sh, b in step.bag_sent[d]:
                if not trainable[sh.table]:
                    continue
                g = bag_grads[sh.table]
                if g is None:
                    g = torch.zeros(b, self.specs[sh.table].dim)
                chunks.append(g[:, sh.c0: sh.c1].reshape(-1))
                nf += b * sh.width
            send_f.append(nf)
        recv_f = [sum(count * self.shards[k[0]][k[1]].width for k, count in step.src_layout[src]
                      if trainable[k[0]]) +
                  sum(b * self.shards[k[0]][k[1]].width for k, b in step.bag_from[src] if trainable[k[0]])
                  for src in range(self.n)]
        send = torch.cat(chunks) if chunks else torch.zeros(0)
        got = self._exchange(send, recv_f, send_f)
        # sum each key's gradient over the sources, then update the touched rows
        sums = {key: torch.zeros(len(rec.keys), self.shards[key[0]][key[1]].width)
                for key, rec in step.received.items() if trainable[key[0]]}
        bag_g: dict[tuple[int, int], list[torch.Tensor]] = {key: [] for key in step.bags if trainable[key[0]]}
        off = 0
        for src in range(self.n):
            for key, count in step.src_layout[src]:
                if not trainable[key[0]]:
                    continue
                rec = step.received[key]
                w = self.shards[key[0]][key[1]].width
                part = next(p for p in rec.parts if p[0] == src)
                sums[key].index_add_(0, part[3], got[off: off + count * w].reshape(-1, w))
                off += count * w
            for key, b in step.bag_from[src]:
                if not trainable[key[0]]:
                    continue
                w = self.shards[key[0]][key[1]].width
                bag_g[key].append(got[off: off + b * w].reshape(b, w))
                off += b * w
        for t in sorted(set(step.tables) | set(step.bag_tables)):
            self._updates[t] += trainable[t]
        for key, rec in step.received.items():
            if trainable[key[0]]:
                self._update(key, rec, sums[key])
        for key, bg in bag_g.items():
            own = step.bags[key]
            g = own.ids.rows_grad(torch.cat(bg), own.offsets, self.specs[key[0]].pooling)
            self._update(key, own.rec, g)

    def _update(self, key: tuple[int, int], rec: _Received, g: torch.Tensor) -> None:
        """Apply the sparse optimizer to the admitted rows of ``rec`` with their summed gradients ``g`` and
        write them back to the store."""
        t = key[0]
        if not rec.admitted.any():
            return
        w = self.shards[t][key[1]].width
        if rec.every:  # the received rows are this step's own copy: update them in place
            rows, keys = rec.rows, rec.keys
        else:
            a = rec.admitted
            rows, g, keys = rec.rows[a], g[a], rec.keys[a]
        self.optimizer.update(rows[:, :w], rows[:, w:-1], g, self._updates[t])
        rows[:, -1] = float(self.step_count)
        try:
            self.stores[key].put(keys, rows)
            self._mark(key, keys)
        except StorageError as e:
            # The other ranks are past their last collective of this step: the verdict is agreed at
            # the start of the next exchange, so every rank raises it there instead of one hanging.
            if not self._deferred[0]:
                self._deferred = (6, t, 0)
                self._deferred_text = str(e)

    # -- public ---------------------------------------------------------------------------------------
    def _ids(self, features: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
        missing = [s.name for s in self.specs if s.name not in features]
        extra = [k for k in features if k not in self.index]
        if missing or extra:
            raise TableError(f"features name tables {sorted(features)} but the tables are "
                             f"{[s.name for s in self.specs]}: pass one entry per table")
        return {self.index[k]: v.reshape(-1).to(torch.int64).cpu() for k, v in features.items()}

    def _rows(self, ids: dict[int, torch.Tensor], err: tuple[int, int, int] = (0, 0, 0),
              bags: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None):
        bags = bags or {}
        train = torch.is_grad_enabled() and any(self.specs[t].trainable for t in list(ids) + list(bags))
        rows, inv, pooled, step = self._lookup(ids, train, err, bags)
        order, bag_order = list(ids), sorted(bags)
        if train:
            outs = _Exchange.apply(self._anchor, self, step, *[rows[t] for t in order],
                                   *[pooled[t] for t in bag_order])
            rows = dict(zip(order, outs[: len(order)]))
            pooled = dict(zip(bag_order, outs[len(order):]))
        return rows, inv, pooled

    def lookup(self, ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rows ``[len(ids), dim]`` of the given keys per table (zeros for keys without a row)."""
        rows, inv, _ = self._rows(self._ids(ids))
        return {self.specs[t].name: rows[t][inv[t].inv] for t in rows}

    def forward(self, features: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Pooled bags per table from jagged ids: ``values`` and ``offsets`` (each bag's start), as in
        ``nn.EmbeddingBag``.  Row-wise tables fetch their deduplicated rows and pool here (a bag spans
        owners); table- and column-wise tables send each bag's ids to the owner, which pools (the pooled
        exchange); both ride the same collectives."""
        values = self._ids({k: v for k, (v, _) in features.items()})
        offsets = {self.index[k]: o.to(torch.int64).cpu() for k, (_, o) in features.items()}
        err = (0, 0, 0)
        for t, o in offsets.items():
            n = len(values[t])
            bad = (len(o) and (int(o[0]) != 0 or bool((o[1:] < o[:-1]).any()) or int(o[-1]) > n)) or \
                  (len(o) == 0 and n)
            if bad and not err[0]:
                err = (4, t, 0)
        hashed = {t: v for t, v in values.items() if self.shards[t][0].hashed}
        bags = {t: (v, offsets[t]) for t, v in values.items() if not self.shards[t][0].hashed}
        rows, inv, pooled = self._rows(hashed, err, bags)
        out = {t: _BagPool.apply(rows[t], inv[t], offsets[t], self.specs[t].pooling) for t in rows}
        out.update(pooled)
        return {self.specs[t].name: out[t] for t in sorted(out)}

    def prefetch(self, features: dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Announce the next batch's ids (a tensor, or the ``(values, offsets)`` of a bag) per table: owners
        promote their rows to the DRAM tier in the background.

        Call it (on every rank) while the current batch trains; the next lookup of those ids then reads no
        row from the SSD (``tier_stats`` counts the misses).
        """
        if not self._tiered:  # every row is in memory already (the same verdict on every rank)
            return
        ids = self._ids({k: (v[0] if isinstance(v, tuple) else v) for k, v in features.items()})
        ids = {t: v[v >= 0] for t, v in ids.items()}
        uniq, _, counts, segments = self._route(ids)
        tri, per_src, _ = self._exchange_ids(uniq, counts, segments)
        by_shard, _ = self._group_received(tri, per_src)
        for key, parts in by_shard.items():
            self.stores[key].prefetch(Dedup.of(torch.cat([p[2] for p in parts])).keys)

    def load_rows(self, name: str, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Write rows (e.g. node features, or a trained table) for ``keys``; every rank may pass the same
        or different pieces and keeps the keys (and columns) it owns, with fresh optimizer state.  Local:
        no collective."""
        t = self.index[name]
        keys = keys.reshape(-1).to(torch.int64).cpu()
        rows = rows.to(torch.float32).cpu()
        if len(keys) and int(keys.min()) < 0:
            raise TableError(f"table '{name}': load_rows got a negative key: keys are non-negative int64")
        for sh in self.shards[t]:
            if sh.rank != self.me:
                continue
            mine = (self._owner(keys, self.n) == sh.rank) if sh.hashed else torch.ones(len(keys), dtype=torch.bool)
            k = keys[mine]
            full = torch.zeros(len(k), self.row_floats(t, sh))
            full[:, : sh.width] = rows[mine, sh.c0: sh.c1]
            if self.specs[t].trainable:
                full[:, sh.width: -1] = self.optimizer.init_state(len(k), sh.width)
            full[:, -1] = float(self.step_count)
            self.put_rows((t, sh.index), k, full)

    def expire(self) -> int:
        """Remove rows unused for more than their table's ``ttl_steps``; returns rows removed here."""
        removed = 0
        for (t, i), store in self.stores.items():
            ttl = self.specs[t].ttl_steps
            if ttl is None:
                continue
            old = [k[r[:, -1] < self.step_count - ttl] for k, r in store.scan()]
            if old:
                dead = torch.cat(old)
                if len(dead):
                    store.delete(dead)
                    self._deleted[(t, i)].append(dead)
                    removed += len(dead)
        return removed

    def local_rows(self, name: str) -> list[tuple[torch.Tensor, int, int, torch.Tensor]]:
        """This rank's pieces of table ``name`` as ``(keys, c0, c1, weights [n, c1 - c0])``, one per local
        shard (tests, export)."""
        t = self.index[name]
        out = []
        for sh in self.shards[t]:
            if sh.rank == self.me:
                for k, r in self.stores[(t, sh.index)].scan():
                    out.append((k, sh.c0, sh.c1, r[:, : sh.width].clone()))
        return out

    # -- local state for checkpoints (podscale.table.checkpoint) ---------------------------------------
    def _mark(self, key: tuple[int, int], keys: torch.Tensor) -> None:
        marks = self._changed[key]
        marks.append(keys.clone())
        if len(marks) > 64:  # keep the record compact: one sorted tensor of distinct keys
            self._changed[key] = [_distinct(torch.cat(marks))]

    def key_owner(self, keys: torch.Tensor) -> torch.Tensor:
        """Local: the rank (in the table group) that row-wise sharding places each key on -- the table's
        :class:`~podscale.table.hashing.KeyOwner` (hash by default; the partition book for the GNN's rows)."""
        return self._owner(keys, self.n)

    def local_shards(self) -> list[Shard]:
        """Local: the shards this rank holds, in table order."""
        return [self.shards[t][i] for (t, i) in self.stores]

    def changed_since_save(self, sh: Shard) -> tuple[torch.Tensor, torch.Tensor]:
        """Local: (keys written, keys deleted) in shard ``sh`` since the last :meth:`mark_saved`, each sorted
        and distinct (a key deleted and written again is in both)."""
        key = (sh.table, sh.index)
        empty = torch.zeros(0, dtype=torch.int64)
        ch, de = self._changed[key], self._deleted[key]
        return (_distinct(torch.cat(ch)) if ch else empty), (_distinct(torch.cat(de)) if de else empty)

    def mark_saved(self) -> None:
        """Local: a checkpoint holds every row as it is now; start recording changes afresh."""
        for key in self._changed:
            self._changed[key], self._deleted[key] = [], []

    def get_rows(self, sh: Shard, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Local: full stored rows (weights, optimizer state, last-used step) of ``keys`` in shard ``sh`` and
        a found mask, read in pieces a cache tier can hold."""
        store = self.stores[(sh.table, sh.index)]
        step = max(1, (store.capacity() or len(keys) or 1) // 2)
        rows, found = [], []
        for a in range(0, len(keys), step):
            r, f = store.get(keys[a: a + step])
            rows.append(r.cpu())
            found.append(f)
        if not rows:
            return torch.zeros(0, self.row_floats(sh.table, sh)), torch.zeros(0, dtype=torch.bool)
        return torch.cat(rows), torch.cat(found)

    def put_rows(self, key: tuple[int, int], keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Local: write full stored rows into a local shard (``key`` = (table, shard index)), in pieces a
        cache tier can hold; recorded for the next incremental checkpoint."""
        store = self.stores[key]
        step = max(1, (store.capacity() or len(keys) or 1) // 2)
        for a in range(0, len(keys), step):
            store.put(keys[a: a + step], rows[a: a + step])
        if len(keys):
            self._mark(key, keys)

    def delete_rows(self, key: tuple[int, int], keys: torch.Tensor) -> None:
        """Local: remove ``keys`` from a local shard (recorded for the next incremental checkpoint)."""
        if len(keys):
            self.stores[key].delete(keys)
            self._deleted[key].append(keys.clone())

    def admission_counts(self, sh: Shard) -> tuple[torch.Tensor, torch.Tensor]:
        """Local: (keys, occurrences) of keys in shard ``sh`` seen but not yet admitted."""
        c = self._counts[(sh.table, sh.index)]
        return torch.tensor(list(c), dtype=torch.int64), torch.tensor(list(c.values()), dtype=torch.int64)

    def add_admission_counts(self, sh: Shard, keys: torch.Tensor, counts: torch.Tensor) -> None:
        """Local: set the occurrence counts of not-yet-admitted ``keys`` in shard ``sh``."""
        c = self._counts[(sh.table, sh.index)]
        c.update(zip(keys.tolist(), counts.tolist()))

    def clock(self) -> dict:
        """The table's counters (the same on every rank): optimizer updates per table and lookups so far."""
        return {"updates": list(self._updates), "step_count": self.step_count}

    def set_clock(self, clock: dict, names: list[str]) -> None:
        """Restore :meth:`clock` saved for tables ``names`` (matched by name)."""
        by_name = dict(zip(names, clock["updates"]))
        self._updates = [int(by_name.get(s.name, 0)) for s in self.specs]
        self.step_count = int(clock["step_count"])

    def clear(self) -> None:
        """Local: remove every row of every local shard from every tier (a fresh run, or before loading a
        checkpoint), with the admission counts and the change record."""
        for key, store in self.stores.items():
            store.clear()
            self._counts[key].clear()
        self.mark_saved()

    def tier_bytes(self) -> dict[str, list[int]]:
        """Local: per local shard, the bytes of rows each tier holds (top first)."""
        return {f"{self.specs[t].name}/{i}": s.tier_bytes() for (t, i), s in self.stores.items()}

    def tier_stats(self) -> dict[str, list[TierStats]]:
        """Per local shard (``"table/shard"``), counters of each tier since the last reset."""
        return {f"{self.specs[t].name}/{i}": s.stats() for (t, i), s in self.stores.items()}

    def reset_stats(self) -> None:
        for s in self.stores.values():
            s.reset_stats()

    def wait_prefetch(self) -> None:
        for s in self.stores.values():
            s.wait_prefetch()

    def close(self) -> None:
        for s in self.stores.values():
            s.close()
