"""Turns planned chunks into immutable plans: gathers their prefix pages (``page_gather``),
matches sub-batches to instances (Hungarian, §5) and cuts per-sub-batch CSR plans."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenlake.chunk_set import ChunkSet
from tokenlake.dispatch import hungarian_dispatch, traffic_cost
from tokenlake.page_gather import Gathered, PageGatherer, PageIndex
from tokenlake.plans import Plans, QueryPlan, TransferPlan, read_only
from tokenlake.prefix_tree import Location, Node
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
        cs: ChunkSet,
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
        pieces = cs.pieces(dops)
        subs, num_subs = pieces.subs, len(pieces.subs)
        piece_rows = pieces.rows.astype(np.float64)
        acc = self.pages.gather(cs, pieces, base_load, seed)
        load = np.bincount(
            acc.inst, weights=acc.tokens * piece_rows[acc.piece_of], minlength=n_inst
        )
        index = self.pages.index(acc, pieces.sub)
        # traffic matrices for dispatch: rows to each holder once per request, tokens to homes
        query_rows = np.zeros((num_subs, n_inst))
        np.add.at(query_rows, (index.e_sub, index.e_inst), piece_rows[index.e_piece])
        runs, copies = cs.runs(pieces)
        put_tokens = np.zeros((num_subs, n_inst))
        if len(runs):
            np.add.at(put_tokens, (runs[:, 0], runs[:, 1]), runs[:, 3])
        cost = traffic_cost(query_rows, put_tokens, self.q_row_bytes, self.kv_token_bytes)
        allowed = None
        if instances is not None and any(i is not None for i in instances):
            allowed = np.ones((num_subs, n_inst), dtype=bool)
            for u, (b, _) in enumerate(subs):
                if instances[b] is not None:
                    allowed[u] = False
                    allowed[u, [int(i) for i in instances[b]]] = True
        origins = hungarian_dispatch(cost, candidates, allowed)
        copies += self._replication_copies(replications, origins)

        local = np.arange(num_subs)
        remote_rows = float((query_rows.sum(axis=1) - query_rows[local, origins]).sum())
        remote_tokens = float((put_tokens.sum(axis=1) - put_tokens[local, origins]).sum())
        traffic = Traffic(
            query_bytes=remote_rows * self.q_row_bytes,
            put_bytes=remote_tokens * self.kv_token_bytes,
            replication_bytes=len(replications) * self.segment_bytes,
            num_replications=len(replications),
            load=load,
        )
        first_piece = np.searchsorted(pieces.sub, np.arange(num_subs + 1))
        rids = [cs.request_ids[i] for i in pieces.chunk.tolist()]
        starts = cs.start[pieces.chunk]
        heads = _PieceInfo(first_piece, rids, pieces.rows, starts, starts + pieces.lo)
        fp, origin_ids = first_piece.tolist(), origins.tolist()
        headers = [  # the fields a sub-batch's query and transfer plans share
            dict(
                epoch=epoch,
                batch_index=b,
                sub_batch_index=j,
                origin=origin_ids[u],
                request_ids=tuple(rids[fp[u] : fp[u + 1]]),
            )
            for u, (b, j) in enumerate(subs)
        ]
        query_plans = self._query_plans(headers, heads, index)
        transfer_plans = self._transfer_plans(headers, runs, copies, heads)
        groups: list[list[int]] = [[] for _ in dops]
        for (b, _), origin in zip(subs, origins.tolist(), strict=True):
            groups[b].append(origin)
        plans = Plans(
            epoch,
            tuple(query_plans),
            tuple(transfer_plans),
            tuple(map(tuple, groups)),
            pool_id=pool_id,
        )
        return plans, traffic, acc

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

    def _query_plans(self, headers, heads: _PieceInfo, index: PageIndex) -> list[QueryPlan]:
        """Every sub-batch's query plan: slices of global arrays (read-only views) and a few
        small offset arrays, so the per-sub-batch cost is a handful of numpy calls."""
        num = np.arange(len(headers) + 1)
        a_bounds = np.searchsorted(index.a_sub, num).tolist()
        e_bounds = np.searchsorted(index.e_sub, num).tolist()
        h_bounds = np.searchsorted(index.h_sub, num).tolist()
        fp = heads.first_piece.tolist()
        e_req = read_only((index.e_piece - heads.first_piece[index.e_sub]).astype(np.int32))
        h_inst = read_only(index.e_inst[index.h_start].astype(np.int32))
        q_start = np.cumsum(heads.rows) - heads.rows
        q_ptr = grouped_indptr(q_start, fp, int(heads.rows.sum()))
        h_ptr = grouped_indptr(index.h_start, h_bounds, len(index.e_start))
        kv_ptr = grouped_indptr(index.e_start, e_bounds, len(index.slot))
        positions = read_only(heads.positions.astype(np.int32))
        prefix_lens = read_only(heads.starts.astype(np.int32))
        plans = []
        for u, head in enumerate(headers):
            a_lo, a_hi = a_bounds[u], a_bounds[u + 1]
            e_lo, e_hi, h_lo, h_hi = e_bounds[u], e_bounds[u + 1], h_bounds[u], h_bounds[u + 1]
            p_lo, p_hi = fp[u], fp[u + 1]
            plans.append(
                QueryPlan(
                    **head,
                    q_indptr=q_ptr[p_lo + u : p_hi + u + 1],
                    positions=positions[p_lo:p_hi],
                    prefix_lens=prefix_lens[p_lo:p_hi],
                    holder_ids=h_inst[h_lo:h_hi],
                    holder_indptr=h_ptr[h_lo + u : h_hi + u + 1],
                    entry_req=e_req[e_lo:e_hi],
                    kv_indptr=kv_ptr[e_lo + u : e_hi + u + 1],
                    kv_indices=index.slot[a_lo:a_hi],
                    last_len=index.e_last[e_lo:e_hi],
                )
            )
        return plans

    def _transfer_plans(self, headers, runs, copies, heads: _PieceInfo) -> list[TransferPlan]:
        runs = runs[np.argsort(runs[:, 0] * self.num_instances + runs[:, 1], kind="stable")]
        runs = runs.astype(np.int32)
        cols = [read_only(np.ascontiguousarray(runs[:, k])) for k in range(6)]
        n = len(runs)
        new_dst = np.ones(n, dtype=bool)
        new_dst[1:] = (runs[1:, 0] != runs[:-1, 0]) | (runs[1:, 1] != runs[:-1, 1])
        d_start = np.flatnonzero(new_dst)
        num = np.arange(len(headers) + 1)
        r_bounds = np.searchsorted(runs[:, 0], num).tolist()
        d_bounds = np.searchsorted(runs[d_start, 0], num).tolist()
        d_ptr = grouped_indptr(d_start, d_bounds, n)
        d_ids = read_only(runs[d_start, 1])
        c = np.asarray(copies, dtype=np.int32).reshape(-1, 6)
        c = c[np.argsort(c[:, 0], kind="stable")]
        c_cols = [read_only(np.ascontiguousarray(c[:, k])) for k in range(6)]
        c_bounds = np.searchsorted(c[:, 0], num).tolist()
        rows = np.concatenate([[0], np.cumsum(heads.rows)]).tolist()
        fp = heads.first_piece.tolist()
        plans = []
        for u, head in enumerate(headers):
            r_lo, r_hi, d_lo, d_hi = r_bounds[u], r_bounds[u + 1], d_bounds[u], d_bounds[u + 1]
            c_lo, c_hi = c_bounds[u], c_bounds[u + 1]
            p_lo, p_hi = fp[u], fp[u + 1]
            plans.append(
                TransferPlan(
                    **head,
                    num_rows=rows[p_hi] - rows[p_lo],
                    dst_ids=d_ids[d_lo:d_hi],
                    dst_indptr=d_ptr[d_lo + u : d_hi + u + 1],
                    run_src_row=cols[2][r_lo:r_hi],
                    run_len=cols[3][r_lo:r_hi],
                    run_dst_slot=cols[4][r_lo:r_hi],
                    run_dst_offset=cols[5][r_lo:r_hi],
                    copy_src_instance=c_cols[1][c_lo:c_hi],
                    copy_src_slot=c_cols[2][c_lo:c_hi],
                    copy_dst_instance=c_cols[3][c_lo:c_hi],
                    copy_dst_slot=c_cols[4][c_lo:c_hi],
                    copy_len=c_cols[5][c_lo:c_hi],
                )
            )
        return plans


def grouped_indptr(starts: np.ndarray, bounds: Sequence[int], total: int) -> np.ndarray:
    """Every group's CSR offsets in one read-only int32 array, so each group's is a slice.

    Elements ``bounds[g]:bounds[g+1]`` (group ``g``) start at global offsets ``starts[e]``
    (non-decreasing; the last element ends at ``total``). Group ``g``'s offsets, relative to
    its first element and with its end appended, are ``out[bounds[g] + g : bounds[g+1] + g + 1]``.
    """
    bounds = np.asarray(bounds, dtype=np.int64)
    num_groups, n = len(bounds) - 1, len(starts)
    ext = np.append(starts, total)
    base = ext[bounds[:-1]]
    group_of = np.repeat(np.arange(num_groups), np.diff(bounds))
    out = np.empty(n + num_groups, dtype=np.int32)
    out[np.arange(n) + group_of] = starts - base[group_of]
    out[bounds[1:] + np.arange(num_groups)] = ext[bounds[1:]] - base
    return read_only(out)
