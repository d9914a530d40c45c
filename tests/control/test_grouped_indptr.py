"""``grouped_indptr`` against the per-group subtraction it replaces (brute force)."""

from __future__ import annotations

import numpy as np
import pytest

from tokenlake.plan_builder import grouped_indptr


@pytest.mark.parametrize("seed", range(30))
def test_grouped_indptr_matches_per_group_offsets(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 20))
    starts = np.cumsum(rng.integers(0, 4, n))  # non-decreasing, empty elements allowed
    total = int(starts[-1] + rng.integers(0, 4)) if n else int(rng.integers(0, 3))
    num_groups = int(rng.integers(1, 6))
    bounds = np.sort(np.concatenate([[0, n], rng.integers(0, n + 1, num_groups - 1)]))
    out = grouped_indptr(starts, bounds.tolist(), total)
    assert out.dtype == np.int32 and not out.flags.writeable
    ext = np.append(starts, total)
    for g in range(num_groups):
        lo, hi = int(bounds[g]), int(bounds[g + 1])
        expected = ext[lo : hi + 1] - ext[lo]
        np.testing.assert_array_equal(out[lo + g : hi + g + 1], expected)
