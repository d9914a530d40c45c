"""Turns planned chunks into immutable plans: gathers every prefix page of every request
as flat arrays, picks replicas (power of two choices), matches sub-batches to instances
(Hungarian, §5) and cuts the arrays into per-sub-batch CSR plans."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenlake import _C
from tokenlake.balancer import AccessStats
from tokenlake.dispatch import hungarian_dispatch, traffic_cost
from tokenlake.plans import Plans, QueryPlan, TransferPlan, frozen_i32
from tokenlake.prefix_tree import Location, Node, PrefixTree
from tokenlake.requests import PlannedChunk

Piece = tuple[int, int, int]  # (chunk index in batch, first row, end row) within the chunk


def split_rows(chunks: Sequence[PlannedChunk], dop: int) -> list[list[Piece]]:
    """Split a batch's rows into ``dop`` contiguous, near-equal sub-batches."""
    if dop == 1:
        return [[(ci, 0, pc.end - pc.start) for ci, pc in enumerate(chunks)]]
    sizes = [pc.end - pc.start for pc in chunks]
    total = sum(sizes)
    bounds = [round(total * j / dop) for j in range(dop + 1)]
    subs: list[list[Piece]] = []
    for j in range(dop):
        lo_row, hi_row, pieces, base = bounds[j], bounds[j + 1], [], 0
        for ci, size in enumerate(sizes):
            a, b = max(lo_row, base), min(hi_row, base + size)
            if a < b:
                pieces.append((ci, a - base, b - base))
            base += size
        subs.append(pieces)
    return subs


@dataclass(frozen=True)
class Traffic:
    """Bytes one iteration moves between instances and the load it puts on each."""

    query_bytes: float
    put_bytes: float
    replication_bytes: float
    num_replications: int
    load: np.ndarray  # [N] prefix tokens read per instance (rows × tokens)


@dataclass(frozen=True)
class _Index:
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


@dataclass(frozen=True)
class _PieceInfo:
    """Per piece (a sub-batch's share of one chunk), in sub-batch order."""

    first_piece: np.ndarray  # [U + 1] first piece of each sub-batch
    request_ids: list
    rows: np.ndarray  # int64
    starts: np.ndarray  # int64 prefix length (chunk start)
    positions: np.ndarray  # int64 token position of the piece's first row


