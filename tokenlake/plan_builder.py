"""Turns planned chunks into immutable plans: gathers their prefix pages (``page_gather``),
matches sub-batches to instances (Hungarian, §5) and cuts per-sub-batch CSR plans."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenlake.dispatch import hungarian_dispatch, traffic_cost
from tokenlake.page_gather import Gathered, PageGatherer, PageIndex, split_rows
from tokenlake.plans import Plans, QueryPlan, TransferPlan, frozen_i32, read_only
from tokenlake.prefix_tree import Location, Node
from tokenlake.requests import PlannedChunk
from tokenlake.segment_table import SegmentTable


@dataclass(frozen=True)
class Traffic:
    """Bytes one iteration moves between instances and the load it puts on each."""

    query_bytes: float
    put_bytes: float
    replication_bytes: float
    num_replications: int
    load: np.ndarray  # [N] prefix tokens read per instance (rows × tokens)


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
        table: SegmentTable,
        segment_len: int,
        num_instances: int,
        q_row_bytes: float,
        kv_token_bytes: float,
        segment_bytes: float,
    ) -> None:
        self.pages = PageGatherer(table, segment_len, num_instances)
        self.num_instances = num_instances
        self.q_row_bytes, self.kv_token_bytes = q_row_bytes, kv_token_bytes
        self.segment_bytes = segment_bytes

    def build(
        self,
        ids: tuple[str, int],
        batches: Sequence[Sequence[PlannedChunk]],
        dops: Sequence[int],
        candidates: Sequence[int],
        replications: Sequence[tuple[Node, Location, Location]],
        instances: Sequence[Sequence[int] | None] | None,
        base_load: np.ndarray,
        seed: int,
    ) -> tuple[Plans, Traffic, Gathered]:
        """Plans for ``ids = (pool_id, epoch)``: sub-batches go to distinct ``candidates``
        (the free live instances; ``instances[b]`` narrows batch ``b``), replicas are chosen
        on ``base_load`` (see :meth:`PageGatherer.gather`)."""
        pool_id, epoch = ids
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
        acc = self.pages.gather(pieces, piece_rows, base_load, seed)
        inst, tokens, piece_of = acc.inst, acc.tokens, acc.piece_of
        load = np.bincount(inst, weights=tokens * piece_rows[piece_of], minlength=n_inst)
        index = self.pages.index(acc, piece_sub)
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
        origins = hungarian_dispatch(cost, candidates, allowed)
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
        plans = Plans(
            epoch,
            tuple(query_plans),
            tuple(transfer_plans),
            tuple(map(tuple, groups)),
            pool_id=pool_id,
        )
        return plans, traffic, acc

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

    def _query_plans(
        self, epoch, subs, origins, heads: _PieceInfo, index: PageIndex
    ) -> list[QueryPlan]:
        num = np.arange(len(subs) + 1)
        a_bounds = np.searchsorted(index.a_sub, num)
        e_bounds = np.searchsorted(index.e_sub, num)
        h_bounds = np.searchsorted(index.h_sub, num)
        fp = heads.first_piece
        e_req = read_only((index.e_piece - fp[index.e_sub]).astype(np.int32))
        h_inst = read_only(index.e_inst[index.h_start].astype(np.int32))
        h_indptr = (index.h_start - e_bounds[index.h_sub]).astype(np.int32)
        kv_indptr = (index.e_start - a_bounds[index.e_sub]).astype(np.int32)
        positions = read_only(heads.positions.astype(np.int32))
        prefix_lens = read_only(heads.starts.astype(np.int32))
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
        cols = [read_only(np.ascontiguousarray(runs[:, k])) for k in range(6)]
        n = len(runs)
        new_dst = np.ones(n, dtype=bool)
        new_dst[1:] = (runs[1:, 0] != runs[:-1, 0]) | (runs[1:, 1] != runs[:-1, 1])
        d_start = np.flatnonzero(new_dst)
        num = np.arange(len(subs) + 1)
        r_bounds = np.searchsorted(runs[:, 0], num)
        d_bounds = np.searchsorted(runs[d_start, 0], num)
        d_indptr = (d_start - r_bounds[runs[d_start, 0]]).astype(np.int32)
        d_ids = read_only(runs[d_start, 1])
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
                    run_src_row=frozen_i32(cols[2][r_lo:r_hi]),
                    run_len=frozen_i32(cols[3][r_lo:r_hi]),
                    run_dst_slot=frozen_i32(cols[4][r_lo:r_hi]),
                    run_dst_offset=frozen_i32(cols[5][r_lo:r_hi]),
                    copy_src_instance=frozen_i32(cu[:, 1]),
                    copy_src_slot=frozen_i32(cu[:, 2]),
                    copy_dst_instance=frozen_i32(cu[:, 3]),
                    copy_dst_slot=frozen_i32(cu[:, 4]),
                    copy_len=frozen_i32(cu[:, 5]),
                )
            )
        return plans
