"""A Criteo-like click-log generator: 13 dense and 26 sparse features, Zipf ids, labels from a hidden teacher.

It follows the recipe of DLRM's synthetic data (Naumov et al. 2019, the ``--data-generation=random``/
``synthetic`` generators of the reference implementation) with what makes the numbers mean something:

* sparse features: per table a cardinality (up to 10^9 and beyond: nothing is allocated per id) and a
  Zipf(``alpha``) popularity over ranks ``1..cardinality``, drawn by inverting the continuous bounded
  power law (works for ``alpha`` <= 1 too, unlike ``numpy.random.zipf``); ranks become arbitrary int64
  ids through SplitMix64 (a bijection on 64 bits, then halved to be non-negative), so ids are neither
  contiguous nor ordered by popularity, as hashed Criteo categories are;
* bags of ``min_ids..max_ids`` ids per sample and feature (Criteo itself is one id per feature);
* dense features: ``log(1 + x)`` of log-normal counts, as DLRM preprocesses Criteo's integer features;
* labels: Bernoulli(sigmoid(teacher)), where the teacher adds a hidden weight per (table, id) -- a hash,
  so no table is stored -- and a hidden linear function of the dense features, scaled to a positive rate
  near Criteo's (about 25 %).  A model that learns the ids' weights reaches an AUC well above 0.5.

Every batch is a pure function of (seed, step): any rank can make any sample, and slicing a global batch
gives each rank its part (:func:`slice_batch`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from podscale.table.hashing import mix64, name_seed

# Criteo Kaggle's per-feature cardinalities (the DLRM paper's day-0 counts), used as the default shape.
CRITEO_CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
                        27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)


@dataclass(frozen=True)
class CriteoLike:
    """Shape of the generated click log; ``cardinalities`` has one entry per sparse feature."""

    num_dense: int = 13
    cardinalities: tuple[int, ...] = CRITEO_CARDINALITIES
    alpha: float = 1.05
    min_ids: int = 1
    max_ids: int = 1
    seed: int = 0
    teacher_scale: float = 1.0
    names: tuple[str, ...] = field(default=())
    ranks_as_ids: bool = False        # ids are the popularity ranks in [0, cardinality) (a declared range)

    def __post_init__(self):
        if not self.cardinalities or min(self.cardinalities) < 1:
            raise ValueError("every sparse feature needs a cardinality >= 1: fix cardinalities")
        if not 1 <= self.min_ids <= self.max_ids:
            raise ValueError(f"ids per bag {self.min_ids}..{self.max_ids}: need 1 <= min_ids <= max_ids")
        if self.alpha <= 0:
            raise ValueError(f"alpha={self.alpha} must be positive (Zipf exponent)")
        if not self.names:
            object.__setattr__(self, "names", tuple(f"C{i + 1}" for i in range(len(self.cardinalities))))

    @property
    def num_sparse(self) -> int:
        return len(self.cardinalities)


def zipf_ranks(rng: np.random.Generator, n: int, card: int, alpha: float) -> np.ndarray:
    """``n`` ranks in ``[0, card)`` with P(rank r) roughly proportional to (r + 1)^-alpha."""
    u = rng.random(n)
    if abs(alpha - 1.0) < 1e-9:
        r = np.exp(u * np.log(card + 1.0))
    else:
        e = 1.0 - alpha
        r = ((((card + 1.0) ** e) - 1.0) * u + 1.0) ** (1.0 / e)
    return np.minimum(np.floor(r).astype(np.int64) - 1, card - 1).clip(0)


def rank_to_id(table_seed: int, ranks: np.ndarray) -> np.ndarray:
    """The id of each popularity rank: a bijective 64-bit hash, halved to a non-negative int64."""
    return (mix64(ranks.astype(np.uint64) ^ np.uint64(table_seed)) >> np.uint64(1)).astype(np.int64)


def _teacher_weight(table_seed: int, ids: np.ndarray) -> np.ndarray:
    z = mix64(ids.view(np.uint64) ^ np.uint64(table_seed ^ 0x7EAC4E5))
    return (z >> np.uint64(40)).astype(np.float64) / float(1 << 24) * 2.0 - 1.0


def make_batch(cfg: CriteoLike, step: int, batch: int):
    """Global batch ``step``: dense ``[batch, num_dense]``, ``{name: (values, offsets)}``, labels ``[batch]``."""
    rng = np.random.default_rng([cfg.seed, step])
    dense = np.log1p(rng.lognormal(1.0, 1.5, size=(batch, cfg.num_dense)))
    w_dense = np.random.default_rng([cfg.seed, 0x5EED]).normal(0, 0.3, cfg.num_dense)
    logit = (dense - 1.5) @ w_dense
    sparse = {}
    for name, card in zip(cfg.names, cfg.cardinalities):
        tseed = name_seed(cfg.seed, name)
        lens = rng.integers(cfg.min_ids, cfg.max_ids + 1, size=batch)
        ranks = zipf_ranks(rng, int(lens.sum()), card, cfg.alpha)
        ids = ranks.astype(np.int64) if cfg.ranks_as_ids else rank_to_id(tseed, ranks)
        bag = np.repeat(np.arange(batch), lens)
        logit += np.bincount(bag, weights=_teacher_weight(tseed, ids), minlength=batch) / lens
        offsets = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        sparse[name] = (torch.from_numpy(ids), torch.from_numpy(offsets))
    logit = cfg.teacher_scale * logit / np.sqrt(1.0 + cfg.num_sparse / 3.0) - 1.1  # ~25 % positives
    labels = (rng.random(batch) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return torch.from_numpy(dense.astype(np.float32)), sparse, torch.from_numpy(labels)


def slice_batch(dense: torch.Tensor, sparse, labels: torch.Tensor, lo: int, hi: int):
    """Samples ``[lo, hi)`` of a batch (each rank's part of a global batch)."""
    out = {}
    for name, (v, o) in sparse.items():
        ends = torch.cat([o[1:], torch.tensor([len(v)])])
        a, b = int(o[lo]), int(ends[hi - 1]) if hi > lo else int(o[lo])
        out[name] = (v[a:b], o[lo:hi] - a)
    return dense[lo:hi], out, labels[lo:hi]
