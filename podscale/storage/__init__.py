"""Tiered memory: asynchronous file I/O for large sequential blocks (ZeRO-Infinity's NVMe offload) and row
stores for random rows by key (the parameter server's tables, the GNN's features)."""
from podscale.storage.aio import (ALIGN, AsyncFile, Request, StorageFullError, aligned_empty,
                                  measure_sequential_bandwidth)
from podscale.storage.rows import (CachedRowStore, MemoryRowStore, RocksRowStore, RowStore, StorageError,
                                   TierStats)

__all__ = ["ALIGN", "AsyncFile", "Request", "StorageFullError", "aligned_empty", "measure_sequential_bandwidth",
           "CachedRowStore", "MemoryRowStore", "RocksRowStore", "RowStore", "StorageError", "TierStats"]
