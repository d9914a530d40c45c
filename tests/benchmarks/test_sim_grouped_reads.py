"""The simulator prices a decode sub-batch's prefix attention by the KV tokens each holder
reads with shared-page groups; that count is what the data plane's grouping reads."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tokenlake.benchmarks.sim.step_timer import ClusterSpec, make_timer
from tokenlake.benchmarks.sim.systems.tokenlake_timing import TokenLakeTiming
from tokenlake.engines.core.page_groups import group_shared_pages, read_tokens

PAGE_LEN = 8


def random_holder_csr(rng: np.random.Generator, num_entries: int):
    """One holder's entries: pages drawn from a small slot range (so some are shared), the
    last page of each entry partial or full."""
    pages = [
        rng.choice(12, size=int(rng.integers(0, 4)), replace=False) for _ in range(num_entries)
    ]
    kv_indptr = np.concatenate([[0], np.cumsum([len(p) for p in pages])]).astype(np.int32)
    kv_indices = np.concatenate([p for p in pages] + [np.zeros(0)]).astype(np.int32)
    last_len = rng.integers(PAGE_LEN - 1, PAGE_LEN + 1, num_entries).astype(np.int32)
    return kv_indptr, kv_indices, last_len


@pytest.mark.parametrize("seed", range(20))
def test_sim_reads_equal_the_data_plane_groups(seed):
    rng = np.random.default_rng(seed)
    spec = ClusterSpec(num_instances=4)
    timing = TokenLakeTiming(make_timer(spec), spec, PAGE_LEN)
    holders, indptrs, indices, lasts, want = [], [], [], [], np.zeros(4)
    base = 0
    for h in (0, 2, 3):
        n = int(rng.integers(1, 6))
        kv_indptr, kv_indices, last_len = random_holder_csr(rng, n)
        groups = group_shared_pages(np.arange(n + 1), kv_indptr, kv_indices, last_len, PAGE_LEN)
        src = (kv_indptr, last_len) if groups is None else (groups.kv_indptr, groups.last_len)
        want[h] = read_tokens(*src, PAGE_LEN)
        holders += [h] * n
        indptrs.append(kv_indptr[1:] + base)
        base += int(kv_indptr[-1])
        indices.append(kv_indices)
        lasts.append(last_len)
    qp = SimpleNamespace(
        kv_indptr=np.concatenate([[0], *indptrs]),
        kv_indices=np.concatenate(indices),
        last_len=np.concatenate(lasts),
    )
    steps = np.ones(len(holders))
    got = timing.grouped_reads(qp, steps, np.array(holders))
    np.testing.assert_array_equal(got, want)
