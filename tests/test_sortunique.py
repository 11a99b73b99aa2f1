"""podscale.sortunique against ``np.unique``: the same values, first indices, inverse and counts, with the same
dtypes and shapes, on empty, one-element, all-equal, small- and large-range int32 / int64 arrays."""
import itertools

import numpy as np
import pytest

from podscale.sortunique import argsort_unique, unique

rng = np.random.default_rng(0)
CASES = {
    "empty": np.array([], dtype=np.int64),
    "empty32": np.array([], dtype=np.int32),
    "single": np.array([7], dtype=np.int64),
    "all-equal": np.full(1000, -3, dtype=np.int32),
    "few-values": rng.integers(0, 5, 5000, dtype=np.int64),
    "few-values32": rng.integers(-4, 4, 5000, dtype=np.int32),
    "wide-range": rng.integers(-2**62, 2**62, 5000, dtype=np.int64),
    "wide-range32": rng.integers(-2**31, 2**31 - 1, 5000, dtype=np.int32),
    "sorted": np.repeat(np.arange(100, dtype=np.int64), 3),
    "reversed": np.arange(1000, dtype=np.int64)[::-1].copy(),
    "2-d": rng.integers(0, 50, (40, 30), dtype=np.int64),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("opts", list(itertools.product([False, True], repeat=3)))
def test_unique_matches_numpy(name, opts):
    a = CASES[name]
    ref, ours = np.unique(a, *opts), unique(a, *opts)
    if not any(opts):
        ref, ours = (ref,), (ours,)
    assert len(ours) == len(ref)
    for r, o in zip(ref, ours):
        assert o.dtype == r.dtype and o.shape == r.shape
        np.testing.assert_array_equal(o, r)


@pytest.mark.parametrize("name", list(CASES))
def test_argsort_unique_parts_agree(name):
    a = CASES[name].reshape(-1)
    values, inverse, perm, starts = argsort_unique(a)
    np.testing.assert_array_equal(values, np.unique(a))
    np.testing.assert_array_equal(values[inverse], a)
    np.testing.assert_array_equal(a[perm], np.sort(a))
    np.testing.assert_array_equal(a[perm][starts], values)
