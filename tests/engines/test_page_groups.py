"""Shared-page groups (engines/core/page_groups.py, BoundPart): every row still attends to
exactly its own pages, each shared page is read once, and the merged result equals the
monolithic reference (the torch backend over the part as it was)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from tokenlake.engines import kernels
from tokenlake.engines.core.executor import BoundPart, merge_states
from tokenlake.engines.core.page_groups import group_shared_pages, read_tokens
from tokenlake.plans import HolderPart

PAGE_LEN = 8


def random_part(rng: np.random.Generator, num_entries: int, num_slots: int = 40):
    """A holder part whose requests share a common run of pages (a system prompt), some
    pairwise-shared pages, private pages, and partial last pages; some requests have several
    rows (prefill chunks), and the last one has no pages."""
    common = rng.choice(num_slots, size=int(rng.integers(1, 4)), replace=False).tolist()
    free = [s for s in range(num_slots) if s not in common]
    rng.shuffle(free)
    pair = free.pop()
    q_lens, pages, last = [], [], []
    for e in range(num_entries):
        mine = list(common) if e < 2 or rng.random() < 0.8 else []
        if e % 3 == 0:
            mine.append(pair)
        mine += [free.pop() for _ in range(int(rng.integers(0, 3)))]
        if e == num_entries - 1:
            mine = []
        q_lens.append(int(rng.integers(1, 4)) if e % 4 else 1)
        pages.append(mine)
        # a request's last page is partial only when it is its own
        own_last = bool(mine) and mine[-1] not in common and mine[-1] != pair
        last.append(int(rng.integers(1, PAGE_LEN + 1)) if own_last else PAGE_LEN)
    q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum([len(p) for p in pages])]).astype(np.int32)
    kv_indices = np.array([s for p in pages for s in p], dtype=np.int32)
    return q_indptr, kv_indptr, kv_indices, np.array(last, dtype=np.int32)


def reads_of_rows(q_indptr, kv_indptr, kv_indices, last_len):
    """Brute force: row -> multiset of (slot, valid tokens) it attends to."""
    out = {}
    for e in range(len(kv_indptr) - 1):
        slots = kv_indices[kv_indptr[e] : kv_indptr[e + 1]].tolist()
        valid = [PAGE_LEN] * len(slots)
        if slots:
            valid[-1] = int(last_len[e])
        for r in range(q_indptr[e], q_indptr[e + 1]):
            out[r] = Counter(zip(slots, valid, strict=True))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_groups_cover_each_row_exactly_and_read_shared_pages_once(seed):
    rng = np.random.default_rng(seed)
    csr = random_part(rng, int(rng.integers(3, 9)))
    groups = group_shared_pages(*csr, PAGE_LEN)
    assert groups is not None  # the common pages are shared by construction
    got: dict[int, Counter] = {r: Counter() for r in range(int(csr[0][-1]))}
    for g in range(len(groups.last_len)):
        slots = groups.kv_indices[groups.kv_indptr[g] : groups.kv_indptr[g + 1]].tolist()
        assert slots, "a group without pages"
        valid = [PAGE_LEN] * (len(slots) - 1) + [int(groups.last_len[g])]
        for s in groups.state_rows[groups.q_indptr[g] : groups.q_indptr[g + 1]].tolist():
            got[s] += Counter(zip(slots, valid, strict=True))
    want = reads_of_rows(*csr)
    assert {r: c for r, c in got.items() if c} == {r: c for r, c in want.items() if c}
    # each distinct (slot, valid) is read by exactly one group
    distinct = {k for c in want.values() for k in c}
    assert read_tokens(groups.kv_indptr, groups.last_len, PAGE_LEN) == sum(v for _, v in distinct)
    assert read_tokens(groups.kv_indptr, groups.last_len, PAGE_LEN) < read_tokens(
        csr[1], csr[3], PAGE_LEN
    )


def test_no_shared_page_no_groups():
    csr = (np.array([0, 1, 3]), np.array([0, 2, 3]), np.array([4, 5, 6]), np.array([8, 3]))
    assert group_shared_pages(*csr, PAGE_LEN) is None
    # the same slot read with different valid lengths is not one page's KV
    csr = (np.array([0, 1, 2]), np.array([0, 1, 2]), np.array([4, 4]), np.array([3, 5]))
    assert group_shared_pages(*csr, PAGE_LEN) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("logit_cap", [0.0, 5.0])
@pytest.mark.parametrize("seed", range(4))
def test_grouped_part_equals_the_reference(seed, dtype, logit_cap):
    rng = np.random.default_rng(100 + seed)
    gen = torch.Generator().manual_seed(seed)
    csr = random_part(rng, 7)
    num_rows, h_q, h_kv, dim = int(csr[0][-1]), 4, 2, 16
    pool = torch.randn((40, 2, PAGE_LEN, h_kv, dim), generator=gen).to(dtype)
    q_buf = torch.randn((num_rows + 5, h_q, dim), generator=gen).to(dtype)
    rows = rng.permutation(num_rows + 5)[:num_rows].astype(np.int32)  # scattered in q_buf
    part = HolderPart(1, rows, *csr)
    grouped = BoundPart.from_part(part, "cpu", logit_cap=logit_cap, page_len=PAGE_LEN)
    plain = BoundPart.from_part(part, "cpu", logit_cap=logit_cap)
    assert grouped.state_rows is not None and plain.state_rows is None
    ref_o, ref_lse = kernels.partial_attention(
        q_buf[torch.from_numpy(rows).long()],
        *(torch.from_numpy(np.asarray(a, dtype=np.int32)) for a in csr[:1]),
        pool,
        *(torch.from_numpy(np.asarray(a, dtype=np.int32)) for a in csr[1:]),
        backend="torch",
        logit_cap=logit_cap,
    )
    for bound in (grouped, plain):
        for backend in ("cpu", "torch"):
            o, lse = bound.attend(q_buf, pool, backend)
            torch.testing.assert_close(o, ref_o, atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
    # the request without pages sees no keys
    last_rows = slice(int(csr[0][-2]), int(csr[0][-1]))
    assert torch.isneginf(grouped.attend(q_buf, pool, None)[1][last_rows]).all()


def test_merge_states_equals_pairwise_merges():
    gen = torch.Generator().manual_seed(3)
    num_rows, h, d = 5, 3, 8
    state_rows = torch.tensor([0, 2, 0, 1, 2, 2, 0], dtype=torch.int64)
    o = torch.randn((7, h, d), generator=gen)
    lse = torch.randn((7, h), generator=gen) * 4
    lse[3, 1] = -torch.inf  # an empty state
    got_o, got_lse = merge_states(o, lse, state_rows, num_rows)
    want_o = torch.zeros((num_rows, h, d))
    want_lse = torch.full((num_rows, h), -torch.inf)
    for s, r in enumerate(state_rows.tolist()):
        mo, ml = kernels.merge(want_o[r : r + 1], want_lse[r : r + 1], o[s : s + 1], lse[s : s + 1])
        want_o[r], want_lse[r] = mo[0], ml[0]
    torch.testing.assert_close(got_o, want_o, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-6, rtol=1e-5)
    assert torch.isneginf(got_lse[3:]).all() and not got_o[3:].any()


def test_too_many_states_per_row_runs_the_part_as_it_is():
    """Nested sharing: request e reads pages 0..e, so page p has the reader set {p..n-1} and
    the last request's row takes part in n groups."""
    n = 6
    pages = [list(range(e + 1)) for e in range(n)]
    csr = (
        np.arange(n + 1),
        np.concatenate([[0], np.cumsum([len(p) for p in pages])]),
        np.array([s for p in pages for s in p]),
        np.full(n, PAGE_LEN),
    )
    groups = group_shared_pages(*csr, PAGE_LEN, max_states_per_row=n)
    assert groups is not None
    assert len(groups.state_rows) == n * (n + 1) // 2  # row e is in e + 1 groups
    assert group_shared_pages(*csr, PAGE_LEN, max_states_per_row=2) is None
