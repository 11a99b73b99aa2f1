"""A log-structured SSD tier: fixed-size row records appended to one file, an in-memory key index.

Why not RocksDB here: the parameter server's SSD tier reads and writes a few thousand rows of one width per
call, and through ``rocksdict`` every row costs a Python object, a key encoding and an LSM lookup (about
2-7 us a row read, 4 us a row written, measured): the I/O thread, not the disk, was the bottleneck of a
table 10x its DRAM budget.  Rows of one width need none of an LSM tree's generality, so this store follows
Bitcask (Sheehy and Smith, "Bitcask: A Log-Structured Hash Table for Fast Key/Value Data", Basho 2010) and
FlashStore (Debnath, Sengupta and Li, VLDB 2010): an append-only data file, an in-memory hash index from key
to the newest record, and a merge that rewrites the live records when the dead ones outnumber them.  Every
operation is a few whole-batch numpy passes; ``bench/rowstore.py`` measures it beside :class:`RocksRowStore`.

File format (``rows.log``; little-endian; every offset a multiple of the record size ``R = 8 + 4 * width``):

* a *batch* is a header of ``ceil(24 / R)`` records -- magic ``PSLOGB01`` (8 B), kind (u32: 1 put,
  2 delete), count ``n`` (u32), ``zlib.crc32`` of the payload (u32), 4 zero bytes -- then its payload:
  ``n`` records ``(key int64, row float32[width])`` for a put, ``n`` int64 keys padded to whole records
  for a delete.  The checksummed, length-prefixed batch is LevelDB's log record (leveldb/doc/log_format.md).
* ``put``/``delete`` is one ``os.write`` of one batch; the index is updated only after it returned.
* opening scans the batches in order and applies each whole one whose checksum matches; the first torn or
  damaged batch and everything after it are cut off (``ftruncate``), so the store is at its last batch that
  reached the file.

Crash guarantees -- the same as :class:`RocksRowStore`'s write-ahead log without fsync: a batch that
``put`` returned from is in the kernel's page cache and survives a killed process (not a power loss until
``flush``, which fsyncs); a batch is applied whole or not at all; no row is torn.  A failed write (a full
disk, EIO) truncates the file back to the last batch, leaves the index as it was and raises
:class:`StorageError` with one line.  Compaction writes the live records to ``rows.log.compact``, fsyncs
it and ``os.replace``\\ s it over the log (atomic; the directory is fsynced too), so a crash during a
merge leaves either the old log or the new one.

Memory.  The key index lives in DRAM: a :class:`KeyIndex` (17 B an entry at a load of 1/8 to 1/2, so 34-136
B per key, plus the old arrays while it is rebuilt: :meth:`LogRowStore.dram_bytes` states the most).  At
10^9 keys that is 34-136 GB over the cluster, 13-52 % of the rows themselves for dim-64 Adagrad rows
(264 B): acceptable when the rows are what does not fit DRAM (the index is one int64 pair a key, the row
is 33 of them), and bounded by spreading the keys over more shards or, when the key count itself is what
does not fit, by ``ssd_engine = "rocksdb"`` (whose index is on disk).  ``podscale memory`` counts it per
shard (:func:`podscale.table.estimate.estimate_table`).  Reads gather records from a read-only ``mmap``
in chunks and ``madvise(MADV_DONTNEED)`` each chunk's pages afterwards, so mapped file pages never stay
in the process's resident memory (they stay in the kernel's page cache, which is what makes reads of
recently written rows cheap).
"""
from __future__ import annotations

import errno
import mmap
import os
import threading
import zlib
from pathlib import Path

import numpy as np
import torch

from podscale.storage.rows import DiskRowStore, KeyIndex, StorageError, as_keys, ensure_writable_dir

MAGIC = b"PSLOGB01"
PUT, DELETE = 1, 2
_HEADER = np.dtype([("magic", "S8"), ("kind", "<u4"), ("count", "<u4"), ("crc", "<u4"), ("pad", "<u4")])
FILE = "rows.log"


