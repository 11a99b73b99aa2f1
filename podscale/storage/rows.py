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
* :class:`RocksRowStore` is the SSD tier: an embedded RocksDB through ``rocksdict`` (as TorchRec's SSD
  tables and HugeCTR's HPS use RocksDB), rows as raw little-endian float32 bytes under 8-byte big-endian
  keys, batch multi-get and atomic write batches.  Nothing read from it is unpickled.
* :class:`CachedRowStore` is a cache tier with a byte budget over any other store (LRU, or LFU): the DRAM
  tier over the SSD tier, and -- with ``device="cuda"`` -- the device tier over the DRAM tier.  Dirty rows
  are written back when evicted; ``prefetch(keys)`` promotes rows on a background thread, and the counters
  say how many rows a step still had to read synchronously from the tier below (``misses``).
"""
from __future__ import annotations

import os
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from podscale.runtime.errors import InputError


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


def _as_keys(keys: torch.Tensor) -> torch.Tensor:
    return keys.to(torch.int64).reshape(-1).cpu()


class KeyIndex:
    """int64 key -> int64 slot: open addressing with linear probing over numpy arrays, probed for a whole
    batch of keys at once (a Python dict costs a bytecode loop per key; this costs a few array passes per
    probe round, and at a load factor of at most 1/2 most keys settle in the first round).  Keys hash with
    SplitMix64's finaliser; deleted entries are tombstones until the next rebuild."""

    _EMPTY, _USED, _DEAD = 0, 1, 2

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
            cand, first = np.unique(p[free], return_index=True)  # one claimant per free position
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
        keys = _as_keys(keys)
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
        keys = _as_keys(keys)
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
        freed = self._index.remove(_as_keys(keys).numpy())
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


def _key_bytes(keys: torch.Tensor) -> list[bytes]:
    # big-endian so that RocksDB's byte order follows the key order for non-negative keys
    raw = keys.numpy().astype(">i8").tobytes()
    return [raw[i: i + 8] for i in range(0, len(raw), 8)]


class RocksRowStore(RowStore):
    """The SSD tier: rows in an embedded RocksDB (``rocksdict``), read with batch multi-get.

    Each ``put``/``delete`` is one atomic ``WriteBatch`` and RocksDB's write-ahead log makes it durable
    against a killed process, so the store reopens consistent.  The memtable and block cache are sized
    small (``memtable_bytes``) so that this tier's DRAM stays a stated, small overhead beside the cache
    above it.
    """

    def __init__(self, path: str | os.PathLike, width: int, memtable_bytes: int = 4 << 20,
                 block_cache_bytes: int = 4 << 20):
        from rocksdict import BlockBasedOptions, Cache, Options, Rdict

        self.width = int(width)
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / ".podscale-write-probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise StorageError(f"SSD tier path {self.path} is not writable ({e.strerror}): "
                               "set the table's ssd_path to a writable directory") from None
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_write_buffer_size(int(memtable_bytes))
        opts.set_max_write_buffer_number(2)
        table = BlockBasedOptions()
        table.set_block_cache(Cache(int(block_cache_bytes)))
        opts.set_block_based_table_factory(table)
        try:
            self._db = Rdict(str(self.path), opts)
        except Exception as e:  # rocksdict raises a bare Exception with RocksDB's message
            raise StorageError(f"cannot open the SSD tier at {self.path} ({e}): "
                               "point ssd_path at a directory of its own on a writable disk") from None

    def get(self, keys):
        keys = _as_keys(keys)
        n = len(keys)
        if not n:
            return torch.zeros(0, self.width), torch.zeros(0, dtype=torch.bool)
        # one multi-get; the values are joined and decoded in one pass (no array per row)
        vals = self._db.get(_key_bytes(keys))
        found = np.fromiter((v is not None for v in vals), dtype=bool, count=n)
        got = np.frombuffer(b"".join(v for v in vals if v is not None), dtype="<f4").reshape(-1, self.width)
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

        keys = _as_keys(keys)
        kb = _key_bytes(keys)
        raw = rows.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes()
        step = 4 * self.width
        wb = WriteBatch(raw_mode=True)
        for i, k in enumerate(kb):
            wb.put(k, raw[i * step: (i + 1) * step])
        self._write(wb)

    def delete(self, keys):
        from rocksdict import WriteBatch

        kb = _key_bytes(_as_keys(keys))
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


