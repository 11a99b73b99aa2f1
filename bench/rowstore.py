"""SSD-tier engines side by side: podscale's log-structured row store (storage/log.py) against RocksDB through
rocksdict (storage/rows.py's RocksRowStore), on the same keys and rows, in one process.

The workload is what the SSD tier sees under ``bench/ps.py``'s ssd variant: one shard's table of ``--keys``
rows of the table's real width (dim 64 + row-wise Adagrad's 1 float + the last-used step = 66 floats,
264 B), and per round one batch of ``--batch`` distinct keys drawn Zipf(1.05) over the table (a step's
working set of one shard), read with one ``get`` and written back with one ``put`` -- the I/O thread's
prefetch read and write-back.  Prints rows/s of get and of put per engine (median of ``--rounds`` rounds)
and the ratios log / rocksdb.  The issue asks the purpose-built store to beat RocksDB by >= 2x on both.

    python bench/rowstore.py              # 1M keys, batches of 4096, 30 rounds
    python bench/rowstore.py --small      # 100k keys, a quick check
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from podscale.storage.log import LogRowStore  # noqa: E402
from podscale.storage.rows import RocksRowStore  # noqa: E402
from podscale.table.data import rank_to_id, zipf_ranks  # noqa: E402

WIDTH = 64 + 1 + 1


def batches(keys: int, batch: int, rounds: int, alpha: float) -> list[torch.Tensor]:
    """``rounds`` batches of ``batch`` distinct table ids, Zipf(``alpha``) by popularity rank."""
    rng = np.random.default_rng(7)
    out = []
    for _ in range(rounds):
        ranks = np.unique(zipf_ranks(rng, 4 * batch, keys, alpha))
        while len(ranks) < batch:  # (a skewed draw repeats ids: draw until the batch is distinct)
            ranks = np.unique(np.concatenate([ranks, zipf_ranks(rng, batch, keys, alpha)]))
        out.append(torch.from_numpy(rank_to_id(11, rng.permutation(ranks)[:batch])))
    return out


def run(store, keys: int, work: list[torch.Tensor]) -> tuple[float, float]:
    """Fill ``store`` with every key, then time get and put of each batch; rows/s (medians)."""
    all_ids = torch.from_numpy(rank_to_id(11, np.arange(keys)))
    for a in range(0, keys, 65536):
        k = all_ids[a: a + 65536]
        store.put(k, torch.randn(len(k), WIDTH))
    store.flush()
    tg, tp = [], []
    for k in work:
        t0 = time.perf_counter()
        rows, found = store.get(k)
        t1 = time.perf_counter()
        store.put(k, rows + 1.0)
        t2 = time.perf_counter()
        assert bool(found.all())
        tg.append(t1 - t0)
        tp.append(t2 - t1)
    n = len(work[0])
    return n / statistics.median(tg), n / statistics.median(tp)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="100k keys, 10 rounds")
    ap.add_argument("--keys", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--alpha", type=float, default=1.05)
    args = ap.parse_args(argv)
    keys = args.keys or (100_000 if args.small else 1_000_000)
    rounds = args.rounds or (10 if args.small else 30)
    work = batches(keys, args.batch, rounds, args.alpha)
    print(f"bench/rowstore.py: {keys:,} keys x {WIDTH} floats ({4 * WIDTH} B rows), batches of {args.batch} "
          f"distinct Zipf({args.alpha}) keys, {rounds} rounds (median)", flush=True)
    res = {}
    for name, make in [("log", lambda d: LogRowStore(d, WIDTH)), ("rocksdb", lambda d: RocksRowStore(d, WIDTH))]:
        with tempfile.TemporaryDirectory(prefix=f"podscale-bench-{name}-") as d:
            store = make(d)
            try:
                res[name] = run(store, keys, work)
            finally:
                store.close()
        g, p = res[name]
        print(f"  {name:8s} get {g / 1e6:8.3f} M rows/s   put {p / 1e6:8.3f} M rows/s", flush=True)
    (lg, lp), (rg, rp) = res["log"], res["rocksdb"]
    print(f"  ratio log / rocksdb: get {lg / rg:.2f}x, put {lp / rp:.2f}x "
          f"({'>= 2x on both: the log store is the default' if min(lg / rg, lp / rp) >= 2 else 'below 2x'})")


if __name__ == "__main__":
    main()
