"""Tiered memory: asynchronous file I/O for large sequential blocks (ZeRO-Infinity's NVMe offload)."""
from podscale.storage.aio import AsyncFile, Request, StorageFullError, measure_sequential_bandwidth

__all__ = ["AsyncFile", "Request", "StorageFullError", "measure_sequential_bandwidth"]
