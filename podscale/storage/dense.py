"""A dense-range row store: the rows of keys ``[0, num_keys)`` in one slab, the key is the slot.

For a table that declares its id range (``TableSpec(num_keys=..., storage="dense")``) a shard's rows need
no key index: ``slot = key`` is arithmetic, every row is created up front with the table's deterministic
per-key initialisation (:func:`~podscale.table.hashing.init_rows` through the ``init`` callable), so a
step does no index search, no row creation and no slab growth -- the layout of ``nn.EmbeddingBag`` and of
FBGEMM's table-batched embeddings (Khudia et al., "FBGEMM", 2021; TorchRec's in-memory tables), which is
why results stay equal to the single-process reference whatever the store.

The keyed store (:class:`~podscale.storage.rows.MemoryRowStore`) remains the one for arbitrary int64 keys,
admission and TTL.  Both implement :class:`~podscale.storage.rows.RowStore`, and the table picks one from
the spec, once.  To keep the keyed store's observable contents, a row counts as *held* (``scan``,
``__len__``, checkpoints) once it was written (``put``); a key never written reads its initial row, which
any rank can recompute, so a checkpoint need not hold it.  ``delete`` returns a row to its initial value.
"""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import torch

from podscale.storage.rows import RowStore, StorageError

# Rows initialised per call of ``init`` (bounds the temporaries of the per-key hash).
INIT_CHUNK = 65536


class DenseRowStore(RowStore):
    """Rows of keys ``[0, num_keys)``, ``width`` float32 values each, created up front by ``init(keys)``
    (full stored rows ``[len(keys), width]``).  ``get`` of an in-range key always finds its row."""

    def __init__(self, num_keys: int, width: int, init: Callable[[torch.Tensor], torch.Tensor]):
        self.width = int(width)
        self.num_keys = int(num_keys)
        self._init = init
        try:
            self._slab = torch.empty(self.num_keys, self.width)
        except RuntimeError as e:  # out of memory: say how much was asked for
            raise StorageError(f"a dense store of {self.num_keys} rows x {self.width} floats "
                               f"({4 * self.num_keys * self.width} B) does not fit in memory ({e}): use "
                               "storage='keyed' or a DRAM budget over an SSD tier") from e
        self._np = self._slab.numpy()  # numpy's fancy indexing copies whole rows: faster than index_copy_
        self._written = np.zeros(self.num_keys, dtype=bool)
        self._reset(np.arange(self.num_keys, dtype=np.int64))

    def _reset(self, keys: np.ndarray) -> None:
        for a in range(0, len(keys), INIT_CHUNK):
            k = keys[a: a + INIT_CHUNK]
            self._np[k] = self._init(torch.from_numpy(k)).numpy()

    def _check(self, keys: torch.Tensor) -> np.ndarray:
        k = keys.to(torch.int64).reshape(-1).cpu().numpy()
        if len(k) and (k.min() < 0 or k.max() >= self.num_keys):
            raise StorageError(f"a dense store of keys [0, {self.num_keys}) got a key outside that range: "
                               "declare a larger num_keys or use storage='keyed'")
        return k

    def get(self, keys):
        k = self._check(keys)
        return torch.from_numpy(np.take(self._np, k, axis=0)), torch.ones(len(k), dtype=torch.bool)

    def put(self, keys, rows):
        k = self._check(keys)
        self._np[k] = rows.to(torch.float32).cpu().numpy()
        self._written[k] = True

    def delete(self, keys):
        k = self._check(keys)
        k = k[self._written[k]]
        self._reset(k)
        self._written[k] = False

    def scan(self, batch: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        keys = np.flatnonzero(self._written)
        for a in range(0, len(keys), batch):
            k = keys[a: a + batch]
            yield torch.from_numpy(k), torch.from_numpy(self._np[k])

    def __len__(self) -> int:
        return int(self._written.sum())

    def clear(self) -> None:
        """Every row back to its initial value (only the written ones differ from it)."""
        self.delete(torch.from_numpy(np.flatnonzero(self._written)))

    def tier_bytes(self) -> list[int]:
        return [self._slab.numel() * 4]
