"""Row stores: fixed-width float32 rows addressed by arbitrary int64 keys, in tiers.

This is the random-access half of podscale's one memory hierarchy (DESIGN.md, principle 4): the parameter
server's embedding rows and the GNN's node-feature rows live here, one store per shard of a
:mod:`podscale.table` table.  The hierarchy follows Baidu's AIBox / hierarchical parameter server (Zhao et
al., "Distributed Hierarchical GPU Parameter Server for Massive Scale Deep Learning Ads Systems", MLSys
2020): HBM-PS (a device cache), MEM-PS (a DRAM cache with a budget) and SSD-PS (rows on SSD), with the
rows a batch needs promoted a batch ahead so that training never waits on the SSD.

* :class:`RowStore` is the interface every tier implements: batch ``get`` (rows and a found mask),
  ``put``, ``delete``, ``scan``, ``capacity``, ``prefetch``.
* :class:`MemoryRowStore` keeps every row in memory: a key -> slot map over one growing slab (no hashing
  into a fixed row space, so no collisions; freed slots are reused).
* :class:`DiskRowStore` is an SSD tier, which states its own DRAM and disk bytes; two engines
  (``podscale.storage.SSD_ENGINES``): :class:`podscale.storage.log.LogRowStore`, the default, an append-only
  log of fixed-size row records with its key index in DRAM (whole-batch numpy reads and writes: several
  times RocksDB's rows/s, ``bench/rowstore.py``), and :class:`RocksRowStore`, an embedded RocksDB through
  ``rocksdict`` (as TorchRec's SSD tables and HugeCTR's HPS use RocksDB), rows as raw little-endian
  float32 bytes under 8-byte big-endian keys, batch multi-get and atomic write batches, its index on disk.
  Nothing read from either is unpickled.
* :class:`CachedRowStore` is a cache tier with a byte budget over any other store (LRU, or LFU): the DRAM
  tier over the SSD tier, and -- with ``device="cuda"`` -- the device tier over the DRAM tier.  Its key map,
  recency and frequency are arrays (no per-key Python on the hot path).  Dirty rows are written back when
  evicted and ``prefetch(keys)`` promotes rows, both on one background I/O thread while the step goes on;
  the counters say how many rows a step still had to read synchronously from the tier below (``misses``).
"""
from __future__ import annotations

import collections
import itertools
import operator
import os
import threading
import time
import uuid
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from podscale.runtime.errors import InputError
from podscale.sortunique import unique


class StorageError(InputError):
    """A row store that cannot be created or used as configured (one line, with the fix)."""


@dataclass
class TierStats:
    """Counters of one tier since the last :meth:`RowStore.reset_stats` (one step, in the table)."""

    hits: int = 0          # rows served from this tier
    misses: int = 0        # rows a caller waited for while they were read from the tier below
    prefetched: int = 0    # rows promoted from the tier below by prefetch
    written_back: int = 0  # dirty rows written to the tier below on eviction or flush
    prefetch_wait_s: float = 0.0  # time a caller waited for an unfinished prefetch


