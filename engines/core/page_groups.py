"""Shared-page groups: one holder's part of a query plan rewritten so that a page read by
several requests is read once.

A holder receives every row that attends to the segments it holds (the query goes to the
cache). Prefix attention is not causal, so the rows of different requests that read the same
page can run as one group over it: the page's KV leaves memory once per layer instead of once
per request (cascade, or shared-prefix, attention). Requests behind one system prompt or one
document share most of their pages; in decode, reading those pages dominates.

The part becomes ``num_states`` partial states: one per (row, group) it takes part in. Each
request keeps a private group of the pages nobody else in the part reads; the pages read by
the same set of requests form one shared group. The exact attention of a row is the merge of
its states (:func:`tokenlake.engines.core.executor.merge_states`), so grouping changes which bytes are read,
never the result beyond float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenlake.plans import frozen_i32

MAX_STATES_PER_ROW = 4
"""Default bound on partial states per row: a decode row behind a system prompt and a shared
document takes part in three groups (prompt, document, its own pages)."""


@dataclass(frozen=True)
class PageGroups:
    """A part's problem as groups, ready for :func:`tokenlake.engines.kernels.partial_attention`.

    Group ``g`` owns states ``q_indptr[g]:q_indptr[g+1]``; state ``s`` is the part's row
    ``state_rows[s]`` (an index into the part's rows). The group reads pages
    ``kv_indices[kv_indptr[g]:kv_indptr[g+1]]``, the last one holding ``last_len[g]`` valid
    tokens; only a group's last page may be partial.
    """

    state_rows: np.ndarray  # int32 [num_states]
    q_indptr: np.ndarray  # int32 [num_groups + 1]
    kv_indptr: np.ndarray  # int32 [num_groups + 1]
    kv_indices: np.ndarray  # int32 [nnz]
    last_len: np.ndarray  # int32 [num_groups]


def read_tokens(kv_indptr: np.ndarray, last_len: np.ndarray, page_len: int) -> int:
    """KV tokens a CSR problem reads: every page of every request, the last one partial."""
    pages = np.diff(np.asarray(kv_indptr, dtype=np.int64))
    has = pages > 0
    return int((pages[has] - 1).sum()) * page_len + int(np.asarray(last_len)[has].sum())


def group_shared_pages(
    q_indptr: np.ndarray,
    kv_indptr: np.ndarray,
    kv_indices: np.ndarray,
    last_len: np.ndarray,
    page_len: int,
    max_states_per_row: int = MAX_STATES_PER_ROW,
) -> PageGroups | None:
    """Group the pages of a part (CSR as in :class:`tokenlake.plans.HolderPart`: request
    ``e`` owns rows ``q_indptr[e]:q_indptr[e+1]`` and pages ``kv_indices[kv_indptr[e]:...]``,
    the last one holding ``last_len[e]`` of ``page_len`` tokens). A page is shared when two
    or more requests read it with the same valid length. Returns ``None`` when no page is
    shared, or when the groups would hold more than ``max_states_per_row`` partial states
    per row (the part runs as it is: a row in many reader sets costs memory and merges that
    one read per page does not repay)."""
    kv_indptr = np.asarray(kv_indptr, dtype=np.int64)
    num_entries = len(kv_indptr) - 1
    if num_entries < 2:  # one request (a decode of one): no page has two readers
        return None
    pages = np.diff(kv_indptr)
    entry = np.repeat(np.arange(num_entries), pages)
    slot = np.asarray(kv_indices, dtype=np.int64)
    valid = np.full(len(slot), page_len, dtype=np.int64)
    has = pages > 0
    valid[kv_indptr[1:][has] - 1] = np.asarray(last_len, dtype=np.int64)[has]
    key = slot * (page_len + 1) + valid
    unique, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
    shared = counts[inverse] >= 2
    if not shared.any():
        return None
    groups: list[tuple[np.ndarray, list[int], int]] = []  # (readers, slots, last valid)
    # private groups: each request's pages that no other request of the part reads
    for e in np.flatnonzero(np.bincount(entry[~shared], minlength=num_entries)).tolist():
        mine = (entry == e) & ~shared
        groups.append((np.array([e]), slot[mine].tolist(), int(valid[mine][-1])))
    # shared groups: the pages read by one set of requests (full pages first)
    order = np.lexsort((entry, inverse))
    by_page: dict[int, list[int]] = {}
    for i in order[shared[order]].tolist():
        by_page.setdefault(int(inverse[i]), []).append(int(entry[i]))
    by_readers: dict[tuple[int, ...], list[int]] = {}
    for page, readers in by_page.items():
        by_readers.setdefault(tuple(readers), []).append(page)
    for readers, group_pages in by_readers.items():
        # every reader's partial page is its last one, so a reader set has at most one
        group_pages.sort(key=lambda p: int(unique[p] % (page_len + 1)) < page_len)
        slots = [int(unique[p] // (page_len + 1)) for p in group_pages]
        groups.append((np.array(readers), slots, int(unique[group_pages[-1]] % (page_len + 1))))
    q_indptr = np.asarray(q_indptr, dtype=np.int64)
    rows_of = np.diff(q_indptr)
    num_states = sum(int(rows_of[readers].sum()) for readers, _, _ in groups)
    if num_states > max_states_per_row * int(q_indptr[-1]):
        return None
    state_rows = [
        np.concatenate([np.arange(q_indptr[e], q_indptr[e + 1]) for e in readers.tolist()])
        for readers, _, _ in groups
    ]
    return PageGroups(
        state_rows=frozen_i32(np.concatenate(state_rows)),
        q_indptr=frozen_i32(np.concatenate([[0], np.cumsum([len(s) for s in state_rows])])),
        kv_indptr=frozen_i32(np.concatenate([[0], np.cumsum([len(g[1]) for g in groups])])),
        kv_indices=frozen_i32(np.concatenate([g[1] for g in groups])),
        last_len=frozen_i32([g[2] for g in groups]),
    )
