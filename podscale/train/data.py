"""Byte-level corpora and a deterministic, resumable loader sharded by data-parallel rank.

The sample order is generic (any task's data source can use it): :class:`SampleOrder` visits ``n`` samples in
a fresh random permutation each epoch, and :func:`rank_micro_batches` says which global samples one dp rank
takes in one optimizer step.  The byte-level loader below is the GPT's.

The loader cuts the token stream into non-overlapping windows of ``block_size + 1`` bytes and visits
them in a fresh random permutation each epoch (seeded by ``seed`` and the epoch number).  Optimizer step
``s`` consumes global samples ``[s * B, (s + 1) * B)``; inside that global batch, micro-step ``k`` of dp
rank ``r`` takes samples ``k * dp * m + r * m ... + m``.  The set of samples in a step therefore does not
depend on the layout, so every (dp, accumulation) split sees the same global batch as one process, and the
loader's whole state is the number of samples consumed.
"""
from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DEFAULT_CORPUS_BYTES = 4 << 20


def stdlib_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> bytes:
    """Real text present wherever Python is: the standard library's own ``.py`` files, in name order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def load_tokens(path: str | None) -> torch.Tensor:
    """Bytes of the corpus at ``path`` (or of the standard library) as a uint8 tensor; vocab size 256."""
    raw = Path(path).read_bytes() if path else stdlib_corpus()
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())


def split_tokens(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``1 - val_fraction`` of the stream for training, the rest for validation."""
    n_val = int(len(tokens) * val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]


class SampleOrder:
    """Which of ``n`` samples is the ``i``-th one drawn: epoch ``i // n`` visits all of them in a random
    permutation seeded by ``seed`` and the epoch number, so the order is the same in every process."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._epoch, self._perm = -1, None

    def __call__(self, i: int) -> int:
        epoch, j = divmod(i, self.n)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._epoch = torch.randperm(self.n, generator=g), epoch
        return int(self._perm[j])


def rank_micro_batches(consumed: int, global_batch: int, micro_batch: int, dp_rank: int,
                       dp_size: int) -> list[range]:
    """The global sample numbers of dp rank ``dp_rank``'s micro-batches in the optimizer step that starts
    after ``consumed`` samples: micro-step ``k`` takes ``consumed + k * dp * m + rank * m ... + m``, so the
    samples of a step do not depend on the layout (every split sees one process's global batch)."""
    m, dp = micro_batch, dp_size
    first = [consumed + k * dp * m + dp_rank * m for k in range(global_batch // (dp * m))]
    return [range(f, f + m) for f in first]


@dataclass
class ShardedLoader:
    """Micro-batches of (inputs, targets) for one dp rank; ``consumed`` is its entire state."""

    tokens: torch.Tensor
    block_size: int
    global_batch: int
    micro_batch: int
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0
    consumed: int = 0

    def __post_init__(self):
        self.num_windows = (len(self.tokens) - 1) // self.block_size
        if self.num_windows < self.global_batch:
            raise ValueError(f"corpus has {self.num_windows} windows of {self.block_size} tokens, fewer than "
                             f"global_batch={self.global_batch}: use a larger corpus or smaller batch")
        if self.global_batch % (self.dp_size * self.micro_batch):
            raise ValueError("global_batch must be divisible by dp_size * micro_batch")
        self._order = SampleOrder(self.num_windows, self.seed)

    @property
    def grad_accum(self) -> int:
        return self.global_batch // (self.dp_size * self.micro_batch)

    def _batch(self, samples: range) -> tuple[torch.Tensor, torch.Tensor]:
        starts = [self._order(s) * self.block_size for s in samples]
        rows = torch.stack([self.tokens[s: s + self.block_size + 1] for s in starts]).long()
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches for the next optimizer step, and advance by one global batch."""
        out = [self._batch(r) for r in rank_micro_batches(self.consumed, self.global_batch, self.micro_batch,
                                                           self.dp_rank, self.dp_size)]
        self.consumed += self.global_batch
        return out

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed, "global_batch": self.global_batch,
                "block_size": self.block_size}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "block_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"checkpoint's data loader has {key}={state[key]} but this run has "
                                 f"{getattr(self, key)}: resume with the same run.seed and model.block_size")
        self.consumed = int(state["consumed"])


def eval_batches(tokens: torch.Tensor, block_size: int, batch: int, n_batches: int, dp_rank: int,
                 dp_size: int, micro_batch: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed validation set of ``n_batches`` batches of ``batch`` evenly spaced windows, with this rank's share
    of each (``batch / dp_size`` windows), cut into pieces of ``micro_batch`` windows when given (the pieces a
    rank's forward runs at a time, as its training micro-batches).  The set depends only on ``batch`` and
    ``n_batches``, so a run evaluates the same windows at every layout when ``batch`` is its global batch."""
    n_windows = (len(tokens) - 1) // block_size
    total = batch * n_batches
    idx = torch.linspace(0, n_windows - 1, total).long()
    out = []
    per = batch // dp_size
    piece = micro_batch or per
    for b in range(n_batches):
        first = b * batch + dp_rank * per
        for start in range(first, first + per, piece):
            sel = idx[start:min(start + piece, first + per)]
            rows = torch.stack([tokens[int(i) * block_size: int(i) * block_size + block_size + 1] for i in sel]).long()
            out.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
    return out
