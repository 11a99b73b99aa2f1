"""Row stores (memory, RocksDB, the write-back cache tier) and the per-key table features that need no
second process: admission, TTL expiry, deterministic initialisation."""
import pytest
import torch

from podscale.runtime.mesh import Mesh
from podscale.storage.log import LogRowStore
from podscale.storage.rows import CachedRowStore, MemoryRowStore, RocksRowStore, StorageError
from podscale.table import ShardedEmbeddingBags, ShardedTable, SparseSGD, TableError, TableSpec
from podscale.table.hashing import init_rows, name_seed


SSD = {"log": LogRowStore, "rocksdb": RocksRowStore}  # the SSD tier's engines: every test runs on both
engines = pytest.mark.parametrize("engine", list(SSD))


def _rows(keys, width=3):
    return keys.to(torch.float32)[:, None] * torch.ones(len(keys), width)


def test_memory_store_grows_and_reuses_slots():
    s = MemoryRowStore(3, initial_rows=2)
    k = torch.tensor([2 ** 62, 5, -1, 7])
    s.put(k, _rows(k))
    rows, found = s.get(torch.tensor([5, 6, 2 ** 62]))
    assert found.tolist() == [True, False, True] and rows[0, 0] == 5 and rows[1].abs().sum() == 0
    s.delete(torch.tensor([5]))
    s.put(torch.tensor([9]), _rows(torch.tensor([9])))
    assert len(s) == 4 and s.get(torch.tensor([5]))[1].tolist() == [False]


@engines
def test_ssd_store_persists_across_reopen(tmp_path, engine):
    s = SSD[engine](tmp_path / "db", 3)
    k = torch.tensor([1, 2 ** 40, 3])
    s.put(k, _rows(k))
    s.delete(torch.tensor([3]))
    s.close()
    s = SSD[engine](tmp_path / "db", 3)
    rows, found = s.get(torch.tensor([2 ** 40, 3, 1]))
    assert found.tolist() == [True, False, True] and rows[0, 2] == 2 ** 40
    keys, _ = next(s.scan())
    assert sorted(keys.tolist()) == [1, 2 ** 40] and len(s) == 2
    s.close()


@engines
def test_ssd_store_refuses_unwritable_path(tmp_path, engine):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StorageError, match="not writable"):
        SSD[engine](blocker / "db", 3)


@engines
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_cache_writes_dirty_rows_back_and_counts_misses(tmp_path, policy, engine):
    ssd = SSD[engine](tmp_path / policy, 3)
    cache = CachedRowStore(ssd, budget_bytes=4 * 3 * 4, policy=policy)  # 4 rows
    assert cache.capacity() == 4
    k = torch.arange(10)
    cache.put(k[:4], _rows(k[:4]))
    cache.get(k[:2])  # keys 0, 1 used again: the others go first
    cache.put(k[4:6], _rows(k[4:6]))
    cache.drain()  # (written back in the background)
    assert ssd.get(torch.tensor([2, 3]))[1].tolist() == [True, True]  # evicted dirty rows reached the SSD
    cache.reset_stats()
    rows, found = cache.get(torch.tensor([0, 2, 8]))
    assert found.tolist() == [True, True, False] and rows[1, 0] == 2
    st = cache.stats()[0]
    assert st.hits == 1 and st.misses == 2  # 2 came from the SSD, 8 is nowhere
    cache.put(torch.tensor([2]), torch.full((1, 3), 7.0))
    cache.flush()
    assert ssd.get(torch.tensor([2]))[0][0, 0] == 7.0
    with pytest.raises(StorageError, match="raise the budget"):
        cache.put(k[:5], _rows(k[:5]))
    cache.close()


@engines
def test_prefetch_promotes_without_overwriting_newer_rows(tmp_path, engine):
    ssd = SSD[engine](tmp_path / "p", 3)
    k = torch.arange(100)
    ssd.put(k, _rows(k))
    cache = CachedRowStore(ssd, budget_bytes=50 * 3 * 4)
    cache.prefetch(k[:30])
    cache.put(torch.tensor([5]), torch.full((1, 3), -1.0))  # written while the prefetch may be in flight
    cache.wait_prefetch()
    cache.reset_stats()
    rows, found = cache.get(k[:30])
    assert found.all() and cache.stats()[0].misses == 0
    assert rows[5, 0] == -1.0 and rows[7, 0] == 7.0
    cache.close()


