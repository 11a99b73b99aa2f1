"""Memory per tier and expected DRAM hit rate of a sharded table, before it runs (``podscale memory --table-rows``).

Bytes: a stored row is ``4 * (dim + state + 1)`` (float32 weights, the sparse optimizer's state --
row-wise Adagrad 1 float, lazy Adam ``2 * dim``, SGD none -- and the last-used step that TTL reads).  Each
of ``shards`` ranks holds ``rows / shards`` rows: all in DRAM without a budget; with one, at most the budget
in the DRAM tier (a preallocated slab) plus its key map, and every row in the SSD tier.  The SSD engine
adds DRAM of its own (:meth:`~podscale.storage.rows.DiskRowStore.dram_bytes`): the log store's key index
(every key of the shard: 17 B an entry, 4-8 entries a key at its largest), RocksDB's memtables and block
cache (a constant); on disk the log holds up to twice the live records before a merge, RocksDB the rows plus
its per-key overhead (key, sequence number, block index).

Hit rate: ids drawn from the bounded Zipf law of :func:`podscale.table.data.zipf_ranks`, whose CDF is
``P(rank < k) = ((k + 1)^(1 - a) - 1) / ((n + 1)^(1 - a) - 1)`` (``log(k + 1) / log(n + 1)`` at ``a = 1``).
A frequency-ordered cache of ``k`` rows (LFU at steady state) keeps the ``k`` most popular ids, so its hit
rate per draw is ``P(rank < k)`` (per step's deduplicated ids: see :func:`hit_rate`); row-wise sharding hashes ids uniformly over the shards, so each shard's cache of
``k`` rows holds about ``k * shards`` of the globally most popular.  LRU keeps fewer of them: Che's
approximation (Che, Tung and Wang, IEEE JSAC 2002) gives its hit rate from the characteristic time ``T``
with ``sum_i (1 - exp(-p_i T)) = k``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from podscale.sortunique import unique
from podscale.storage import SSD_ENGINES
from podscale.storage.rows import CachedRowStore, MemoryRowStore

STATE_FLOATS = {"adagrad": lambda d: 1, "sgd": lambda d: 0, "adam": lambda d: 2 * d}


def row_bytes(dim: int, optimizer: str = "adagrad") -> int:
    return 4 * (dim + STATE_FLOATS[optimizer](dim) + 1)


def zipf_cdf(k: np.ndarray | float, n: int, alpha: float) -> np.ndarray:
    """P(rank < k) of the generator's bounded Zipf(``alpha``) law over ``n`` ranks."""
    k = np.minimum(np.asarray(k, dtype=np.float64), n)
    if abs(alpha - 1.0) < 1e-9:
        return np.log(k + 1.0) / math.log(n + 1.0)
    e = 1.0 - alpha
    return ((k + 1.0) ** e - 1.0) / ((n + 1.0) ** e - 1.0)


def _step_demand(n: int, alpha: float, draws: int | None, buckets: int = 4096, split: int = 0):
    """Ranks ``[0, n)`` cut into log-spaced buckets (one edge at ``split``): the edges, ids per bucket and
    each id's chance ``q`` to be drawn at least once in ``draws`` Zipf(``alpha``) draws,
    ``q_i = 1 - (1 - p_i)^draws`` (``q_i = p_i`` per draw without ``draws``)."""
    edges = unique(np.concatenate([[0, split, n], np.round(np.geomspace(1, n, buckets)).astype(np.int64)]))
    count = np.diff(edges).astype(np.float64)
    p = np.diff(zipf_cdf(edges, n, alpha)) / count       # per-id probability within each bucket
    q = p if draws is None else -np.expm1(draws * np.log1p(-np.minimum(p, 1 - 1e-15)))
    return edges, count, q


def expected_distinct(n: int, alpha: float, draws: float, buckets: int = 4096) -> float:
    """Expected number of distinct ids in ``draws`` Zipf(``alpha``) draws over ``n`` keys: ``sum_i q_i``
    with ``q_i`` as in :func:`hit_rate` -- what a step's deduplication leaves of its ids, so the rows a
    table looks up, exchanges and updates."""
    if draws <= 0:
        return 0.0
    _, count, q = _step_demand(n, alpha, draws, buckets)
    return float(min(draws, (count * q).sum()))


def expected_new(n: int, alpha: float, draws: float, step: int, buckets: int = 4096) -> float:
    """Expected ids of step ``step`` (1-based, ``draws`` Zipf draws a step) that no earlier step drew:
    ``sum_i q_i (1 - q_i)^(step - 1)`` -- the keys a keyed store creates rows for in that step."""
    if draws <= 0 or step < 1:
        return 0.0
    _, count, q = _step_demand(n, alpha, draws, buckets)
    return float((count * q * np.exp((step - 1) * np.log1p(-np.minimum(q, 1 - 1e-15)))).sum())


