"""Tiered memory: asynchronous file I/O for large sequential blocks (ZeRO-Infinity's NVMe offload) and row
stores for random rows by key (the parameter server's tables, the GNN's features)."""
from podscale.storage.aio import (ALIGN, AsyncFile, Request, StorageFullError, aligned_empty,
                                  measure_sequential_bandwidth)
from podscale.storage.rows import (CachedRowStore, DiskRowStore, MemoryRowStore, RocksRowStore, RowStore,
                                   StorageError, TierStats)
from podscale.storage.log import LogRowStore

# the SSD tier's engines by name (TableSpec.ssd_engine, [model] ssd_engine); the first is the default:
# bench/rowstore.py measured the log store >= 2x RocksDB on both batch reads and batch writes
SSD_ENGINES: dict[str, type[DiskRowStore]] = {"log": LogRowStore, "rocksdb": RocksRowStore}

__all__ = ["ALIGN", "AsyncFile", "Request", "StorageFullError", "aligned_empty", "measure_sequential_bandwidth",
           "CachedRowStore", "DiskRowStore", "LogRowStore", "MemoryRowStore", "SSD_ENGINES", "RocksRowStore",
           "RowStore", "StorageError", "TierStats"]