def test_admission_ttl_and_initialisation():
    mesh = Mesh.build()
    emb = ShardedEmbeddingBags([TableSpec("t", 4, admit_after=3, ttl_steps=2)], mesh, SparseSGD(0.0), seed=9)
    one = lambda ids: {"t": (torch.tensor(ids), torch.tensor([0]))}
    out = emb(one([11]))["t"]
    assert out.abs().sum() == 0 and not emb.local_rows("t")  # seen once: zeros, no row
    out = emb(one([11, 11, 12]))["t"]  # 11 seen three times now: admitted, initial row
    want = init_rows(name_seed(9, "t"), torch.tensor([11]), 0, 4, 0.5)
    assert torch.allclose(out, 2 * want)  # 12 is not admitted yet: it adds zeros
    (keys, c0, c1, w), = emb.local_rows("t")
    assert keys.tolist() == [11] and torch.equal(w, want)
    for _ in range(3):
        emb(one([12]))
    assert emb.expire() == 1  # 11 unused for 3 steps (> ttl 2); 12 was admitted at its 3rd sighting
    assert [k.tolist() for k, *_ in emb.local_rows("t")] == [[12]]


def test_read_only_rows_beside_a_trainable_table():
    """The feature-store use: loaded read-only rows by key, next to learnable embeddings."""
    mesh = Mesh.build()
    emb = ShardedEmbeddingBags([TableSpec("feat", 3, trainable=False), TableSpec("emb", 2)], mesh,
                               SparseSGD(1.0), seed=1)
    assert isinstance(emb, ShardedTable)  # the interface the GNN feature store programs against
    keys = torch.tensor([10, 2 ** 50, 7])
    emb.load_rows("feat", keys, _rows(keys))
    got = emb.lookup({"feat": torch.tensor([7, 8, 10, 7]), "emb": torch.tensor([1])})
    assert got["feat"][:, 0].tolist() == [7.0, 0.0, 10.0, 7.0]
    before = got["emb"].detach().clone()
    (got["feat"].sum() + got["emb"].sum()).backward()
    after = emb.lookup({"feat": torch.tensor([7]), "emb": torch.tensor([1])})
    assert torch.allclose(after["emb"], before - 1.0)  # SGD step of lr 1 on a gradient of ones
    assert after["feat"][0, 0] == 7.0  # read-only rows never change
    assert len(emb.local_rows("feat")[0][0]) == 3  # a lookup of an unknown key creates no row


class _FullDisk(MemoryRowStore):
    """A lower tier whose writes fail as on a full disk."""

    def put(self, keys, rows):
        raise StorageError("SSD tier at /full: write failed (No space left on device)")


class _FillingDisk(MemoryRowStore):
    """A lower tier whose writes fail once ``full`` is set."""

    full = False

    def put(self, keys, rows):
        if self.full:
            raise StorageError("SSD tier at /full: write failed (No space left on device)")
        super().put(keys, rows)


def test_a_failed_write_back_is_raised_at_the_next_lookup_and_loses_no_row(tmp_path):
    mesh = Mesh.build()
    # a DRAM budget over an SSD tier: the lookups agree on store errors
    spec = TableSpec("t", 2, dram_budget_bytes=2 * 4 * 3, ssd_path=str(tmp_path))
    emb = ShardedEmbeddingBags([spec], mesh, SparseSGD(1.0), seed=1)
    emb.stores[(0, 0)].close()
    cache = CachedRowStore(_FullDisk(emb.row_floats(0, emb.shards[0][0])), budget_bytes=2 * 4 * 4)  # 2 rows
    emb.stores[(0, 0)] = cache  # the same cache over a lower tier that cannot be written
    bag = lambda ids: {"t": (torch.tensor(ids), torch.tensor([0]))}
    emb(bag([1, 2]))["t"].sum().backward()  # fills the cache with two dirty rows
    before = cache.get(torch.tensor([1, 2]))[0].clone()
    emb(bag([3]))  # a new row must evict a dirty one: its write-back (in the background) fails
    with pytest.raises(TableError, match="could not read or write the SSD tier on rank 0"):
        emb(bag([3]))  # raised at the next lookup, which waits for the write-backs queued before it
    after, found = cache.get(torch.tensor([1, 2]))
    assert found.all() and torch.equal(before, after)  # the evicted dirty row is kept, and readable
    with pytest.raises(StorageError, match="No space left"):
        cache.flush()  # written again, and failing again: still kept
    assert torch.equal(cache.get(torch.tensor([1, 2]))[0], before)
    # an update whose write fails (the disk fills up between the lookup and the update) is raised at the
    # next lookup
    store = emb.stores[(0, 0)] = _FillingDisk(emb.row_floats(0, emb.shards[0][0]))
    loss = emb(bag([1]))["t"].sum()
    store.full = True
    loss.backward()
    with pytest.raises(TableError, match="could not be written to the SSD tier on rank 0"):
        emb(bag([1]))


