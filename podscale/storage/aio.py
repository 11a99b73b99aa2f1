"""Asynchronous file I/O for the tiered store: large sequential reads and writes on a thread pool.

ZeRO-Infinity (Rajbhandari et al. 2021, section 6.3, "overlap-centric design" and its NVMe engine) moves
optimizer state between NVMe and memory in large blocks with many requests in flight, so the disk runs at
its sequential bandwidth while compute proceeds.  Here every request is split into ``block_bytes``-sized
``os.preadv``/``os.pwritev`` calls on a pool of threads (the calls release the GIL, and several in flight
keep an NVMe queue busy); a :class:`Request` completes when all of its blocks have.

The backing file is preallocated with ``posix_fallocate`` when it is created, so a disk that cannot hold
the state fails *before* training starts, with :class:`StorageFullError` naming the path and the sizes;
a write that still hits ENOSPC/EDQUOT/EFBIG raises the same error at the step that issued it.
"""
from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class StorageFullError(OSError):
    """The swap file could not be written: the disk (or a quota/size limit) is full."""


def _bytes_view(t: torch.Tensor) -> memoryview:
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("async file I/O needs a contiguous CPU tensor")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class Request:
    """An in-flight read or write; ``wait()`` returns when every block is done (and re-raises errors)."""

    def __init__(self, futures: list[Future], store: "AsyncFile", op: str, nbytes: int):
        self._futures, self._store, self.op, self.nbytes = futures, store, op, nbytes

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        t0 = time.perf_counter()
        try:
            for f in self._futures:
                f.result()
        except OSError as err:
            if err.errno in _FULL:
                raise self._store.full_error(err) from None
            raise
        finally:
            self._store._exposed += time.perf_counter() - t0


class AsyncFile:
    """A fixed-size file read and written asynchronously in ``block_bytes`` pieces by ``threads`` threads."""

    def __init__(self, path: str | os.PathLike, size: int, threads: int = 4, block_bytes: int = 8 << 20):
        self.path, self.size, self.block = Path(path), int(size), int(block_bytes)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if self.size:
                os.posix_fallocate(self.fd, 0, self.size)
        except OSError as err:
            os.close(self.fd)
            self.path.unlink(missing_ok=True)
            if err.errno in _FULL:
                raise self.full_error(err) from None
            raise
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="podscale-aio")
        self._lock = threading.Lock()
        self.bytes_read = self.bytes_written = 0
        self.read_s = self.write_s = 0.0
        self._exposed = 0.0

    def full_error(self, err: OSError) -> StorageFullError:
        try:
            free = shutil.disk_usage(self.path.parent).free
        except OSError:
            free = -1
        return StorageFullError(err.errno, f"disk full while swapping to '{self.path}' ({os.strerror(err.errno)}; "
                                f"the swap file needs {self.size / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free): "
                                "free space or point zero.nvme_path at a larger disk")

    def _do(self, write: bool, off: int, mv: memoryview) -> None:
        t0 = time.perf_counter()
        done = 0
        while done < len(mv):
            if write:
                n = os.pwritev(self.fd, [mv[done:]], off + done)
            else:
                n = os.preadv(self.fd, [mv[done:]], off + done)
                if n == 0:
                    raise OSError(errno.EIO, f"short read at {off + done} of '{self.path}'")
            done += n
        dt = time.perf_counter() - t0
        with self._lock:
            if write:
                self.bytes_written += len(mv)
                self.write_s += dt
            else:
                self.bytes_read += len(mv)
                self.read_s += dt

    def _submit(self, write: bool, offset: int, t: torch.Tensor) -> Request:
        mv = _bytes_view(t)
        if offset < 0 or offset + len(mv) > self.size:
            raise ValueError(f"I/O of {len(mv)} bytes at {offset} is outside '{self.path}' ({self.size} bytes)")
        futs = [self.pool.submit(self._do, write, offset + i, mv[i:i + self.block])
                for i in range(0, len(mv), self.block)]
        return Request(futs, self, "write" if write else "read", len(mv))

    def read(self, offset: int, t: torch.Tensor) -> Request:
        """Fill ``t`` from the file at byte ``offset`` (asynchronously)."""
        return self._submit(False, offset, t)

    def write(self, offset: int, t: torch.Tensor) -> Request:
        """Write ``t`` to the file at byte ``offset``; ``t`` must stay unchanged until ``wait()``."""
        return self._submit(True, offset, t)

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self, remove: bool = True) -> None:
        if self.fd < 0:
            return
        self.pool.shutdown(wait=True)
        os.close(self.fd)
        self.fd = -1
        if remove:
            self.path.unlink(missing_ok=True)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def measure_sequential_bandwidth(folder: str | os.PathLike, nbytes: int = 256 << 20, threads: int = 4,
                                 block_bytes: int = 8 << 20) -> dict[str, float]:
    """Sequential write-then-read bandwidth (bytes/s) of ``folder``'s disk through this same I/O path
    (buffered, fsync after the write) — the yardstick the NVMe offload's traffic is compared with."""
    f = AsyncFile(Path(folder) / f".podscale-bw-{os.getpid()}", nbytes, threads, block_bytes)
    try:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        t0 = time.perf_counter()
        f.write(0, buf).wait()
        f.sync()
        w = nbytes / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        f.read(0, buf).wait()
        r = nbytes / (time.perf_counter() - t0)
    finally:
        f.close()
    return {"write_Bps": w, "read_Bps": r}
