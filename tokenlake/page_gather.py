"""Gathering the prefix pages a plan reads: every page of every piece as flat arrays, a
replica for each (power of two choices), and one sort by (sub-batch, holder, request) from
which every plan's CSR arrays are slices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from tokenlake import _C
from tokenlake.chunk_set import ChunkSet, Pieces
from tokenlake.plans import read_only
from tokenlake.segment_table import SegmentTable


@dataclass(frozen=True)
class PageIndex:
    """All accesses sorted by (sub-batch, holder, request); ``e_*`` per (sub-batch, holder,
    request) entry, ``h_*`` per (sub-batch, holder)."""

    slot: np.ndarray  # int32 [num_accesses] slot of each page, sorted
    a_sub: np.ndarray  # sub-batch of each access, sorted
    e_start: np.ndarray  # first access of each entry
    e_sub: np.ndarray
    e_inst: np.ndarray
    e_piece: np.ndarray
    e_last: np.ndarray  # int32 tokens in each entry's last page
    h_start: np.ndarray  # first entry of each holder
    h_sub: np.ndarray


class Gathered(NamedTuple):
    """Every page access of one iteration. ``inst``/``slot``/``tokens``/``piece_of``/
    ``partial`` cover all pages (tree pages first, then open tails); ``node_idx``/
    ``node_rows``/``node_tokens`` the pages that are table rows (read, counted as accesses at
    commit); ``chosen_idx``/``chosen_inst`` the replicas picked among several (touched at
    commit)."""

    inst: np.ndarray
    slot: np.ndarray
    tokens: np.ndarray
    piece_of: np.ndarray
    partial: np.ndarray
    node_idx: np.ndarray
    node_rows: np.ndarray
    node_tokens: np.ndarray
    chosen_idx: np.ndarray
    chosen_inst: np.ndarray


class PageGatherer:
    """Turns pieces into page accesses over one :class:`SegmentTable`. Reads only: the
    accesses are recorded, and the chosen replicas touched, when the iteration commits."""

    def __init__(self, table: SegmentTable, segment_len: int, num_instances: int) -> None:
        self.table = table
        self.segment_len = segment_len
        self.num_instances = num_instances

    def gather(self, cs: ChunkSet, pieces: Pieces, base_load: np.ndarray, seed: int) -> Gathered:
        """Every prefix page of every piece, a replica chosen for each (power of two choices
        on ``base_load`` plus this iteration's own load, seeded by ``seed``)."""
        seg, table = self.segment_len, self.table
        chunk = pieces.chunk
        states = cs.states
        page_lists = [states[i].page_idx for i in chunk.tolist()]
        sources = []  # a new request's partial last page: a shared source node
        for p in np.flatnonzero(~cs.in_place[chunk]).tolist():
            pc = cs.planned[int(chunk[p])]
            if pc.source is not None:
                sources.append((pc.source.idx, p, pc.source_len))
        lens = np.fromiter(map(len, page_lists), dtype=np.int64, count=len(page_lists))
        src = np.asarray(sources, dtype=np.int64).reshape(-1, 3)
        idx = np.concatenate([*page_lists, src[:, 0]]).astype(np.int64, copy=False)
        node_piece = np.concatenate([np.repeat(np.arange(len(chunk)), lens), src[:, 1]])
        node_tokens = np.concatenate([np.full(int(lens.sum()), float(seg)), src[:, 2]])
        inst = table.rep_inst[idx, 0].astype(np.int64)
        slot = table.rep_slot[idx, 0].astype(np.int64)
        piece_rows = pieces.rows.astype(np.float64)
        rows = piece_rows[node_piece]
        chosen_idx, chosen_inst = self._choose_replicas(
            idx, inst, slot, node_tokens * rows, base_load, seed
        )
        tail = np.flatnonzero(cs.open_len[chunk] > 0)  # the open tail a running request reads
        tail_chunk = chunk[tail]
        tokens = np.concatenate([node_tokens, cs.open_len[tail_chunk]])
        return Gathered(
            inst=np.concatenate([inst, cs.open_inst[tail_chunk]]),
            slot=np.concatenate([slot, cs.open_slot[tail_chunk]]),
            tokens=tokens,
            piece_of=np.concatenate([node_piece, tail]),
            partial=(tokens < seg).astype(np.int64),
            node_idx=idx,
            node_rows=rows,
            node_tokens=node_tokens,
            chosen_idx=chosen_idx,
            chosen_inst=chosen_inst,
        )

    def _choose_replicas(self, idx, inst, slot, weights, base_load, seed):
        """Power of two choices for pages with several replicas, on ``base_load`` plus the
        load this iteration has already placed (in place on ``inst`` / ``slot``). Returns
        the distinct (row, instance) pairs chosen among several, sorted."""
        nrep = self.table.num_replicas[idx]
        multi = nrep > 1
        if not multi.any():
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty
        load = base_load + np.bincount(
            inst[~multi], weights=weights[~multi], minlength=self.num_instances
        )
        m_idx = idx[multi]
        chosen = np.empty(len(m_idx), dtype=np.int32)
        _C.choose_replicas(
            np.ascontiguousarray(self.table.rep_inst[m_idx]),
            np.ascontiguousarray(nrep[multi]),
            np.ascontiguousarray(weights[multi]),
            np.ascontiguousarray(load, dtype=np.float64),
            seed,
            chosen,
        )
        inst[multi] = self.table.rep_inst[m_idx, chosen]
        slot[multi] = self.table.rep_slot[m_idx, chosen]
        pairs = np.unique(m_idx * self.num_instances + inst[multi])
        return pairs // self.num_instances, pairs % self.num_instances

    def index(self, acc: Gathered, piece_sub) -> PageIndex:
        """Sort every access by (sub-batch, holder, request, partial-last) once; each plan's
        CSR arrays are then slices of the same global arrays."""
        inst, slot, tokens, piece_of, partial = acc[:5]
        sub_of = piece_sub[piece_of]
        # one int64 key instead of lexsort (several times slower); ties need no order since
        # attention over one holder's pages is order-free, except the partial page goes last
        key = ((sub_of * self.num_instances + inst) * (len(piece_sub) + 1) + piece_of) * 2 + partial
        order = np.argsort(key)
        inst, slot, tokens, piece_of, sub_of = (
            a[order] for a in (inst, slot, tokens, piece_of, sub_of)
        )
        n = len(order)
        new_entry = np.ones(n, dtype=bool)
        new_entry[1:] = (
            (sub_of[1:] != sub_of[:-1]) | (inst[1:] != inst[:-1]) | (piece_of[1:] != piece_of[:-1])
        )
        e_start = np.flatnonzero(new_entry)
        e_end = np.append(e_start[1:], n).astype(np.int64)[: len(e_start)]
        e_sub, e_inst, e_piece = sub_of[e_start], inst[e_start], piece_of[e_start]
        new_holder = np.ones(len(e_start), dtype=bool)
        new_holder[1:] = (e_sub[1:] != e_sub[:-1]) | (e_inst[1:] != e_inst[:-1])
        h_start = np.flatnonzero(new_holder)
        return PageIndex(
            slot=read_only(slot.astype(np.int32)),
            e_start=e_start,
            e_sub=e_sub,
            e_inst=e_inst,
            e_piece=e_piece,
            e_last=read_only(tokens[e_end - 1].astype(np.int32)),
            h_start=h_start,
            h_sub=e_sub[h_start],
            a_sub=sub_of,
        )
