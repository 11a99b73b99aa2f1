"""The sharded-table interface: rows by key, spread over ranks, read-only or trainable.

Two users share it (DESIGN.md, principle 5): the parameter server's embedding tables (pooled bags of ids,
trained by a sparse optimizer) and the GNN's distributed feature store (node features by node id,
read-only, and optional learnable node embeddings).  Every method is collective over the table's ranks
unless it says "local".
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from podscale.storage.rows import TierStats


class ShardedTable(ABC):
    """Named tables of int64 key -> float row, sharded over ranks; each rank holds its shards' rows."""

    @abstractmethod
    def lookup(self, ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rows ``[len(ids), dim]`` per table for the given keys (zeros where a key has no row);
        differentiable for trainable tables: backward updates the owners' rows."""

    @abstractmethod
    def prefetch(self, ids: dict[str, torch.Tensor]) -> None:
        """Announce the next batch's keys so their owners promote the rows to their fastest tier."""

    @abstractmethod
    def load_rows(self, name: str, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Local: write rows for keys; this rank keeps the keys (and columns) it owns."""

    @abstractmethod
    def local_rows(self, name: str) -> list[tuple[torch.Tensor, int, int, torch.Tensor]]:
        """Local: this rank's pieces of a table as ``(keys, c0, c1, values [n, c1 - c0])``."""

    @abstractmethod
    def expire(self) -> int:
        """Local: remove rows past their table's time to live; returns how many."""

    @abstractmethod
    def tier_stats(self) -> dict[str, list[TierStats]]:
        """Local: per shard, the counters of each storage tier since the last reset."""

    @abstractmethod
    def reset_stats(self) -> None:
        """Local: zero the tier counters (once per step)."""

    @abstractmethod
    def close(self) -> None:
        """Local: write dirty rows down and release files and threads."""