def _write_all(fd: int, buf: memoryview) -> None:
    """``os.write`` until every byte is written (a short write is retried; an error raises OSError)."""
    while len(buf):
        n = os.write(fd, buf)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        buf = buf[n:]


class LogRowStore(DiskRowStore):
    """The SSD tier as one append-only log of fixed-size row records (see the module docstring).

    ``compact_min_bytes``: the log is merged when its dead bytes exceed its live bytes and it is at least
    this large (so a small store is not rewritten at every put).  ``read_chunk``: rows gathered per mapped
    window before its pages are released (bounds the mapped pages resident at once: each row's page and
    the kernel's fault-around neighbours, 64 KiB a row at most, so 8 MiB at the default 128)."""

    @staticmethod
    def dram_bytes(n: int) -> int:
        """DRAM beside ``n`` stored keys: the key index at its largest, and while it is rebuilt the old
        arrays (half as many entries) too."""
        return KeyIndex.max_entries(n) * KeyIndex.ENTRY_BYTES * 3 // 2

    @staticmethod
    def file_bytes(n: int, width: int) -> int:
        """Most bytes of the log holding ``n`` rows of ``width`` floats: records of ``8 + 4 * width`` B, up to
        as many dead as live ones before a merge."""
        return 2 * n * (8 + 4 * width)

    def __init__(self, path: str | os.PathLike, width: int, compact_min_bytes: int = 64 << 20,
                 read_chunk: int = 128):
        self.width = int(width)
        self.path = Path(path)
        self.compact_min_bytes = int(compact_min_bytes)
        self.read_chunk = int(read_chunk)
        self._rec = np.dtype([("key", "<i8"), ("row", "<f4", (self.width,))])
        self._hrecs = -(-_HEADER.itemsize // self._rec.itemsize)  # records per batch header
        ensure_writable_dir(self.path)
        self._file = self.path / FILE
        (self.path / (FILE + ".compact")).unlink(missing_ok=True)  # a merge a crash cut short: the log stands
        self._lock = threading.RLock()
        self._index = KeyIndex(1024)
        self._fd = -1
        self._map: mmap.mmap | None = None
        self._mapped = 0  # records covered by the mapping
        try:
            self._fd = os.open(self._file, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StorageError(f"cannot open the SSD tier at {self._file} ({e.strerror}): point ssd_path at "
                               "a directory of its own on a writable disk") from None
        self._size = self._recover()

    # -- interface --------------------------------------------------------------------------------
    def get(self, keys):
        keys = as_keys(keys)
        n = len(keys)
        rows = np.zeros((n, self.width), dtype=np.float32)
        with self._lock:
            at = self._index.get(keys.numpy())
            found = at >= 0
            if found.any():
                want = np.flatnonzero(found)
                order = want[np.argsort(at[want], kind="stable")]  # file order: neighbouring pages together
                rows[order] = self._gather(at[order])
        return torch.from_numpy(rows), torch.from_numpy(found)

    def put(self, keys, rows):
        keys = as_keys(keys)
        n = len(keys)
        if not n:
            return
        payload = np.empty(n, dtype=self._rec)
        payload["key"] = keys.numpy()
        payload["row"] = rows.detach().to("cpu", torch.float32).reshape(n, self.width).numpy()
        with self._lock:
            first = self._append(PUT, payload.view(np.uint8))
            old = self._index.upsert(keys.numpy(), np.arange(first, first + n, dtype=np.int64))
            self._dead += int((old >= 0).sum()) * self._rec.itemsize + self._hrecs * self._rec.itemsize
            self._maybe_compact()

    def delete(self, keys):
        kn = as_keys(keys).numpy()
        if not len(kn):
            return
        with self._lock:
            present = kn[self._index.get(kn) >= 0]
            if not len(present):
                return
            payload = np.zeros(self._pad(len(present) * 8), dtype=np.uint8)
            payload[: len(present) * 8] = present.astype("<i8").view(np.uint8)
            self._append(DELETE, payload, count=len(present))
            self._index.remove(present)
            self._dead += (len(present) + self._hrecs) * self._rec.itemsize + len(payload)
            self._maybe_compact()

    def scan(self, batch=65536):
        with self._lock:
            keys, at = self._index.items()
        order = np.argsort(at)
        keys, at = keys[order], at[order]
        for i in range(0, len(keys), batch):
            with self._lock:
                rows = self._gather(at[i: i + batch])
            yield torch.from_numpy(keys[i: i + batch].copy()), torch.from_numpy(rows)

    def __len__(self):
        return self._index.used

    def flush(self):
        """fsync the log: every batch so far survives a power loss too."""
        with self._lock:
            if self._fd >= 0:
                try:
                    os.fsync(self._fd)
                except OSError as e:
                    raise StorageError(f"SSD tier at {self._file}: fsync failed ({e.strerror}): check that "
                                       "disk or move ssd_path") from None

    def clear(self):
        """An empty log, swapped in atomically."""
        with self._lock:
            self._rewrite(np.zeros(0, dtype=np.int64))
            self._index.clear()

    def tier_bytes(self):
        """The log's size (live and not yet merged dead records)."""
        return [self._size]

    def close(self):
        with self._lock:
            if self._fd < 0:
                return
            self._unmap()
            try:
                os.fsync(self._fd)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = -1

    # -- internals --------------------------------------------------------------------------------
    def _pad(self, nbytes: int) -> int:
        r = self._rec.itemsize
        return -(-nbytes // r) * r

    def _header(self, kind: int, count: int, crc: int) -> bytes:
        h = np.zeros(1, dtype=_HEADER)
        h["magic"], h["kind"], h["count"], h["crc"] = MAGIC, kind, count, crc
        return h.tobytes().ljust(self._hrecs * self._rec.itemsize, b"\0")

    def _append(self, kind: int, payload: np.ndarray, count: int | None = None) -> int:
        """Write one batch at the end of the log; returns the record number of its first payload record.
        On failure the log is cut back to where it was and StorageError is raised."""
        count = len(payload) // self._rec.itemsize if count is None else count
        buf = self._header(kind, count, zlib.crc32(payload)) + payload.tobytes()
        start = self._size
        try:
            os.lseek(self._fd, start, os.SEEK_SET)
            _write_all(self._fd, memoryview(buf))
        except OSError as e:
            try:
                os.ftruncate(self._fd, start)
            except OSError:
                pass  # reopening cuts the torn batch off by its checksum
            raise StorageError(f"SSD tier at {self._file}: write failed ({e.strerror}): free space on that "
                               "disk or move ssd_path") from None
        self._size = start + len(buf)
        return start // self._rec.itemsize + self._hrecs

    def _records(self) -> np.ndarray:
        """The mapped log as records (remapped when it has grown past the mapping)."""
        n = self._size // self._rec.itemsize
        if n > self._mapped:
            self._unmap()
            self._map = mmap.mmap(self._fd, n * self._rec.itemsize, prot=mmap.PROT_READ)
            self._map.madvise(mmap.MADV_RANDOM)  # random rows: no read-ahead around each one
            self._mapped = n
        return np.frombuffer(self._map, dtype=self._rec, count=self._mapped)

    def _unmap(self) -> None:
        if self._map is not None:
            self._map.close()  # (the record views handed out are copies: nothing still exports it)
            self._map, self._mapped = None, 0

    def _gather(self, at: np.ndarray) -> np.ndarray:
        """Rows of records ``at`` (ascending), chunk by chunk, each chunk's mapped pages released after."""
        out = np.empty((len(at), self.width), dtype=np.float32)
        if not len(at):
            return out
        recs = self._records()
        r = self._rec.itemsize
        page = mmap.PAGESIZE
        try:
            for i in range(0, len(at), self.read_chunk):
                a = at[i: i + self.read_chunk]
                out[i: i + len(a)] = recs["row"][a]
                lo = int(a[0]) * r // page * page
                hi = min(len(self._map), (int(a[-1]) + 1) * r)
                self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        finally:
            del recs
        return out

    def _maybe_compact(self) -> None:
        live = self._index.used * self._rec.itemsize
        if self._size >= self.compact_min_bytes and self._dead > live:
            keys, at = self._index.items()
            self._rewrite(keys, at)

    def _rewrite(self, keys: np.ndarray, at: np.ndarray | None = None) -> None:
        """Replace the log by one put batch of the live records (``keys`` at records ``at``), written to a
        new file, fsynced and renamed over the log atomically.  (Bitcask's merge.)"""
        tmp = self.path / (FILE + ".compact")
        order = np.argsort(at) if at is not None else np.zeros(0, dtype=np.int64)
        keys = keys[order]
        at = at[order] if at is not None else order
        step = max(1, self.read_chunk) * 8
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                if len(keys):  # the header's checksum is known at the end: written last, in place
                    hsize = self._hrecs * self._rec.itemsize
                    os.lseek(fd, hsize, os.SEEK_SET)
                    crc = 0
                    for i in range(0, len(keys), step):  # in chunks: never every live row in memory
                        recs = np.empty(len(keys[i: i + step]), dtype=self._rec)
                        recs["key"] = keys[i: i + step]
                        recs["row"] = self._gather(at[i: i + step])
                        crc = zlib.crc32(recs.view(np.uint8), crc)
                        _write_all(fd, memoryview(recs.view(np.uint8)))
                    os.pwrite(fd, self._header(PUT, len(keys), crc), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self._file)
            dfd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"SSD tier at {self._file}: merging the log failed ({e.strerror}): free space "
                               "on that disk or move ssd_path") from None
        self._unmap()
        os.close(self._fd)
        self._fd = os.open(self._file, os.O_RDWR)
        self._size = os.fstat(self._fd).st_size
        self._dead = 0
        if len(keys):
            self._index.upsert(keys, np.arange(self._hrecs, self._hrecs + len(keys), dtype=np.int64))

    def _recover(self) -> int:
        """Rebuild the index from the log; cut off a torn or damaged tail.  Returns the log's valid size."""
        size = os.fstat(self._fd).st_size
        r = self._rec.itemsize
        self._dead = 0
        if size < r * self._hrecs:
            if size:
                os.ftruncate(self._fd, 0)
            return 0
        self._size = size // r * r
        pos = self._replay(self._records())
        self._unmap()
        valid = pos * r
        if valid != size:
            os.ftruncate(self._fd, valid)  # the torn or damaged tail: never a committed batch
        return valid

    def _replay(self, recs: np.ndarray) -> int:
        """Apply the whole, checksummed batches of ``recs`` (the mapped log) to the index, in order; returns
        the record number where the first torn or damaged batch (or the end) starts.  (A function of its
        own: the views of the mapping it makes die with it, before the mapping is closed.)"""
        r = self._rec.itemsize
        raw = recs.view(np.uint8)
        pos, n = 0, len(recs)  # in records
        while pos + self._hrecs <= n:
            h = np.frombuffer(bytes(raw[pos * r: pos * r + _HEADER.itemsize]), dtype=_HEADER)[0]
            kind, count = int(h["kind"]), int(h["count"])
            if h["magic"] != MAGIC or kind not in (PUT, DELETE):
                break
            body = count if kind == PUT else self._pad(8 * count) // r
            start = pos + self._hrecs
            if start + body > n or zlib.crc32(raw[start * r: (start + body) * r]) != int(h["crc"]):
                break
            if kind == PUT:
                old = self._index.upsert(recs["key"][start: start + body].copy(),
                                         np.arange(start, start + body, dtype=np.int64))
                self._dead += (int((old >= 0).sum()) + self._hrecs) * r
            else:
                gone = raw[start * r: start * r + 8 * count].view("<i8").astype(np.int64)
                self._dead += (len(self._index.remove(gone)) + self._hrecs + body) * r
            pos = start + body
        return pos