def hit_rate(n: int, alpha: float, cache_rows: int, shards: int = 1, policy: str = "lfu",
             ids_per_step: int | None = None, buckets: int = 4096) -> float:
    """Expected share of the rows a step needs that its shard's DRAM cache (``cache_rows`` rows, ``policy``)
    already holds, for Zipf(``alpha``) ids over ``n`` keys hashed over ``shards``.

    With ``ids_per_step`` (the ids of one global batch, all tables' draws for this table), requests are the
    step's deduplicated ids -- what the table looks up and its counters count: id ``i`` is needed in a
    step with probability ``q_i = 1 - (1 - p_i)^m``; without it, every draw counts (``q_i = p_i``).  LFU
    keeps the ``cache_rows * shards`` most popular ids; LRU follows Che's approximation over steps.
    """
    k = cache_rows * shards
    if k >= n:
        return 1.0
    edges, count, q = _step_demand(n, alpha, ids_per_step, buckets, k)
    demand = count * q                                   # expected requests per step from each bucket
    if policy == "lfu":
        return float(demand[edges[:-1] < k].sum() / demand.sum())
    lo, hi = 0.0, 1.0
    while (count * -np.expm1(-q * hi)).sum() < k:
        hi *= 2
    for _ in range(100):
        t = (lo + hi) / 2
        if (count * -np.expm1(-q * t)).sum() < k:
            lo = t
        else:
            hi = t
    return float((demand * -np.expm1(-q * hi)).sum() / demand.sum())


@dataclass
class TableEstimate:
    rows: int
    row_bytes: int
    shards: int
    dram_bytes: float          # per shard
    ssd_bytes: float           # per shard
    cache_rows: int | None     # per shard
    hit_rate: float | None
    ssd_engine: str | None = None  # the SSD tier's engine (its DRAM is in dram_bytes)


def estimate_table(rows: int, dim: int, shards: int = 1, optimizer: str = "adagrad",
                   dram_budget_bytes: int | None = None, alpha: float = 1.05, policy: str = "lfu",
                   ids_per_step: int | None = None, ssd_engine: str = "log") -> TableEstimate:
    """Bytes per tier per shard and the expected DRAM hit rate of a table of ``rows`` keys (the DRAM figure
    includes the SSD engine's own: ``ssd_engine``, as in ``TableSpec``)."""
    if rows < 1 or dim < 1 or shards < 1:
        raise ValueError(f"rows={rows}, dim={dim} and shards={shards} must be positive")
    rb = row_bytes(dim, optimizer)
    per = math.ceil(rows / shards)
    if dram_budget_bytes is None:
        return TableEstimate(rows, rb, shards, per * rb + MemoryRowStore.key_bytes(per), 0.0, None, 1.0)
    cache = int(dram_budget_bytes) // rb
    if cache < 1:
        raise ValueError(f"a DRAM budget of {dram_budget_bytes} B holds no row of {rb} B: raise it")
    if ssd_engine not in SSD_ENGINES:
        raise ValueError(f"ssd_engine '{ssd_engine}' is not one of {', '.join(SSD_ENGINES)}")
    engine = SSD_ENGINES[ssd_engine]
    hit = hit_rate(rows, alpha, cache, shards, policy, ids_per_step)
    return TableEstimate(rows, rb, shards, cache * rb + CachedRowStore.key_bytes(cache) + engine.dram_bytes(per),
                         engine.file_bytes(per, rb // 4), cache, hit, ssd_engine)


def format_table_estimate(e: TableEstimate, alpha: float, policy: str) -> str:
    mib = 2 ** 20
    lines = [f"table of {e.rows:,} rows x {e.row_bytes} B ({e.rows * e.row_bytes / mib:,.1f} MiB) over {e.shards} "
             f"shard(s), per shard:",
             f"  DRAM tier  {e.dram_bytes / mib:12,.1f} MiB"
             + (f"  ({e.cache_rows:,} rows cached)" if e.cache_rows is not None else "  (every row)"),
             f"  SSD tier   {e.ssd_bytes / mib:12,.1f} MiB"
             + (f"  ({e.ssd_engine}; DRAM above includes its index and buffers)" if e.ssd_engine else "")]
    if e.cache_rows is not None:
        lines.append(f"  expected DRAM hit rate {e.hit_rate:.1%} ({policy.upper()}, Zipf({alpha}) ids)")
    return "\n".join(lines)
