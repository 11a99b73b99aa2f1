"""Tiered memory: asynchronous file I/O for large sequential blocks (ZeRO-Infinity's NVMe offload)."""
from podscale.storage.aio import (ALIGN, AsyncFile, Request, StorageFullError, aligned_empty,
                                  measure_sequential_bandwidth)

__all__ = ["ALIGN", "AsyncFile", "Request", "StorageFullError", "aligned_empty", "measure_sequential_bandwidth"]