class PlanBuilder:
    def __init__(
        self,
        tree: PrefixTree,
        stats: AccessStats,
        num_instances: int,
        q_row_bytes: float,
        kv_token_bytes: float,
        segment_bytes: float,
        seed: int = 0,
    ) -> None:
        self.tree, self.table, self.stats = tree, tree.table, stats
        self.segment_len = tree.segment_len
        self.num_instances = num_instances
        self.q_row_bytes, self.kv_token_bytes = q_row_bytes, kv_token_bytes
        self.segment_bytes = segment_bytes
        self._seed = seed

    def build(
        self,
        epoch: int,
        batches: Sequence[Sequence[PlannedChunk]],
        dops: Sequence[int],
        live: Sequence[int],
        replications: Sequence[tuple[Node, Location, Location]] = (),
        instances: Sequence[Sequence[int] | None] | None = None,
    ) -> tuple[Plans, Traffic]:
        n_inst = self.num_instances
        subs = [
            (b, j, [(batch[ci], lo, hi) for ci, lo, hi in pieces])
            for b, (batch, dop) in enumerate(zip(batches, dops, strict=True))
            for j, pieces in enumerate(split_rows(batch, dop))
        ]
        piece_sub, piece_rows, pieces = [], [], []
        for u, (_, _, sub_pieces) in enumerate(subs):
            for piece in sub_pieces:
                piece_sub.append(u)
                piece_rows.append(piece[2] - piece[1])
                pieces.append(piece)
        piece_sub = np.asarray(piece_sub, dtype=np.int64)
        piece_rows = np.asarray(piece_rows, dtype=np.float64)
        acc = self._gather(pieces, piece_rows)
        inst, _, tokens, piece_of, _ = acc
        load = np.bincount(inst, weights=tokens * piece_rows[piece_of], minlength=n_inst)
        index = self._index(acc, piece_sub)
        # traffic matrices for dispatch: rows to each holder once per request, tokens to homes
        query_rows = np.zeros((len(subs), n_inst))
        np.add.at(query_rows, (index.e_sub, index.e_inst), piece_rows[index.e_piece])
        runs, copies = self._runs(pieces, piece_sub)
        put_tokens = np.zeros((len(subs), n_inst))
        if len(runs):
            np.add.at(put_tokens, (runs[:, 0], runs[:, 1]), runs[:, 3])
        cost = traffic_cost(query_rows, put_tokens, self.q_row_bytes, self.kv_token_bytes)
        allowed = None
        if instances is not None and any(i is not None for i in instances):
            allowed = np.ones((len(subs), n_inst), dtype=bool)
            for u, (b, _, _) in enumerate(subs):
                if instances[b] is not None:
                    allowed[u] = False
                    allowed[u, list(instances[b])] = True
        origins = hungarian_dispatch(cost, live, allowed)
        copies += self._replication_copies(replications, origins)

        local = np.arange(len(subs))
        remote_rows = float((query_rows.sum(axis=1) - query_rows[local, origins]).sum())
        remote_tokens = float((put_tokens.sum(axis=1) - put_tokens[local, origins]).sum())
        traffic = Traffic(
            query_bytes=remote_rows * self.q_row_bytes,
            put_bytes=remote_tokens * self.kv_token_bytes,
            replication_bytes=len(replications) * self.segment_bytes,
            num_replications=len(replications),
            load=load,
        )
        first_piece = np.searchsorted(piece_sub, np.arange(len(subs) + 1))
        rids = [pc.state.request_id for pc, _, _ in pieces]
        starts = np.fromiter((pc.start for pc, _, _ in pieces), dtype=np.int64, count=len(pieces))
        lows = np.fromiter((lo for _, lo, _ in pieces), dtype=np.int64, count=len(pieces))
        heads = _PieceInfo(first_piece, rids, piece_rows.astype(np.int64), starts, starts + lows)
        query_plans = self._query_plans(epoch, subs, origins, heads, index)
        transfer_plans = self._transfer_plans(epoch, subs, origins, runs, copies, heads)
        groups: list[list[int]] = [[] for _ in batches]
        for (b, _, _), origin in zip(subs, origins, strict=True):
            groups[b].append(int(origin))
        plans = Plans(epoch, tuple(query_plans), tuple(transfer_plans), tuple(map(tuple, groups)))
        return plans, traffic

    def _gather(self, pieces, piece_rows):
        """Every prefix page of every piece: ``(inst, slot, tokens, piece, is_partial)``."""
        seg, table = self.segment_len, self.table
        page_lists = [pc.state.page_idx for pc, _, _ in pieces]
        sources, fixed = [], []  # partial last pages: a shared source node, or an open tail
        for p, (pc, _, _) in enumerate(pieces):
            if pc.source is not None:
                sources.append((pc.source.idx, p, pc.source_len))
            elif pc.state.open is not None and len(pc.state.open.tokens):
                loc = pc.state.open.location
                fixed.append((loc.instance_id, loc.slot_id, len(pc.state.open.tokens), p))
        lens = np.fromiter(map(len, page_lists), dtype=np.int64, count=len(page_lists))
        src = np.asarray(sources, dtype=np.int64).reshape(-1, 3)
        idx = np.concatenate([*page_lists, src[:, 0]]).astype(np.int64, copy=False)
        node_piece = np.concatenate([np.repeat(np.arange(len(pieces)), lens), src[:, 1]])
        node_tokens = np.concatenate([np.full(int(lens.sum()), float(seg)), src[:, 2]])
        inst = table.rep_inst[idx, 0].astype(np.int64)
        slot = table.rep_slot[idx, 0].astype(np.int64)
        rows = piece_rows[node_piece]
        self._choose_replicas(idx, inst, slot, node_tokens * rows)
        self.stats.record_accesses(idx, rows, node_tokens)
        f = np.asarray(fixed, dtype=np.int64).reshape(-1, 4)
        inst = np.concatenate([inst, f[:, 0]])
        slot = np.concatenate([slot, f[:, 1]])
        tokens = np.concatenate([node_tokens, f[:, 2]])
        piece_of = np.concatenate([node_piece, f[:, 3]])
        partial = (tokens < seg).astype(np.int64)
        return inst, slot, tokens, piece_of, partial

    def _choose_replicas(self, idx, inst, slot, weights) -> None:
        """Power of two choices for pages with several replicas, on the window load plus the
        load this iteration has already placed (in place on ``inst`` / ``slot``)."""
        nrep = self.table.num_replicas[idx]
        multi = nrep > 1
        if not multi.any():
            return
        load = self.stats.recent_load + np.bincount(
            inst[~multi], weights=weights[~multi], minlength=self.num_instances
        )
        m_idx = idx[multi]
        chosen = np.empty(len(m_idx), dtype=np.int32)
        self._seed += 1
        _C.choose_replicas(
            np.ascontiguousarray(self.table.rep_inst[m_idx]),
            np.ascontiguousarray(nrep[multi]),
            np.ascontiguousarray(weights[multi]),
            load,
            self._seed,
            chosen,
        )
        inst[multi] = self.table.rep_inst[m_idx, chosen]
        slot[multi] = self.table.rep_slot[m_idx, chosen]
        for key in np.unique(m_idx * self.num_instances + inst[multi]).tolist():
            self.tree.touch_replica(key // self.num_instances, key % self.num_instances)

    def _runs(self, pieces, piece_sub):
        """Put runs ``[sub, dst_inst, src_row, len, slot, offset]`` and copy-on-extend orders."""
        runs, copies = [], []
        row_base, prev_sub = 0, -1
        for p, (pc, lo, hi) in enumerate(pieces):
            u = int(piece_sub[p])
            if u != prev_sub:
                row_base, prev_sub = 0, u
            whole = lo == 0 and hi == pc.end - pc.start
            for w in pc.writes:
                loc = w.location
                if whole:  # the common case: the sub-batch has every row of the chunk
                    n_new = len(w.tokens) - w.num_before
                    runs.append(
                        (
                            u,
                            loc.instance_id,
                            row_base + w.chunk_offset,
                            n_new,
                            loc.slot_id,
                            w.num_before,
                        )
                    )
                else:
                    w_lo = w.chunk_offset
                    a, z = max(lo, w_lo), min(hi, w_lo + w.num_new)
                    if a < z:
                        offset = w.num_before + a - w_lo
                        runs.append(
                            (u, loc.instance_id, row_base + a - lo, z - a, loc.slot_id, offset)
                        )
                if lo == 0 and w.copy_from is not None:
                    src = w.copy_from
                    copies.append(
                        (
                            u,
                            src.instance_id,
                            src.slot_id,
                            loc.instance_id,
                            loc.slot_id,
                            w.num_before,
                        )
                    )
            row_base += hi - lo
        return np.asarray(runs, dtype=np.int64).reshape(-1, 6), copies

    def _replication_copies(self, replications, origins) -> list[tuple]:
        """Attach each replication order to the sub-batch running on its destination (else
        its source, else the first) so one transfer engine executes it at ``init_transfer``."""
        out = []
        where = {int(o): u for u, o in enumerate(origins)}
        for node, src, dst in replications:
            u = where.get(dst.instance_id, where.get(src.instance_id, 0))
            out.append(
                (u, src.instance_id, src.slot_id, dst.instance_id, dst.slot_id, len(node.tokens))
            )
        return out

    def _index(self, acc, piece_sub) -> _Index:
        """Sort every access by (sub-batch, holder, request, partial-last) once; each plan's
        CSR arrays are then slices of the same global arrays."""
        inst, slot, tokens, piece_of, partial = acc
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
        return _Index(
            slot=slot.astype(np.int32),
            e_start=e_start,
            e_sub=e_sub,
            e_inst=e_inst,
            e_piece=e_piece,
            e_last=tokens[e_end - 1].astype(np.int32),
            h_start=h_start,
            h_sub=e_sub[h_start],
            a_sub=sub_of,
        )

    def _query_plans(
        self, epoch, subs, origins, heads: _PieceInfo, index: _Index
    ) -> list[QueryPlan]:
        num = np.arange(len(subs) + 1)
        a_bounds = np.searchsorted(index.a_sub, num)
        e_bounds = np.searchsorted(index.e_sub, num)
        h_bounds = np.searchsorted(index.h_sub, num)
        fp = heads.first_piece
        e_req = (index.e_piece - fp[index.e_sub]).astype(np.int32)
        h_inst = index.e_inst[index.h_start].astype(np.int32)
        h_indptr = (index.h_start - e_bounds[index.h_sub]).astype(np.int32)
        kv_indptr = (index.e_start - a_bounds[index.e_sub]).astype(np.int32)
        positions = heads.positions.astype(np.int32)
        prefix_lens = heads.starts.astype(np.int32)
        plans = []
        for u, (b, j, _) in enumerate(subs):
            a_lo, a_hi = a_bounds[u], a_bounds[u + 1]
            e_lo, e_hi, h_lo, h_hi = e_bounds[u], e_bounds[u + 1], h_bounds[u], h_bounds[u + 1]
            p_lo, p_hi = fp[u], fp[u + 1]
            plans.append(
                QueryPlan(
                    epoch=epoch,
                    batch_index=b,
                    sub_batch_index=j,
                    origin=int(origins[u]),
                    request_ids=tuple(heads.request_ids[p_lo:p_hi]),
                    q_indptr=frozen_i32(np.concatenate([[0], np.cumsum(heads.rows[p_lo:p_hi])])),
                    positions=frozen_i32(positions[p_lo:p_hi]),
                    prefix_lens=frozen_i32(prefix_lens[p_lo:p_hi]),
                    holder_ids=frozen_i32(h_inst[h_lo:h_hi]),
                    holder_indptr=frozen_i32(np.append(h_indptr[h_lo:h_hi], e_hi - e_lo)),
                    entry_req=frozen_i32(e_req[e_lo:e_hi]),
                    kv_indptr=frozen_i32(np.append(kv_indptr[e_lo:e_hi], a_hi - a_lo)),
                    kv_indices=frozen_i32(index.slot[a_lo:a_hi]),
                    last_len=frozen_i32(index.e_last[e_lo:e_hi]),
                )
            )
        return plans

    def _transfer_plans(
        self, epoch, subs, origins, runs, copies, heads: _PieceInfo
    ) -> list[TransferPlan]:
        runs = runs[np.argsort(runs[:, 0] * self.num_instances + runs[:, 1], kind="stable")]
        runs = runs.astype(np.int32)
        n = len(runs)
        new_dst = np.ones(n, dtype=bool)
        new_dst[1:] = (runs[1:, 0] != runs[:-1, 0]) | (runs[1:, 1] != runs[:-1, 1])
        d_start = np.flatnonzero(new_dst)
        num = np.arange(len(subs) + 1)
        r_bounds = np.searchsorted(runs[:, 0], num)
        d_bounds = np.searchsorted(runs[d_start, 0], num)
        d_indptr = (d_start - r_bounds[runs[d_start, 0]]).astype(np.int32)
        d_ids = runs[d_start, 1]
        c = np.asarray(copies, dtype=np.int32).reshape(-1, 6)
        c = c[np.argsort(c[:, 0], kind="stable")]
        c_bounds = np.searchsorted(c[:, 0], num)
        plans = []
        for u, (b, j, _) in enumerate(subs):
            r_lo, r_hi, d_lo, d_hi = r_bounds[u], r_bounds[u + 1], d_bounds[u], d_bounds[u + 1]
            cu = c[c_bounds[u] : c_bounds[u + 1]]
            p_lo, p_hi = heads.first_piece[u], heads.first_piece[u + 1]
            plans.append(
                TransferPlan(
                    epoch=epoch,
                    batch_index=b,
                    sub_batch_index=j,
                    origin=int(origins[u]),
                    request_ids=tuple(heads.request_ids[p_lo:p_hi]),
                    num_rows=int(heads.rows[p_lo:p_hi].sum()),
                    dst_ids=frozen_i32(d_ids[d_lo:d_hi]),
                    dst_indptr=frozen_i32(np.append(d_indptr[d_lo:d_hi], r_hi - r_lo)),
                    run_src_row=frozen_i32(runs[r_lo:r_hi, 2]),
                    run_len=frozen_i32(runs[r_lo:r_hi, 3]),
                    run_dst_slot=frozen_i32(runs[r_lo:r_hi, 4]),
                    run_dst_offset=frozen_i32(runs[r_lo:r_hi, 5]),
                    copy_src_instance=frozen_i32(cu[:, 1]),
                    copy_src_slot=frozen_i32(cu[:, 2]),
                    copy_dst_instance=frozen_i32(cu[:, 3]),
                    copy_dst_slot=frozen_i32(cu[:, 4]),
                    copy_len=frozen_i32(cu[:, 5]),
                )
            )
        return plans
