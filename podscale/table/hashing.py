"""Deterministic per-key functions: the owner of a key and a key's initial row.

Both are pure functions of (seed, table name, key[, column]), computed with SplitMix64 (Steele, Lea and
Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014) in wrapping uint64 arithmetic.  So a
row is the same whichever rank creates it and however the table is sharded -- row-wise, table-wise or
column-wise (the column index is hashed too, so a column block draws exactly its columns of the row) --
as the GPT draws each parameter from a generator seeded by its name.
"""
from __future__ import annotations

import zlib
from typing import Protocol

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def name_seed(seed: int, name: str) -> int:
    """A 64-bit value for (seed, table name): the same on every rank and every run."""
    return int(mix64(np.array([(seed << 32) ^ zlib.crc32(name.encode())], dtype=np.uint64))[0])


class KeyOwner(Protocol):
    """Where row-wise sharding puts keys: ``owner(keys, n)`` is the rank in ``[0, n)`` of each int64 key,
    the same on every rank.  :func:`owner_of` (a hash) is the default."""

    def __call__(self, keys: torch.Tensor, n: int) -> torch.Tensor: ...


def owner_of(keys: torch.Tensor, n: int) -> torch.Tensor:
    """Rank in ``[0, n)`` that owns each int64 key under row-wise sharding (hash mod n)."""
    if n == 1:
        return torch.zeros(len(keys), dtype=torch.int64)
    u = keys.numpy().view(np.uint64)
    return torch.from_numpy((mix64(u ^ np.uint64(0x5EED)) % np.uint64(n)).astype(np.int64))


def init_rows(seed: int, keys: torch.Tensor, col_start: int, col_end: int, scale: float) -> torch.Tensor:
    """Initial rows of ``keys``, columns ``[col_start, col_end)``: uniform in ``[-scale, scale)``.

    ``seed`` is :func:`name_seed` of the table.  Each value hashes (seed, key, column), so any column
    block of any key is drawn identically wherever it lives.
    """
    k = keys.numpy().view(np.uint64)
    cols = np.arange(col_start, col_end, dtype=np.uint64)
    with np.errstate(over="ignore"):
        base = mix64(k ^ np.uint64(seed))
        z = mix64(base[:, None] + cols[None, :] * _GOLDEN)
    unit = (z >> np.uint64(40)).astype(np.float64) / float(1 << 24)  # 24 random bits -> [0, 1)
    return torch.from_numpy(((2.0 * unit - 1.0) * scale).astype(np.float32))
