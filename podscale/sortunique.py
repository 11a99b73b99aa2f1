"""Distinct values of an integer array by one sort: podscale's ``np.unique``.

numpy 2.4's ``np.unique`` finds the distinct values alone with a hash table and then sorts them, which on
1e6 int64 keys is 15 to 100 times slower than one ``np.sort`` and a neighbour compare; with ``return_index``
it sorts stably (a merge sort), 2 to 3 times slower than numpy's vectorised introsort (with the inverse or
the counts it sorts as this module does).  Every deduplication in podscale (the graph's edge keys and halos,
the sampler's relabelling, the sharded tables' ids, the row store's claimants) goes through here: one sort
(``np.sort``, or ``np.argsort`` when positions are wanted), the mask of each run's first element
(:func:`run_starts`), and what is asked for derived from the two.

:func:`unique` returns what ``np.unique(a, return_index=..., return_inverse=..., return_counts=...)`` returns,
the same values and dtypes, for integer (or boolean) arrays and for floats without NaN (``np.unique`` folds
NaNs into one, this does not); :func:`argsort_unique` also hands out the sorting permutation and the runs'
first places, which the tables' :class:`~podscale.table.embedding.Dedup` keeps for the backward.
"""
from __future__ import annotations

import numpy as np


def run_starts(srt: np.ndarray) -> np.ndarray:
    """Mask of each run's first element in the sorted 1-D array ``srt`` (its distinct values' first places)."""
    first = np.empty(len(srt), dtype=bool)
    first[:1] = True
    np.not_equal(srt[1:], srt[:-1], out=first[1:])
    return first


def argsort_unique(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(values, inverse, perm, starts)`` of the 1-D array ``a``: its distinct values sorted, each element's
    position in them (``values[inverse] == a``), a sorting permutation (``a[perm]`` is sorted; not stable:
    equal values keep no particular order) and each distinct value's first place in ``a[perm]``."""
    perm = np.argsort(a)  # numpy's (vectorised) introsort: a few times faster than a stable sort
    srt = a[perm]
    first = run_starts(srt)
    inverse = np.empty(len(srt), dtype=np.intp)
    inverse[perm] = np.cumsum(first) - 1
    return srt[first], inverse, perm, np.flatnonzero(first)


def unique(a, return_index: bool = False, return_inverse: bool = False, return_counts: bool = False):
    """``np.unique(a, return_index=..., return_inverse=..., return_counts=...)`` by one sort: the distinct
    values of ``a`` (flattened) sorted, then, as asked and in this order, each one's first index in ``a``,
    the inverse (``a``'s shape, as numpy 2 returns it) and the counts.  Values and counts: ``np.sort`` and a
    neighbour compare; with indices or the inverse one ``np.argsort``, a value's first index being the
    smallest position of its run (what ``np.unique``'s stable sort puts first)."""
    a = np.asarray(a)
    flat = a.reshape(-1)
    if not (return_index or return_inverse):
        srt = np.sort(flat)
        first = run_starts(srt)
        if not return_counts:
            return srt[first]
        return srt[first], np.diff(np.flatnonzero(first), append=len(flat))
    values, inverse, perm, starts = argsort_unique(flat)
    out = [values]
    if return_index:
        out.append(np.minimum.reduceat(perm, starts) if len(perm) else np.empty(0, dtype=np.intp))
    if return_inverse:
        out.append(inverse.reshape(a.shape))
    if return_counts:
        out.append(np.diff(starts, append=len(flat)))
    return tuple(out)