def test_memory_store_write_after_read_reuses_the_read_slots():
    """A read, new keys created, the same keys written back (a table step), a delete and a reinsert: every
    row lands on its own key whether or not the slots of the read are reused."""
    s = MemoryRowStore(2, initial_rows=2)
    s.put(torch.tensor([5, 9]), torch.tensor([[5.0, 5.0], [9.0, 9.0]]))
    keys = torch.tensor([9, 3, 5, 7])
    rows, found = s.get(keys)
    assert found.tolist() == [True, False, True, False]
    assert rows[:, 0].tolist() == [9.0, 0.0, 5.0, 0.0]  # absent keys read zeros
    s.put(torch.tensor([3]), torch.tensor([[3.0, 3.0]]))            # created after the read
    s.put(keys, keys[:, None].float().repeat(1, 2) + 0.5)            # the update of all four
    rows, found = s.get(torch.tensor([3, 5, 7, 9]))
    assert found.all() and rows[:, 0].tolist() == [3.5, 5.5, 7.5, 9.5]
    keys = torch.tensor([9, 5])
    s.get(keys)
    s.delete(torch.tensor([5]))
    s.put(torch.tensor([11]), torch.tensor([[11.0, 11.0]]))         # takes 5's freed slot
    s.put(keys, torch.tensor([[1.0, 1.0], [2.0, 2.0]]))              # 5 again: a new slot, not 11's
    rows, found = s.get(torch.tensor([9, 5, 11]))
    assert found.all() and rows[:, 0].tolist() == [1.0, 2.0, 11.0]


@engines
def test_prefetch_inserts_what_fits_beside_the_rows_in_use(tmp_path, engine):
    """A prefetch never evicts the rows of the step in flight (its last get) nor announced rows already
    cached; what does not fit beside them stays below (read at the next get) and nothing is lost."""
    ssd = SSD[engine](tmp_path / "f", 3)
    k = torch.arange(20)
    ssd.put(k, _rows(k))
    cache = CachedRowStore(ssd, budget_bytes=4 * 3 * 4)  # 4 rows
    cache.get(k[:3])                                      # the step in flight holds 3 of them
    cache.prefetch(k[3:6])                                # 3 announced, room for 1
    cache.wait_prefetch()
    cache.put(k[:3], _rows(k[:3]) + 0.5)                  # the step writes its rows back: all still cached
    cache.reset_stats()
    rows, found = cache.get(k[3:6])
    assert found.all() and torch.equal(rows, _rows(k[3:6]))
    st = cache.stats()[0]
    assert (st.hits, st.misses) == (1, 2)
    rows, found = cache.get(k[:3])
    assert found.all() and torch.equal(rows, _rows(k[:3]) + 0.5)
    cache.close()