class CachedRowStore(RowStore):
    """A cache tier of at most ``budget_bytes`` of rows over ``backing`` (write-back, LRU or LFU).

    Rows live in one preallocated slab of ``budget_bytes // (4 * width)`` rows on ``device`` (the DRAM
    tier on the CPU, the device tier on a GPU), so the tier's memory is its budget plus the key map.
    A miss reads the row from ``backing`` synchronously and counts in ``stats().misses``; ``prefetch``
    reads on a background thread and inserts what is still absent, so the step that follows finds its
    rows here.  A prefetch that read a row before the foreground wrote that row (put, or written back on
    eviction) does not insert its stale copy.
    """

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
        self._freq = torch.zeros(rows, dtype=torch.int64)
        self._dirty = torch.zeros(rows, dtype=torch.bool)
        self._map: OrderedDict[int, int] = OrderedDict()  # key -> slot, least recently used first
        self._free = list(range(rows - 1, -1, -1))
        self._absent: set[int] = set()      # keys a prefetch found in no tier below (no need to re-read)
        self._written: set[int] = set()     # keys written while a prefetch is in flight
        self._lock = threading.RLock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="podscale-prefetch")
        self._pending: Future | None = None
        self._stats = TierStats()

    # -- interface --------------------------------------------------------------------------------
    def capacity(self):
        return self._slab.shape[0]

    def get(self, keys):
        keys = _as_keys(keys)
        self._wait_pending(count=True)
        with self._lock:
            kl = keys.tolist()
            slots = [self._map.get(k, -1) for k in kl]
            hit = torch.tensor(slots, dtype=torch.int64) >= 0
            rows = torch.zeros(len(kl), self.width, device=self.device)
            found = hit.clone()
            if hit.any():
                hs = torch.tensor([s for s in slots if s >= 0], dtype=torch.int64)
                rows[hit.to(self.device)] = self._slab[hs.to(self.device)]
                self._touch([k for k, s in zip(kl, slots) if s >= 0], hs)
                self._stats.hits += len(hs)
            miss_idx = [i for i, s in enumerate(slots) if s < 0 and kl[i] not in self._absent]
            if miss_idx:
                mk = keys[miss_idx]
                mrows, mfound = self.backing.get(mk)
                self._stats.misses += len(miss_idx)
                mi = torch.tensor(miss_idx, dtype=torch.int64)
                rows[mi.to(self.device)] = mrows.to(self.device)
                found[mi] = mfound
                if mfound.any():
                    self._insert(mk[mfound], mrows[mfound], dirty=False)
            return rows, found

    def put(self, keys, rows):
        keys = _as_keys(keys)
        with self._lock:
            if self._pending is not None:
                self._written.update(keys.tolist())
            self._absent.difference_update(keys.tolist())
            self._insert(keys, rows, dirty=True)

    def delete(self, keys):
        keys = _as_keys(keys)
        with self._lock:
            for k in keys.tolist():
                s = self._map.pop(k, None)
                if s is not None:
                    self._dirty[s] = False
                    self._free.append(s)
                if self._pending is not None:
                    self._written.add(k)
            self.backing.delete(keys)

    def scan(self, batch=65536):
        self.flush()
        yield from self.backing.scan(batch)

    def __len__(self):
        self.flush()
        return len(self.backing)

    def prefetch(self, keys):
        keys = _as_keys(keys)
        self._wait_pending(count=False)
        with self._lock:
            self._written.clear()
            self._absent.clear()
            want = [k for k in keys.tolist() if k not in self._map]
            if not want:
                return
            self._pending = self._pool.submit(self._promote, torch.tensor(want, dtype=torch.int64))

    def wait_prefetch(self):
        self._wait_pending(count=False)

    def stats(self):
        return [TierStats(**vars(self._stats))] + self.backing.stats()

    def reset_stats(self):
        self._stats = TierStats()
        self.backing.reset_stats()

    def flush(self):
        self._wait_pending(count=False)
        with self._lock:
            dirty = self._dirty.nonzero().reshape(-1)
            if len(dirty):
                inv = {s: k for k, s in self._map.items()}
                keys = torch.tensor([inv[s] for s in dirty.tolist()], dtype=torch.int64)
                self.backing.put(keys, self._slab[dirty.to(self.device)].cpu())
                self._stats.written_back += len(dirty)
                self._dirty[dirty] = False
        self.backing.flush()

    def close(self):
        self.flush()
        self._pool.shutdown(wait=True)
        self.backing.close()

    def clear(self):
        self._wait_pending(count=False)
        with self._lock:
            self._map.clear()
            self._dirty.zero_()
            self._freq.zero_()
            self._free = list(range(self._slab.shape[0] - 1, -1, -1))
            self._absent.clear()
            self._written.clear()
        self.backing.clear()

    def tier_bytes(self):
        """This tier's rows (its slab's used part), then the tiers below."""
        return [len(self._map) * 4 * self.width] + self.backing.tier_bytes()

    # -- internals --------------------------------------------------------------------------------
    def _wait_pending(self, count: bool) -> None:
        p = self._pending
        if p is None:
            return
        t0 = time.perf_counter()
        p.result()  # re-raises a failed prefetch here, in the foreground
        if count:
            self._stats.prefetch_wait_s += time.perf_counter() - t0
        self._pending = None

    def _promote(self, keys: torch.Tensor) -> None:
        rows, found = self.backing.get(keys)  # the slow read, outside the lock
        with self._lock:
            kl = keys.tolist()
            fl = found.tolist()
            keep = [i for i, k in enumerate(kl) if fl[i] and k not in self._map and k not in self._written]
            self._absent.update(k for k, f in zip(kl, fl) if not f and k not in self._written)
            if keep:
                idx = torch.tensor(keep, dtype=torch.int64)
                self._insert(keys[idx], rows[idx], dirty=False)
                self._stats.prefetched += len(keep)

    def _touch(self, keys: list[int], slots: torch.Tensor) -> None:
        if self.policy == "lru":
            for k in keys:
                self._map.move_to_end(k)
        self._freq[slots] += 1

    def _insert(self, keys: torch.Tensor, rows: torch.Tensor, dirty: bool) -> None:
        """Place rows in the slab (overwriting present keys), evicting as needed; caller holds the lock."""
        kl = keys.tolist()
        n = len(kl)
        if n > self._slab.shape[0]:
            raise StorageError(f"{n} rows do not fit a cache of {self._slab.shape[0]} rows: "
                               f"raise the budget above {n * 4 * self.width} B")
        m = self._map
        slots = [m.get(k, -1) for k in kl]
        new = [i for i, s in enumerate(slots) if s < 0]
        if len(new) > len(self._free):
            self._evict(len(new) - len(self._free), protect=set(kl))
        if self.policy == "lru":
            for i, s in enumerate(slots):
                if s >= 0:
                    m.move_to_end(kl[i])
        if new:
            fresh = self._free[-len(new):][::-1]
            del self._free[-len(new):]
            for i, s in zip(new, fresh):
                slots[i] = s
                m[kl[i]] = s
            self._freq[torch.tensor(fresh, dtype=torch.int64)] = 0
        st = torch.tensor(slots, dtype=torch.int64)
        self._slab[st.to(self.device)] = rows.to(self.device, torch.float32)
        self._freq[st] += 1
        if dirty:
            self._dirty[st] = True

    def _evict(self, n: int, protect: set[int]) -> None:
        victims: list[int] = []
        if self.policy == "lru":
            for k in self._map:
                if k not in protect:
                    victims.append(k)
                    if len(victims) == n:
                        break
        else:
            inv = {s: k for k, s in self._map.items()}
            for s in torch.argsort(self._freq, stable=True).tolist():
                k = inv.get(s)
                if k is not None and k not in protect:
                    victims.append(k)
                    if len(victims) == n:
                        break
        slot_list = [self._map[k] for k in victims]
        slots = torch.tensor(slot_list, dtype=torch.int64)
        dirty = self._dirty[slots]
        if dirty.any():  # written down before the rows leave the cache: a failed write loses nothing
            dk = torch.tensor(victims, dtype=torch.int64)[dirty]
            self.backing.put(dk, self._slab[slots[dirty].to(self.device)].cpu())
            self._stats.written_back += len(dk)
            if self._pending is not None:
                self._written.update(dk.tolist())
        for k in victims:
            del self._map[k]
        self._dirty[slots] = False
        self._free.extend(slot_list)
