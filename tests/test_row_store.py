"""Row stores (memory, RocksDB, the write-back cache tier) and the per-key table features that need no
second process: admission, TTL expiry, deterministic initialisation."""
import pytest
import torch

from podscale.runtime.mesh import Mesh
from podscale.storage.rows import CachedRowStore, MemoryRowStore, RocksRowStore, StorageError
from podscale.table import ShardedEmbeddingBags, ShardedTable, SparseSGD, TableError, TableSpec
from podscale.table.hashing import init_rows, name_seed


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


def test_rocks_store_persists_across_reopen(tmp_path):
    s = RocksRowStore(tmp_path / "db", 3)
    k = torch.tensor([1, 2 ** 40, 3])
    s.put(k, _rows(k))
    s.delete(torch.tensor([3]))
    s.close()
    s = RocksRowStore(tmp_path / "db", 3)
    rows, found = s.get(torch.tensor([2 ** 40, 3, 1]))
    assert found.tolist() == [True, False, True] and rows[0, 2] == 2 ** 40
    keys, _ = next(s.scan())
    assert sorted(keys.tolist()) == [1, 2 ** 40] and len(s) == 2
    s.close()


def test_rocks_store_refuses_unwritable_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StorageError, match="not writable"):
        RocksRowStore(blocker / "db", 3)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_cache_writes_dirty_rows_back_and_counts_misses(tmp_path, policy):
    ssd = RocksRowStore(tmp_path / policy, 3)
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


def test_prefetch_promotes_without_overwriting_newer_rows(tmp_path):
    ssd = RocksRowStore(tmp_path / "p", 3)
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


def test_prefetch_inserts_what_fits_beside_the_rows_in_use(tmp_path):
    """A prefetch never evicts the rows of the step in flight (its last get) nor announced rows already
    cached; what does not fit beside them stays below (read at the next get) and nothing is lost."""
    ssd = RocksRowStore(tmp_path / "f", 3)
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
