"""Gathering the prefix pages a plan reads, in one C++ pass (``csrc/page_plan.h``): every page
of every piece, a replica for each (power of two choices), one stable sort by (sub-batch,
holder), and every query plan's CSR arrays as slices of a few global arrays."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from tokenlake import _C
from tokenlake.planning.chunk_set import ChunkSet, Pieces
from tokenlake.plans import read_only
from tokenlake.tree.segment_table import SegmentTable

_PAGE_IDX = attrgetter("page_idx")


class Reads(NamedTuple):
    """What one iteration reads from the segment table: ``rows`` (distinct table rows, first
    read first; its readers while in flight), the query rows reading each and the sum of
    rows × tokens over all its reads (its accesses at commit), and ``chosen_idx`` /
    ``chosen_inst`` the replicas picked among several, ascending (touched at commit)."""

    rows: np.ndarray  # int64
    query_rows: np.ndarray  # float64
    access_tokens: float
    chosen_idx: np.ndarray  # int64
    chosen_inst: np.ndarray  # int64


@dataclass(frozen=True)
class PagePlan:
    """Every page access of one iteration, sorted by (sub-batch, holder, piece), full pages
    before an entry's partial last page. Sub-batch ``u`` owns accesses
    ``a_bounds[u]:a_bounds[u+1]``, entries (one per holder and piece) ``e_bounds[u]:...``,
    holders ``h_bounds[u]:...``, pieces ``p_bounds[u]:...``. ``kv_indptr`` (over entries),
    ``holder_indptr`` (over holders) and ``q_indptr`` (over pieces) hold every sub-batch's
    CSR offsets in one array: sub-batch ``u``'s elements ``lo:hi`` have offsets
    ``indptr[lo + u : hi + u + 1]``, relative to its first element, its end appended. Read-only
    int32 arrays."""

    kv_indices: np.ndarray  # [A] slot of each access
    kv_indptr: np.ndarray  # [E + U]
    entry_req: np.ndarray  # [E] piece of each entry, relative to its sub-batch's first
    last_len: np.ndarray  # [E] tokens in each entry's last page
    holder_ids: np.ndarray  # [H]
    holder_indptr: np.ndarray  # [H + U]
    q_indptr: np.ndarray  # [P + U]
    a_bounds: list[int]
    e_bounds: list[int]
    h_bounds: list[int]
    p_bounds: list[int]
    load: np.ndarray  # [N] float64 tokens × rows read on each instance
    query_rows: np.ndarray  # [U, N] float64 query rows each sub-batch sends to each instance
    reads: Reads


class PageGatherer:
    """Turns pieces into page accesses over one :class:`SegmentTable`. Reads only: the
    accesses are recorded, and the chosen replicas touched, when the iteration commits."""

    def __init__(self, table: SegmentTable, segment_len: int, num_instances: int) -> None:
        self.table = table
        self.segment_len = segment_len
        self.num_instances = num_instances

    def gather(
        self,
        cs: ChunkSet,
        pieces: Pieces,
        num_subs: int,
        base_load: np.ndarray,
        seed: int,
        loaded: Sequence[tuple[int, int, int]] = (),
    ) -> PagePlan:
        """Every prefix page of every piece (its request's sealed pages, a new request's
        shared partial source page, a running request's open tail), a replica chosen for each
        (power of two choices on ``base_load`` plus this iteration's own load, seeded by
        ``seed``), sorted into per-sub-batch CSR arrays. ``loaded``: ``(row, instance,
        slot)`` of segments in the host tier this iteration loads, read there."""
        table, n_inst = self.table, self.num_instances
        rep_inst, rep_slot, num_rep = table.rep_inst, table.rep_slot, table.num_replicas
        if loaded:  # the iteration's own view: its loads are the only copy of those rows
            rep_inst, rep_slot, num_rep = rep_inst.copy(), rep_slot.copy(), num_rep.copy()
            for row, inst, slot in loaded:
                rep_inst[row, 0], rep_slot[row, 0], num_rep[row] = inst, slot, 1
        chunk = pieces.chunk
        num_pieces = len(chunk)
        states = cs.states
        page_lists = list(map(_PAGE_IDX, map(states.__getitem__, chunk.tolist())))
        # a request's sealed pages: start // C (running: all it stored but its open tail; new:
        # the full segments it starts from), so no pass over the lists to count them
        page_ptr = np.zeros(num_pieces + 1, dtype=np.int64)
        np.cumsum(cs.start[chunk] // self.segment_len, out=page_ptr[1:])
        page_idx = np.concatenate(page_lists) if page_lists else np.zeros(0, np.int64)
        if len(page_idx) != page_ptr[-1]:
            raise AssertionError("a request's page list does not match its length")
        source_idx = np.full(num_pieces, -1, dtype=np.int64)
        source_len = np.zeros(num_pieces, dtype=np.int64)
        for p in np.flatnonzero(~cs.in_place[chunk]).tolist():
            pc = cs.planned[int(chunk[p])]
            if pc.source is not None:  # a new request's partial last page: a shared node
                source_idx[p], source_len[p] = pc.source.idx, pc.source_len
        tail_len = cs.open_len[chunk]
        num_acc = len(page_idx) + int((source_idx >= 0).sum()) + int(np.count_nonzero(tail_len))
        i32 = np.empty((4, num_acc), dtype=np.int32)  # one allocation for four outputs
        kv_indptr = np.empty(num_acc + num_subs, dtype=np.int32)
        holder_indptr = np.empty(num_acc + num_subs, dtype=np.int32)
        q_indptr = np.empty(num_pieces + num_subs, dtype=np.int32)
        bounds = np.empty(4 * (num_subs + 1), dtype=np.int64)
        load = np.empty(n_inst)
        query_rows = np.empty((num_subs, n_inst))
        read_rows = np.empty(num_acc, dtype=np.int64)
        read_count = np.empty(num_acc, dtype=np.int32)
        read_qrows = np.empty(num_acc)
        chosen = np.empty(num_acc, dtype=np.int64)
        num_e, num_h, num_r, num_c, access_tokens = _C.plan_pages(
            rep_inst,
            rep_slot,
            num_rep,
            self.segment_len,
            num_subs,
            n_inst,
            pieces.sub,
            pieces.rows,
            page_ptr,
            page_idx,
            source_idx,
            source_len,
            cs.open_inst[chunk],
            cs.open_slot[chunk],
            tail_len,
            np.ascontiguousarray(base_load, dtype=np.float64),
            seed,
            kv_indices=i32[0],
            kv_indptr=kv_indptr,
            entry_req=i32[1],
            last_len=i32[2],
            holder_ids=i32[3],
            holder_indptr=holder_indptr,
            q_indptr=q_indptr,
            bounds=bounds,
            load=load,
            query_rows=query_rows.reshape(-1),
            read_rows=read_rows,
            read_count=read_count,
            read_qrows=read_qrows,
            chosen=chosen,
        )
        for arr in (i32, kv_indptr, holder_indptr, q_indptr):
            read_only(arr)  # plans hold slices of these: make them read-only first
        kv_indices, entry_req, last_len, holder_ids = i32
        b = bounds.reshape(4, num_subs + 1).tolist()
        chosen = chosen[:num_c]
        return PagePlan(
            kv_indices=kv_indices,
            kv_indptr=kv_indptr[: num_e + num_subs],
            entry_req=entry_req[:num_e],
            last_len=last_len[:num_e],
            holder_ids=holder_ids[:num_h],
            holder_indptr=holder_indptr[: num_h + num_subs],
            q_indptr=q_indptr,
            a_bounds=b[0],
            e_bounds=b[1],
            h_bounds=b[2],
            p_bounds=b[3],
            load=load,
            query_rows=query_rows,
            reads=Reads(
                rows=read_rows[:num_r],
                query_rows=read_qrows[:num_r],
                access_tokens=access_tokens,
                chosen_idx=chosen // n_inst,
                chosen_inst=chosen % n_inst,
            ),
        )