# -- the log-structured SSD tier (storage/log.py) ------------------------------------------------------------
def _random_ops(seed, n=12):
    """A reproducible mix of puts (new and overwritten keys), deletes and reads over a small key space."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        keys = torch.randperm(200, generator=g)[: int(torch.randint(1, 60, (1,), generator=g))] * 7919 - 500
        op = int(torch.randint(0, 4, (1,), generator=g))
        yield ("delete" if op == 0 else "put" if op < 3 else "get"), keys, torch.randn(len(keys), 3, generator=g)


def _contents(s):
    keys, rows = zip(*s.scan(batch=17)) if len(s) else ((torch.zeros(0, dtype=torch.int64),), (torch.zeros(0, 3),))
    keys, rows = torch.cat(keys), torch.cat(rows)
    order = torch.argsort(keys)
    return keys[order], rows[order]


def test_log_store_matches_rocksdb_through_reopen_and_compaction(tmp_path):
    """The same operations on both engines give the same reads, scans and lengths -- with the log merged at
    every chance (no size floor) and reopened half way."""
    log = LogRowStore(tmp_path / "log", 3, compact_min_bytes=0)
    rocks = RocksRowStore(tmp_path / "rocks", 3)
    merged = False
    for i, (op, keys, rows) in enumerate(_random_ops(3, 40)):
        if i == 20:
            log.close()
            log = LogRowStore(tmp_path / "log", 3, compact_min_bytes=0)
        before = log.tier_bytes()[0]
        for s in (log, rocks):
            getattr(s, op)(*((keys, rows) if op == "put" else (keys,)))
        merged |= log.tier_bytes()[0] < before
        a, b = log.get(keys), rocks.get(keys)
        assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0]), (i, op)
        assert len(log) == len(rocks)
    assert merged, "the log was never merged"
    ka, ra = _contents(log)
    kb, rb = _contents(rocks)
    assert torch.equal(ka, kb) and torch.equal(ra, rb)
    # a merged log holds only live records and its header: dead ones are gone
    log.close()
    log = LogRowStore(tmp_path / "log", 3, compact_min_bytes=0)
    log.put(ka, ra + 1)  # every row overwritten: the dead records outnumber the live ones, merged at once
    assert log.tier_bytes()[0] == (len(ka) + 2) * (8 + 4 * 3)  # live records and one 2-record header
    assert torch.equal(_contents(log)[1], rb + 1)
    log.clear()
    assert len(log) == 0 and log.tier_bytes() == [0]
    for s in (log, rocks):
        s.close()
    assert len(LogRowStore(tmp_path / "log", 3)) == 0


def test_log_store_cuts_a_torn_or_damaged_tail(tmp_path):
    """Reopening applies whole checksummed batches only: a batch cut short (a killed write) or with a flipped
    byte is dropped with everything after it, and the store goes on from its last whole batch."""
    s = LogRowStore(tmp_path / "db", 3)
    k = torch.arange(10)
    s.put(k, _rows(k))
    good = s.tier_bytes()[0]
    s.put(k[:4], _rows(k[:4]) + 0.5)
    s.close()
    path = tmp_path / "db" / "rows.log"
    data = path.read_bytes()
    for damaged in (data[: len(data) - 5], data[: good + 50] + bytes([data[good + 50] ^ 1]) + data[good + 51:]):
        path.write_bytes(damaged)
        s = LogRowStore(tmp_path / "db", 3)
        rows, found = s.get(k)
        assert found.all() and torch.equal(rows, _rows(k))  # the first batch, not half the second
        assert path.stat().st_size == good
        s.put(k[:2], _rows(k[:2]) + 2)  # appended after the cut
        s.close()
        s = LogRowStore(tmp_path / "db", 3)
        assert torch.equal(s.get(k[:3])[0], torch.cat([_rows(k[:2]) + 2, _rows(k[2:3])]))
        s.close()


def test_log_store_write_failure_keeps_the_last_batch(tmp_path, monkeypatch):
    """A disk that fills up half way through a batch: StorageError (one line), the log cut back, the index as
    before; the same store goes on once there is room, and reopens at its last whole batch."""
    import podscale.storage.log as logmod

    s = LogRowStore(tmp_path / "db", 3)
    k = torch.arange(8)
    s.put(k, _rows(k))
    size = s.tier_bytes()[0]
    real = logmod.os.write

    def full(fd, buf):
        real(fd, buf[: len(buf) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(logmod.os, "write", full)
    with pytest.raises(StorageError, match=r"write failed \(No space left on device\): free space"):
        s.put(torch.tensor([3, 100]), torch.full((2, 3), 9.0))
    with pytest.raises(StorageError, match="No space left"):
        s.delete(torch.tensor([1]))
    assert s.tier_bytes()[0] == size == (tmp_path / "db" / "rows.log").stat().st_size
    rows, found = s.get(torch.tensor([3, 100, 1]))
    assert found.tolist() == [True, False, True] and rows[0, 0] == 3
    monkeypatch.setattr(logmod.os, "write", real)
    s.put(torch.tensor([100]), torch.full((1, 3), 5.0))
    s.close()
    s = LogRowStore(tmp_path / "db", 3)
    assert len(s) == 9 and s.get(torch.tensor([100]))[0][0, 0] == 5.0
    s.close()


def _probe_often(path: str, times: int, queue) -> None:
    from pathlib import Path
    from podscale.storage.rows import unwritable_reason
    queue.put([r for r in (unwritable_reason(Path(path)) for _ in range(times)) if r][:1])


def test_processes_probing_one_ssd_folder_at_once_never_fail_each_other(tmp_path):
    """Two runs (or every rank of one) check the SSD folder at start: each writes and removes a probe of its own
    name, so none removes another's and reports the folder unwritable (a shared probe name did, once in CI), and
    no probe is left behind."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    workers = [ctx.Process(target=_probe_often, args=(str(tmp_path), 500, queue)) for _ in range(2)]
    for w in workers:
        w.start()
    failures = [queue.get(timeout=60) for _ in workers]
    for w in workers:
        w.join(60)
    assert failures == [[], []]
    assert list(tmp_path.iterdir()) == []