class RowStore(ABC):
    """Rows of ``width`` float32 values addressed by int64 keys.

    ``get`` returns zeros and ``found=False`` for absent keys (the caller decides whether to create them);
    keys passed to ``get``/``put``/``delete`` are unique within one call.
    """

    width: int

    @abstractmethod
    def get(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows [n, width] float32, found [n] bool)`` for int64 ``keys [n]``."""

    @abstractmethod
    def put(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Insert or overwrite the rows of ``keys``."""

    @abstractmethod
    def delete(self, keys: torch.Tensor) -> None:
        """Remove ``keys`` (absent keys are ignored)."""

    @abstractmethod
    def scan(self, batch: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every ``(keys, rows)`` in the store, ``batch`` at a time (for TTL sweeps, checkpoints, export)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of rows held (in this tier and all below it)."""

    def capacity(self) -> int | None:
        """Most rows one call may touch at once (a cache's budget in rows), or None when unbounded."""
        return None

    def prefetch(self, keys: torch.Tensor) -> None:
        """Promote ``keys`` towards the top tier in the background (a no-op for a single tier)."""

    def wait_prefetch(self) -> None:
        """Block until the prefetch in flight (if any) has finished."""

    def drain(self) -> None:
        """Block until every queued background read and write-back has finished (raising a failed one):
        then the tiers below hold every row evicted so far."""

    def stats(self) -> list[TierStats]:
        """Counters per tier, top first (empty for a store without tiers)."""
        return []

    def reset_stats(self) -> None:
        """Zero the counters of every tier."""

    def flush(self) -> None:
        """Write every dirty row down to the lowest tier."""

    def clear(self) -> None:
        """Remove every row from every tier (a fresh run, or before a checkpoint is loaded)."""
        for keys, _ in list(self.scan()):
            self.delete(keys)

    def tier_bytes(self) -> list[int]:
        """Bytes of rows each tier holds, top first (a cache: its slab; the SSD tier: its files)."""
        return [len(self) * 4 * self.width]

    def close(self) -> None:
        """Flush and release files and threads."""


class DiskRowStore(RowStore):
    """An SSD tier: rows in files under ``path`` that survive the process.  Each engine states what it costs
    beside the rows, for the table estimator (:func:`podscale.table.estimate.estimate_table`)."""

    path: Path

    @staticmethod
    @abstractmethod
    def dram_bytes(n: int) -> int:
        """Most DRAM the engine holds for ``n`` stored keys (its index, buffers and caches)."""

    @staticmethod
    @abstractmethod
    def file_bytes(n: int, width: int) -> int:
        """Most bytes on disk for ``n`` rows of ``width`` floats."""


def as_keys(keys: torch.Tensor) -> torch.Tensor:
    """``keys`` as a flat int64 tensor on the host (what every store's get/put/delete take)."""
    return keys.to(torch.int64).reshape(-1).cpu()


class KeyIndex:
    """int64 key -> int64 slot: open addressing with linear probing over numpy arrays, probed for a whole
    batch of keys at once (a Python dict costs a bytecode loop per key; this costs a few array passes per
    probe round, and at a load factor of at most 1/2 most keys settle in the first round).  Keys hash with
    SplitMix64's finaliser; deleted entries are tombstones until the next rebuild."""

    _EMPTY, _USED, _DEAD = 0, 1, 2
    ENTRY_BYTES = 17  # key (int64), slot (int64), state (int8)

    @staticmethod
    def max_entries(n: int) -> int:
        """The most entries the index allocates while it holds at most ``n`` live keys: it is rebuilt at a
        load (live + tombstones) of 1/2 to at least 4x the live keys, in powers of two."""
        return 1 << max(4, (4 * max(1, n) - 1).bit_length())

    def __init__(self, capacity: int = 1024):
        cap = 1 << max(4, int(capacity - 1).bit_length())
        self._alloc(cap)
        self.used = 0

    def _alloc(self, cap: int) -> None:
        self._k = np.zeros(cap, dtype=np.int64)
        self._v = np.zeros(cap, dtype=np.int64)
        self._st = np.zeros(cap, dtype=np.int8)
        self._mask = np.uint64(cap - 1)
        self._filled = 0  # used + tombstones

    def _home(self, keys: np.ndarray) -> np.ndarray:
        from podscale.table.hashing import mix64
        return (mix64(keys.view(np.uint64)) & self._mask).astype(np.int64)

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """Table position of each key, -1 where absent."""
        out = np.full(len(keys), -1, dtype=np.int64)
        pos = self._home(keys)
        act = np.arange(len(keys))
        mask = int(self._mask)
        while len(act):
            p = pos[act]
            st = self._st[p]
            hit = (st == self._USED) & (self._k[p] == keys[act])
            out[act[hit]] = p[hit]
            go = ~hit & (st != self._EMPTY)
            act = act[go]
            pos[act] = (pos[act] + 1) & mask
        return out

    def get(self, keys: np.ndarray) -> np.ndarray:
        """Slots of ``keys`` (-1 where absent)."""
        at = self._find(keys)
        return np.where(at >= 0, self._v[np.maximum(at, 0)], -1)

    def insert(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Add absent, distinct ``keys`` with their ``slots``."""
        if 2 * (self._filled + len(keys)) > len(self._k):
            self._rebuild(2 * (self.used + len(keys)))
        pos = self._home(keys)
        act = np.arange(len(keys))
        mask = int(self._mask)
        while len(act):
            p = pos[act]
            free = self._st[p] != self._USED
            cand, first = unique(p[free], return_index=True)  # one claimant per free position
            won = act[free][first]
            self._filled += int((self._st[cand] == self._EMPTY).sum())
            self._k[cand], self._v[cand], self._st[cand] = keys[won], slots[won], self._USED
            placed = np.zeros(len(keys), dtype=bool)
            placed[won] = True
            act = act[~placed[act]]
            pos[act] = (pos[act] + 1) & mask
        self.used += len(keys)

    def remove(self, keys: np.ndarray) -> np.ndarray:
        """Remove ``keys``; returns the slots of those that were present."""
        at = self._find(keys)
        at = at[at >= 0]
        self._st[at] = self._DEAD
        self.used -= len(at)
        return self._v[at].copy()

    def upsert(self, keys: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Point distinct ``keys`` at ``slots``, adding the absent ones; returns their previous slots (-1 where
        absent).  (A log-structured store moves a key to its newest record at every write.)"""
        at = self._find(keys)
        here = at >= 0
        old = np.where(here, self._v[np.maximum(at, 0)], -1)
        self._v[at[here]] = slots[here]
        if not here.all():
            self.insert(keys[~here], slots[~here])
        return old

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        live = self._st == self._USED
        return self._k[live].copy(), self._v[live].copy()

    def _rebuild(self, need: int) -> None:
        keys, slots = self.items()
        cap = len(self._k)
        while cap < 2 * need:
            cap *= 2
        self._alloc(cap)
        self.used = 0
        if len(keys):
            self.insert(keys, slots)

    def clear(self) -> None:
        self._alloc(len(self._k))
        self.used = 0


class MemoryRowStore(RowStore):
    """All rows in one slab on ``device``: a :class:`KeyIndex` from key to slot, the slab doubling as keys
    arrive; freed slots are reused.

    A table step reads a shard's keys, creates the new ones and writes the same keys back after the
    optimizer update: the slots of the last :meth:`get` are remembered, so that write (``put`` of equal
    keys) searches the index only for the keys that had no slot then -- one index search per step instead
    of three.  A slot changes only when its key is deleted, so :meth:`delete` and :meth:`clear` forget them.
    """

    @staticmethod
    def key_bytes(n: int) -> int:
        """Bytes beside ``n`` rows: the key index at its largest (the slab itself grows by doubling, so it
        holds up to ``2n`` rows after a growth)."""
        return KeyIndex.max_entries(n) * KeyIndex.ENTRY_BYTES

    def __init__(self, width: int, device: str | torch.device = "cpu", initial_rows: int = 1024):
        self.width = int(width)
        self.device = torch.device(device)
        self._slab = torch.zeros(max(1, initial_rows), self.width, device=self.device)
        self._index = KeyIndex(2 * max(1, initial_rows))
        self._free: list[int] = []
        self._next = 0
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # (keys, slots) of the last get

    def _slots(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        last = self._last
        if last is not None and len(last[0]) == len(keys) and torch.equal(last[0], keys):
            s = last[1].clone()
            miss = (s < 0).nonzero().reshape(-1)
            if len(miss):  # keys created since that get
                s[miss] = torch.from_numpy(self._index.get(keys[miss].numpy()))
        else:
            s = torch.from_numpy(self._index.get(keys.numpy()))
        return s, s >= 0

    def get(self, keys):
        keys = as_keys(keys)
        slots, found = self._slots(keys)
        self._last = (keys.clone(), slots)  # a copy: the caller may reuse its tensor
        if bool(found.all()):
            return self._slab.index_select(0, slots.to(self.device)), found
        # one gather (absent keys read slot 0), then zeros where absent: no boolean-mask copies
        rows = self._slab.index_select(0, slots.clamp(min=0).to(self.device))
        rows.masked_fill_(~found.to(self.device)[:, None], 0.0)
        return rows, found

    def _grow(self, need: int) -> None:
        if need <= self._slab.shape[0]:
            return
        n = self._slab.shape[0]
        while n < need:
            n *= 2
        slab = torch.zeros(n, self.width, device=self.device)
        slab[: self._slab.shape[0]] = self._slab
        self._slab = slab

    def put(self, keys, rows):
        keys = as_keys(keys)
        slots, found = self._slots(keys)
        new = (~found).nonzero().reshape(-1)
        if len(new):
            reuse = min(len(self._free), len(new))
            fresh = self._free[len(self._free) - reuse:][::-1]
            del self._free[len(self._free) - reuse:]
            extra = len(new) - reuse
            fresh_t = torch.cat([torch.tensor(fresh, dtype=torch.int64),
                                 torch.arange(self._next, self._next + extra, dtype=torch.int64)])
            self._next += extra
            self._grow(self._next)
            self._index.insert(keys[new].numpy(), fresh_t.numpy())
            slots[new] = fresh_t
        self._slab[slots.to(self.device)] = rows.to(self._slab.device, torch.float32)

    def delete(self, keys):
        self._last = None
        freed = self._index.remove(as_keys(keys).numpy())
        if len(freed):
            self._free.extend(freed.tolist())
            self._slab[torch.from_numpy(freed).to(self.device)] = 0

    def scan(self, batch=65536):
        keys, slots = self._index.items()
        for i in range(0, len(keys), batch):
            k = torch.from_numpy(keys[i: i + batch])
            s = torch.from_numpy(slots[i: i + batch])
            yield k, self._slab[s.to(self.device)].clone()

    def __len__(self):
        return self._index.used

    def clear(self):
        self._last = None
        self._index.clear()
        self._free.clear()
        self._next = 0
        self._slab.zero_()


def unwritable_reason(path: Path) -> str | None:
    """Create ``path`` and write and remove a probe file in it: None if that works, else the OS's reason.  The
    probe's name is this process's own, so processes checking one folder at once (two runs starting together,
    every rank of a run) never remove each other's probe."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".podscale-write-probe-{os.getpid()}-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return e.strerror or str(e)
    return None


def ensure_writable_dir(path: Path) -> None:
    """Create ``path`` and check that a file can be written in it; StorageError (one line) if not."""
    reason = unwritable_reason(path)
    if reason is not None:
        raise StorageError(f"SSD tier path {path} is not writable ({reason}): "
                           "set the table's ssd_path to a writable directory")


def _key_bytes(keys: torch.Tensor) -> list[bytes]:
    # big-endian so that RocksDB's byte order follows the key order for non-negative keys
    raw = keys.numpy().astype(">i8").tobytes()
    return [raw[i: i + 8] for i in range(0, len(raw), 8)]


class RocksRowStore(DiskRowStore):
    """The SSD tier: rows in an embedded RocksDB (``rocksdict``), read with batch multi-get.

    Each ``put``/``delete`` is one atomic ``WriteBatch`` and RocksDB's write-ahead log makes it durable
    against a killed process, so the store reopens consistent.  The memtable and block cache are sized
    small (``memtable_bytes``) so that this tier's DRAM stays a stated, small overhead beside the cache
    above it.
    """

    MEMTABLE_BYTES = BLOCK_CACHE_BYTES = 4 << 20
    KEY_BYTES = 24  # per row on disk beside the value: 8-byte key, sequence number, index share

    @staticmethod
    def dram_bytes(n: int) -> int:
        """Two memtables and the block cache at their default sizes, whatever ``n`` (the index is on disk)."""
        return 2 * RocksRowStore.MEMTABLE_BYTES + RocksRowStore.BLOCK_CACHE_BYTES

    @staticmethod
    def file_bytes(n: int, width: int) -> int:
        return n * (4 * width + RocksRowStore.KEY_BYTES)

    def __init__(self, path: str | os.PathLike, width: int, memtable_bytes: int = MEMTABLE_BYTES,
                 block_cache_bytes: int = BLOCK_CACHE_BYTES):
        from rocksdict import BlockBasedOptions, Cache, DBCompressionType, Options, Rdict

        self.width = int(width)
        self.path = Path(path)
        ensure_writable_dir(self.path)
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_write_buffer_size(int(memtable_bytes))
        opts.set_max_write_buffer_number(2)
        opts.set_compression_type(DBCompressionType.none())  # trained float32 rows do not compress
        table = BlockBasedOptions()
        table.set_block_cache(Cache(int(block_cache_bytes)))
        table.set_bloom_filter(10, False)  # a multi-get of new (absent) keys skips the files
        opts.set_block_based_table_factory(table)
        try:
            self._db = Rdict(str(self.path), opts)
        except Exception as e:  # rocksdict raises a bare Exception with RocksDB's message
            raise StorageError(f"cannot open the SSD tier at {self.path} ({e}): "
                               "point ssd_path at a directory of its own on a writable disk") from None

    def get(self, keys):
        keys = as_keys(keys)
        n = len(keys)
        if not n:
            return torch.zeros(0, self.width), torch.zeros(0, dtype=torch.bool)
        # one multi-get; the values are joined and decoded in one pass (no array per row)
        vals = self._db.get(_key_bytes(keys))
        found = np.fromiter(map(operator.is_not, vals, itertools.repeat(None, n)), dtype=bool, count=n)
        # (filter(None, ...) drops the absent rows: a stored row is never empty)
        got = np.frombuffer(b"".join(filter(None, vals)), dtype="<f4").reshape(-1, self.width)
        if len(got) == n:
            rows = got.astype(np.float32)  # (a copy: the joined bytes are read-only)
        else:
            rows = np.zeros((n, self.width), dtype=np.float32)
            rows[found] = got
        return torch.from_numpy(rows), torch.from_numpy(found)

    def _write(self, wb) -> None:
        try:
            self._db.write(wb)
        except Exception as e:  # rocksdict raises a bare Exception (e.g. "No space left on device")
            raise StorageError(f"SSD tier at {self.path}: write failed ({e}): free space on that disk or "
                               "move ssd_path") from None

    def put(self, keys, rows):
        from rocksdict import WriteBatch

        keys = as_keys(keys)
        kb = _key_bytes(keys)
        raw = rows.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes()
        step = 4 * self.width
        wb = WriteBatch(raw_mode=True)
        collections.deque(map(wb.put, kb, [raw[i: i + step] for i in range(0, len(raw), step)]), maxlen=0)
        self._write(wb)

    def delete(self, keys):
        from rocksdict import WriteBatch

        kb = _key_bytes(as_keys(keys))
        wb = WriteBatch(raw_mode=True)
        for k in kb:
            wb.delete(k)
        self._write(wb)

    def scan(self, batch=65536):
        ks, vs = [], []
        for k, v in self._db.items():
            ks.append(k)
            vs.append(v)
            if len(ks) == batch:
                yield self._decode(ks, vs)
                ks, vs = [], []
        if ks:
            yield self._decode(ks, vs)

    def _decode(self, ks, vs):
        keys = torch.from_numpy(np.frombuffer(b"".join(ks), dtype=">i8").astype(np.int64))
        rows = torch.from_numpy(np.frombuffer(b"".join(vs), dtype="<f4").astype(np.float32)
                                .reshape(len(vs), self.width))
        return keys, rows

    def __len__(self):
        """Counted by a scan of the keys (RocksDB keeps only an estimate): for tests and maintenance."""
        return sum(1 for _ in self._db.keys())

    def flush(self):
        self._db.flush()

    def clear(self):
        """One range tombstone over every key (non-negative int64 keys sort below 0x80...)."""
        try:
            self._db.delete_range(b"\x00" * 8, b"\xff" * 9)
        except Exception as e:
            raise StorageError(f"SSD tier at {self.path}: clearing failed ({e}): free space on that disk or "
                               "move ssd_path") from None

    def tier_bytes(self):
        """The SSD files' size as RocksDB reports it (SST files plus memtables)."""
        db = self._db
        sst = db.property_int_value("rocksdb.total-sst-files-size") or 0
        mem = db.property_int_value("rocksdb.cur-size-all-mem-tables") or 0
        return [int(sst) + int(mem)]

    def close(self):
        self._db.close()


def _in_sorted(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Mask of ``keys`` found in the sorted array ``sorted_keys`` (a binary search each: ``np.isin`` sorts
    both arrays again at every call, the hot path's largest cost after the key index)."""
    at = np.searchsorted(sorted_keys, keys)
    return sorted_keys[np.minimum(at, len(sorted_keys) - 1)] == keys


def _positions_in_sorted(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Positions in the sorted array ``sorted_keys`` of those ``keys`` it holds."""
    at = np.searchsorted(sorted_keys, keys)
    return at[sorted_keys[np.minimum(at, len(sorted_keys) - 1)] == keys]


_IO_POOL: ThreadPoolExecutor | None = None
_IO_POOL_LOCK = threading.Lock()


def _io_pool() -> ThreadPoolExecutor:
    """The one background I/O thread of this process, shared by every cache tier (a table has a store per
    shard: one thread each would contend for the GIL with the step -- and with each other -- at every torch
    op that releases it).  One FIFO also keeps each cache's jobs in the order they were queued."""
    global _IO_POOL
    with _IO_POOL_LOCK:
        if _IO_POOL is None:
            _IO_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="podscale-tier-io")
        return _IO_POOL


def _forget_io_pool() -> None:
    global _IO_POOL
    _IO_POOL = None  # a forked child has no copy of the parent's thread: it starts its own


os.register_at_fork(after_in_child=_forget_io_pool)


class CachedRowStore(RowStore):
    """A cache tier of at most ``budget_bytes`` of rows over ``backing`` (write-back, LRU or LFU).

    Rows live in one preallocated slab of ``budget_bytes // (4 * width)`` rows on ``device`` (the DRAM
    tier on the CPU, the device tier on a GPU), so the tier's memory is its budget plus the key map.
    Everything on the hot path is a few array passes per batch, none per key: the key -> slot map is a
    :class:`KeyIndex`; per slot, numpy arrays hold the key, the last-use tick (one tick per call), the use
    count since the row entered and the dirty bit.  Victims are the ``n`` smallest scores among the
    unprotected slots (``np.argpartition``): LRU scores by last use (ties -- rows used in the same call --
    in any order), LFU by use count, then last use (O'Neil et al.'s LRU-K and the LFU of Baidu's MEM-PS
    both rank by such per-row counters; :func:`podscale.table.estimate.hit_rate` predicts the rates).

    One background thread (a FIFO) does the slow I/O, in order: write-back of evicted dirty rows and
    ``prefetch`` reads.  So the step goes on while RocksDB writes (its write and multi-get release the
    GIL), and a prefetch queued after a write reads the written row.  A prefetch that read a row before
    the foreground wrote that row (put, or evicted with a newer value) does not insert its stale copy.
    ``get`` first waits for the queue (in a training loop that is the prefetch it waits for anyway: the
    write-backs were queued before it), so a miss never reads a row whose write is in flight, and a failed
    write-back surfaces there, one call after the eviction, as :class:`StorageError`; its rows are kept
    (readable, and written again by the next ``flush``), so a full disk loses no row.  ``flush``,
    ``scan`` (checkpoints) and ``close`` wait for every write.  A miss reads the row from ``backing``
    synchronously and counts in ``stats().misses``.
    """

    SLOT_BYTES = 26  # the per-slot arrays beside each cached row (see __init__)

    @staticmethod
    def key_bytes(rows: int) -> int:
        """Bytes beside ``rows`` cached rows: the key index at its largest and the per-slot arrays."""
        return KeyIndex.max_entries(rows) * KeyIndex.ENTRY_BYTES + rows * CachedRowStore.SLOT_BYTES

    def __init__(self, backing: RowStore, budget_bytes: int, policy: str = "lru",
                 device: str | torch.device = "cpu"):
        if policy not in ("lru", "lfu"):
            raise StorageError(f"cache policy '{policy}' is not one of lru, lfu")
        self.width = backing.width
        self.backing = backing
        self.policy = policy
        self.device = torch.device(device)
        rows = int(budget_bytes) // (4 * self.width)
        if rows < 1:
            raise StorageError(f"cache budget {budget_bytes} B holds no row of {4 * self.width} B: "
                               f"raise the budget to at least {4 * self.width} B")
        self._slab = torch.zeros(rows, self.width, device=self.device)
        self._index = KeyIndex(2 * rows)
        # per-slot arrays (SLOT_BYTES): key 8, used 1, dirty 1, last use 8, frequency 8
        self._key = np.zeros(rows, dtype=np.int64)     # key of each slot
        self._used = np.zeros(rows, dtype=bool)
        self._dirty = np.zeros(rows, dtype=bool)
        self._last = np.zeros(rows, dtype=np.int64)    # tick of the last call that used the slot
        self._freq = np.zeros(rows, dtype=np.int64)    # uses since the row entered
        self._tick = 0
        self._absent = np.zeros(0, dtype=np.int64)     # keys the prefetch found in no tier below (sorted)
        self._written: list[np.ndarray] = []           # keys written while a prefetch is in flight
        self._failed: list[tuple[np.ndarray, torch.Tensor]] = []  # write-backs that failed, newest last
        self._error: StorageError | None = None
        self._lock = threading.RLock()
        self._pool = _io_pool()
        self._jobs: list[Future] = []                  # queued I/O, oldest first
        self._pending: Future | None = None            # the prefetch in flight
        self._hold = np.zeros(0, dtype=np.int64)       # slots of the last get: the step writes them back
        self._queued_bytes = 0                         # rows copied out for write-backs not done yet
        self._queue_limit = max(1, self._slab.numel() * 4 // 2)
        self._stats = TierStats()

    # -- interface --------------------------------------------------------------------------------
    def capacity(self):
        return self._slab.shape[0]

    def get(self, keys):
        keys = as_keys(keys)
        self._settle(count=True)
        with self._lock:
            kn = keys.numpy()
            n = len(kn)
            slots = self._index.get(kn)
            hit = slots >= 0
            self._tick += 1
            hs = slots[hit]
            self._last[hs] = self._tick
            self._freq[hs] += 1
            self._stats.hits += len(hs)
            if len(hs) == n:
                self._hold = slots
                return self._slab.index_select(0, torch.from_numpy(slots).to(self.device)), torch.ones(n, dtype=torch.bool)
            rows = self._slab.index_select(0, torch.from_numpy(np.maximum(slots, 0)).to(self.device))
            found = torch.from_numpy(hit.copy())
            miss = np.flatnonzero(~hit)
            rows[torch.from_numpy(miss).to(self.device)] = 0.0
            mi = miss[~_in_sorted(self._absent, kn[miss])] if len(self._absent) else miss
            self._hold = hs
            if len(mi):
                mk = kn[mi]
                mrows, mfound = self.backing.get(torch.from_numpy(mk))
                self._stats.misses += len(mi)
                mfound = mfound.numpy().copy()
                dirty = np.zeros(len(mk), dtype=bool)
                for fk, fr in self._failed:  # rows whose write-back failed are newer than the tier below
                    at = np.searchsorted(fk, mk)
                    inb = (at < len(fk)) & (fk[np.minimum(at, len(fk) - 1)] == mk)
                    if inb.any():
                        mrows[torch.from_numpy(np.flatnonzero(inb))] = fr[torch.from_numpy(at[inb])]
                        mfound |= inb
                        dirty |= inb
                self._forget_failed(mk[dirty])
                rows[torch.from_numpy(mi).to(self.device)] = mrows.to(self.device)
                found[torch.from_numpy(mi)] = torch.from_numpy(mfound)
                if mfound.any():
                    got = self._insert(mk[mfound], mrows[torch.from_numpy(mfound)], dirty=dirty[mfound],
                                       protect=hs)
                    self._hold = np.concatenate([hs, got])
        self._throttle()
        return rows, found

    def put(self, keys, rows):
        keys = as_keys(keys)
        with self._lock:
            kn = keys.numpy()
            if self._pending is not None:
                self._written.append(kn.copy())
            if len(self._absent):
                self._absent = np.delete(self._absent, _positions_in_sorted(self._absent, kn))
            self._forget_failed(kn)
            self._tick += 1
            self._insert(kn, rows, dirty=np.ones(len(kn), dtype=bool), protect=self._hold)
        self._throttle()

    def delete(self, keys):
        keys = as_keys(keys)
        self._settle(count=False)
        with self._lock:
            kn = keys.numpy()
            freed = self._index.remove(kn)
            self._used[freed] = False
            self._dirty[freed] = False
            self._forget_failed(kn)
            self.backing.delete(keys)

    def scan(self, batch=65536):
        self.flush()
        yield from self.backing.scan(batch)

    def __len__(self):
        self.flush()
        return len(self.backing)

    def prefetch(self, keys):
        keys = as_keys(keys)
        self._wait_prefetch()  # (not the write-backs queued since: the prefetch queues behind them)
        with self._lock:
            self._written.clear()
            self._absent = np.zeros(0, dtype=np.int64)
            kn = keys.numpy()
            want = kn[self._index.get(kn) < 0]
            if not len(want):
                return
            self._pending = self._submit(self._promote, want.copy(), kn.copy())

    def wait_prefetch(self):
        self._wait_prefetch()

    def drain(self):
        self._settle(count=False)

    def stats(self):
        return [TierStats(**vars(self._stats))] + self.backing.stats()

    def reset_stats(self):
        self._stats = TierStats()
        self.backing.reset_stats()

    def flush(self):
        self._settle(count=False)
        with self._lock:
            for fk, fr in self._failed:  # written again; a failure raises here and keeps them
                self.backing.put(torch.from_numpy(fk), fr)
                self._stats.written_back += len(fk)
            self._failed.clear()
            dirty = np.flatnonzero(self._dirty)
            if len(dirty):
                ds = torch.from_numpy(dirty)
                self.backing.put(torch.from_numpy(self._key[dirty]), self._slab[ds.to(self.device)].cpu())
                self._stats.written_back += len(dirty)
                self._dirty[dirty] = False
        self.backing.flush()

    def close(self):
        self.flush()  # (the I/O thread is shared by every cache of the process: it stays)
        self.backing.close()

    def clear(self):
        try:
            self._settle(count=False)
        except StorageError:
            pass  # the rows are being discarded anyway
        with self._lock:
            self._index.clear()
            self._used[:] = False
            self._dirty[:] = False
            self._freq[:] = 0
            self._last[:] = 0
            self._absent = np.zeros(0, dtype=np.int64)
            self._written.clear()
            self._failed.clear()
        self.backing.clear()

    def tier_bytes(self):
        """This tier's rows (its slab's used part), then the tiers below."""
        return [self._index.used * 4 * self.width] + self.backing.tier_bytes()

    # -- internals --------------------------------------------------------------------------------
    def _submit(self, fn, *args) -> Future:
        f = self._pool.submit(fn, *args)
        with self._lock:
            self._jobs.append(f)
        return f

    def _wait_prefetch(self) -> None:
        p = self._pending
        if p is not None:
            p.result()  # re-raises a failed prefetch here, in the foreground
            self._pending = None

    def _settle(self, count: bool) -> None:
        """Wait for every queued write-back and prefetch; raise the first failure (once)."""
        t0 = time.perf_counter()
        while True:
            with self._lock:
                if not self._jobs:
                    break
                f = self._jobs.pop(0)
            try:
                f.result()  # re-raises a failed prefetch here, in the foreground
            except BaseException:
                if f is self._pending:
                    self._pending = None
                raise
        if count and self._pending is not None:
            self._stats.prefetch_wait_s += time.perf_counter() - t0
        self._pending = None
        err, self._error = self._error, None
        if err is not None:
            raise err

    def _forget_failed(self, kn: np.ndarray) -> None:
        """Drop ``kn`` from the failed write-backs (their newest row is in the slab now); lock held."""
        if not self._failed or not len(kn):
            return
        kept = []
        for fk, fr in self._failed:
            keep = ~np.isin(fk, kn)
            if keep.all():
                kept.append((fk, fr))
            elif keep.any():
                kept.append((fk[keep], fr[torch.from_numpy(keep)]))
        self._failed = kept

    def _write_back(self, kn: np.ndarray, rows: torch.Tensor) -> None:
        """Queue evicted dirty rows for the tier below (lock held)."""
        if self._pending is not None:
            self._written.append(kn)
        self._stats.written_back += len(kn)
        self._queued_bytes += rows.numel() * 4
        self._submit(self._write_job, kn, rows)

    def _throttle(self) -> None:
        """Bound the rows copied out for write-back to half the budget (a stated overhead): when more are
        queued, wait for the oldest jobs.  Foreground only (the I/O thread never waits for itself)."""
        while self._queued_bytes > self._queue_limit:
            with self._lock:
                if not self._jobs:
                    return
                f = self._jobs.pop(0)
            f.result()

    def _write_job(self, kn: np.ndarray, rows: torch.Tensor) -> None:
        try:
            self.backing.put(torch.from_numpy(kn), rows)
        except StorageError as e:
            order = np.argsort(kn)  # (sorted: get finds keys in them by binary search)
            with self._lock:  # kept, newest last: read by get, written again by flush
                self._failed.append((kn[order], rows[torch.from_numpy(order)]))
                if self._error is None:
                    self._error = e
        finally:
            with self._lock:
                self._queued_bytes -= rows.numel() * 4

    def _promote(self, kn: np.ndarray, announced: np.ndarray) -> None:
        """Read ``kn`` (the absent part of the ``announced`` keys) and insert it.  Evicting may not take
        the announced rows already here (else the step would miss them) nor the rows of the step in
        flight (it writes them back)."""
        rows, found = self.backing.get(torch.from_numpy(kn))  # the slow read, outside the lock
        with self._lock:
            stale = np.concatenate(self._written + [fk for fk, _ in self._failed]) if (self._written or self._failed) \
                else np.zeros(0, dtype=np.int64)
            fresh = ~np.isin(kn, stale) if len(stale) else np.ones(len(kn), dtype=bool)
            f = found.numpy()
            self._absent = np.sort(kn[~f & fresh])
            keep = f & fresh & (self._index.get(kn) < 0)
            if keep.any():
                self._tick += 1
                here = self._index.get(announced)
                got = self._insert(kn[keep], rows[torch.from_numpy(keep)],
                                   dirty=np.zeros(int(keep.sum()), dtype=bool),
                                   protect=np.concatenate([self._hold, here[here >= 0]]), best_effort=True)
                self._stats.prefetched += len(got)

    def _insert(self, kn: np.ndarray, rows: torch.Tensor, dirty: np.ndarray, protect: np.ndarray | None = None,
                best_effort: bool = False) -> np.ndarray:
        """Place rows in the slab (overwriting present keys), evicting as needed; caller holds the lock
        and has advanced the tick.  ``dirty``: per row, whether it differs from the tier below; ``protect``: slots not to evict
        (besides those of ``kn``), unless the rows of ``kn`` would not fit then; ``best_effort``: insert
        only the rows that fit without evicting a protected one.  Returns the slots of the rows inserted."""
        n = len(kn)
        cap = self._slab.shape[0]
        if n > cap:
            raise StorageError(f"{n} rows do not fit a cache of {cap} rows: "
                               f"raise the budget above {n * 4 * self.width} B")
        slots = self._index.get(kn)
        new = np.flatnonzero(slots < 0)
        if len(new):
            free = np.flatnonzero(~self._used)
            if len(new) > len(free):
                present = slots[slots >= 0]
                keep = present if protect is None else np.concatenate([present, protect])
                short = len(new) - len(free) - self._evict(len(new) - len(free), keep)
                if short and best_effort:  # (a prefetch) insert what fits beside the protected rows
                    kept = np.ones(n, dtype=bool)
                    kept[new[len(new) - short:]] = False
                    kn, rows, slots, dirty = kn[kept], rows[torch.from_numpy(kept)], slots[kept], dirty[kept]
                    new = np.flatnonzero(slots < 0)
                elif short:  # the rows of this call must fit: the other protected rows give way
                    self._evict(short, present)
                free = np.flatnonzero(~self._used)
            fresh = free[: len(new)]
            self._index.insert(kn[new], fresh)
            self._key[fresh] = kn[new]
            self._used[fresh] = True
            self._freq[fresh] = 0
            slots[new] = fresh
        st = torch.from_numpy(slots)
        self._slab[st.to(self.device)] = rows.to(self.device, torch.float32)
        self._last[slots] = self._tick
        self._freq[slots] += 1
        self._dirty[slots[dirty]] = True
        return slots

    def _evict(self, n: int, protect: np.ndarray) -> int:
        """Free the ``n`` lowest-scored slots outside ``protect`` (fewer if there are not as many), queueing
        their dirty rows for write-back; returns how many were freed."""
        cand = self._used.copy()
        cand[protect] = False
        cs = np.flatnonzero(cand)
        if self.policy == "lru":
            score = self._last[cs]
        else:
            score = self._freq[cs] * (1 << 40) + self._last[cs]
        victims = cs[np.argpartition(score, n - 1)[:n]] if n < len(cs) else cs
        dv = victims[self._dirty[victims]]
        if len(dv):  # copied out before the slots are reused; written below in the background
            self._write_back(self._key[dv].copy(), self._slab[torch.from_numpy(dv).to(self.device)].cpu())
        self._index.remove(self._key[victims])
        self._used[victims] = False
        self._dirty[victims] = False
        return len(victims)
