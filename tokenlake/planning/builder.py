"""Turns planned chunks into immutable plans: gathers their prefix pages (``page_gather``, one
C++ pass), matches sub-batches to instances (Hungarian, §5) and cuts per-sub-batch CSR plans."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from tokenlake import _C
from tokenlake.planning.chunk_set import ChunkSet
from tokenlake.planning.dispatch import hungarian_dispatch, traffic_cost
from tokenlake.planning.page_gather import PageGatherer, PagePlan, Reads
from tokenlake.plans import Plans, QueryPlan, TransferPlan, frozen_i32, read_only
from tokenlake.tree.prefix_tree import Location, Node
from tokenlake.tree.segment_table import SegmentTable


@dataclass(frozen=True)
class Traffic:
    """Bytes one iteration moves between instances and the load it puts on each."""

    query_bytes: float
    put_bytes: float
    replication_bytes: float
    num_replications: int
    load: np.ndarray  # [N] prefix tokens read per instance (rows × tokens)
    instances: frozenset[int]  # every instance the plans use: origins, holders, puts, copies


class TierMoves(NamedTuple):
    """An iteration's host-tier moves: ``loads`` ``(node, slot)`` (a segment in the tier
    loaded into a slot) and ``demotions`` ``(slot, block)`` (a segment evicted from a slot
    into a block)."""

    loads: Sequence[tuple[Node, Location]] = ()
    demotions: Sequence[tuple[Location, int]] = ()


@dataclass(frozen=True)
class _PieceInfo:
    """Per piece (a sub-batch's share of one chunk), in sub-batch order."""

    first_piece: list[int]  # [U + 1] first piece of each sub-batch
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
        hop_bytes: float = 0.0,
        engine_written: bool = False,
    ) -> None:
        self.pages = PageGatherer(table, segment_len, num_instances)
        self.engine_written = engine_written  # the engines wrote every new token in place
        self.num_instances = num_instances
        self.q_row_bytes, self.kv_token_bytes = q_row_bytes, kv_token_bytes
        self.segment_bytes = segment_bytes
        self.hop_bytes = hop_bytes

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
        tier: TierMoves | None = None,
    ) -> tuple[Plans, Traffic, Reads, frozenset[int]]:
        """Plans for ``ids = (pool_id, epoch)``: sub-batches go to distinct ``candidates``
        (the free live instances; ``instances[b]`` narrows batch ``b``), replicas are chosen
        on ``base_load`` (see :meth:`PageGatherer.gather`); segments ``tier.loads`` are read
        in their slots. Also returns the blocks of the demotions the plans copy
        (:func:`tier_runs`)."""
        pool_id, epoch = ids
        tier = tier if tier is not None else TierMoves()
        n_inst = self.num_instances
        pieces = cs.pieces(dops)
        subs, num_subs = pieces.subs, len(pieces.subs)
        loaded = [(node.idx, loc.instance_id, loc.slot_id) for node, loc in tier.loads]
        pages = self.pages.gather(cs, pieces, num_subs, base_load, seed, loaded)
        # traffic matrices for dispatch: rows to each holder once per request, tokens to homes
        query_rows = pages.query_rows
        runs, copies = cs.runs(pieces)
        if self.engine_written:
            runs, copies = runs[:0], []
        put_tokens = np.zeros((num_subs, n_inst))
        if len(runs):
            np.add.at(put_tokens, (runs[:, 0], runs[:, 1]), runs[:, 3])
        cost = traffic_cost(
            query_rows, put_tokens, self.q_row_bytes, self.kv_token_bytes, self.hop_bytes
        )
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

        fp = pages.p_bounds
        rids = [cs.request_ids[i] for i in pieces.chunk.tolist()]
        starts = cs.start[pieces.chunk]
        heads = _PieceInfo(fp, rids, pieces.rows, starts, starts + pieces.lo)
        origin_ids = origins.tolist()
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
        query_plans = self._query_plans(headers, heads, pages)
        moves, copied = tier_runs(query_plans, runs, copies, tier)
        transfer_plans = self._transfer_plans(headers, runs, copies, heads, moves)
        groups: list[list[int]] = [[] for _ in dops]
        for (b, _), origin in zip(subs, origins.tolist(), strict=True):
            groups[b].append(origin)
        traffic = Traffic(
            query_bytes=remote_rows * self.q_row_bytes,
            put_bytes=remote_tokens * self.kv_token_bytes,
            replication_bytes=len(replications) * self.segment_bytes,
            num_replications=len(replications),
            load=pages.load,
            instances=frozenset(origin_ids).union(
                pages.holder_ids.tolist(),
                runs[:, 1].tolist(),
                (c[1] for c in copies),
                (c[3] for c in copies),
                (loc.instance_id for _, loc in tier.loads),
                (loc.instance_id for loc, _ in tier.demotions),
            ),
        )
        plans = Plans(
            epoch,
            tuple(query_plans),
            tuple(transfer_plans),
            tuple(map(tuple, groups)),
            pool_id=pool_id,
        )
        return plans, traffic, pages.reads, copied

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

    def _query_plans(self, headers, heads: _PieceInfo, pages: PagePlan) -> list[QueryPlan]:
        """Every sub-batch's query plan: read-only slices of the iteration's page arrays."""
        a_b, e_b, h_b, fp = pages.a_bounds, pages.e_bounds, pages.h_bounds, heads.first_piece
        positions = read_only(heads.positions.astype(np.int32))
        prefix_lens = read_only(heads.starts.astype(np.int32))
        plans = []
        for u, head in enumerate(headers):
            e_lo, e_hi, h_lo, h_hi = e_b[u], e_b[u + 1], h_b[u], h_b[u + 1]
            p_lo, p_hi = fp[u], fp[u + 1]
            plans.append(
                QueryPlan(
                    **head,
                    q_indptr=pages.q_indptr[p_lo + u : p_hi + u + 1],
                    positions=positions[p_lo:p_hi],
                    prefix_lens=prefix_lens[p_lo:p_hi],
                    holder_ids=pages.holder_ids[h_lo:h_hi],
                    holder_indptr=pages.holder_indptr[h_lo + u : h_hi + u + 1],
                    entry_req=pages.entry_req[e_lo:e_hi],
                    kv_indptr=pages.kv_indptr[e_lo + u : e_hi + u + 1],
                    kv_indices=pages.kv_indices[a_b[u] : a_b[u + 1]],
                    last_len=pages.last_len[e_lo:e_hi],
                )
            )
        return plans

    def _transfer_plans(
        self, headers, runs, copies, heads: _PieceInfo, moves: list[dict] | None = None
    ) -> list[TransferPlan]:
        """Every sub-batch's transfer plan: runs grouped by (sub-batch, destination) and
        copies by sub-batch in one C++ pass; plans hold read-only slices."""
        num_subs, n = len(headers), len(runs)
        copies = np.asarray(copies, dtype=np.int64).reshape(-1, 6)
        run_cols = np.empty((4, n), dtype=np.int32)
        dst_ids = np.empty(n, dtype=np.int32)
        dst_indptr = np.empty(n + num_subs, dtype=np.int32)
        copy_cols = np.empty((5, len(copies)), dtype=np.int32)
        bounds = np.empty(3 * (num_subs + 1), dtype=np.int64)
        _C.plan_transfers(
            num_subs, self.num_instances, runs, copies, run_cols, dst_ids, dst_indptr,
            copy_cols, bounds,
        )  # fmt: skip
        for arr in (run_cols, dst_ids, dst_indptr, copy_cols):
            read_only(arr)
        src_row, run_len, dst_slot, dst_offset = run_cols
        c_src, c_src_slot, c_dst, c_dst_slot, c_len = copy_cols
        r_b, d_b, c_b = bounds.reshape(3, num_subs + 1).tolist()
        rows = np.concatenate([[0], np.cumsum(heads.rows)]).tolist()
        fp = heads.first_piece
        plans = []
        for u, head in enumerate(headers):
            r_lo, r_hi, d_lo, d_hi, c_lo, c_hi = r_b[u], r_b[u + 1], d_b[u], d_b[u + 1], c_b[u], c_b[u + 1]  # fmt: skip
            plans.append(
                TransferPlan(
                    **head,
                    num_rows=rows[fp[u + 1]] - rows[fp[u]],
                    dst_ids=dst_ids[d_lo:d_hi],
                    dst_indptr=dst_indptr[d_lo + u : d_hi + u + 1],
                    run_src_row=src_row[r_lo:r_hi],
                    run_len=run_len[r_lo:r_hi],
                    run_dst_slot=dst_slot[r_lo:r_hi],
                    run_dst_offset=dst_offset[r_lo:r_hi],
                    copy_src_instance=c_src[c_lo:c_hi],
                    copy_src_slot=c_src_slot[c_lo:c_hi],
                    copy_dst_instance=c_dst[c_lo:c_hi],
                    copy_dst_slot=c_dst_slot[c_lo:c_hi],
                    copy_len=c_len[c_lo:c_hi],
                    **(moves[u] if moves else {}),
                )
            )
        return plans


def tier_runs(
    query_plans: Sequence[QueryPlan], runs: np.ndarray, copies: list[tuple], tier: TierMoves
) -> tuple[list[dict], frozenset[int]]:
    """Each sub-batch's host-tier runs (:class:`TransferPlan` fields) and the blocks of the
    demotions they copy.

    A load goes to every sub-batch that reads its slot, so each loads it before its own
    first read (the same bytes into a slot nothing else writes: a reader never sees others).
    A demotion goes to the one sub-batch that writes its slot (a put run, a copy or a load),
    before those writes; a slot several sub-batches write has no such order, and its
    demotion is not copied: the segment is forgotten at commit instead."""
    num_subs = len(query_plans)
    loads: list[list[tuple]] = [[] for _ in range(num_subs)]
    writers: dict[tuple[int, int], set[int]] = {}
    if tier.loads:
        where = {(loc.instance_id, loc.slot_id): node.tier_block for node, loc in tier.loads}
        for u, qp in enumerate(query_plans):
            read = set()
            for h, inst in enumerate(qp.holder_ids.tolist()):
                lo, hi = int(qp.holder_indptr[h]), int(qp.holder_indptr[h + 1])
                pages = qp.kv_indices[int(qp.kv_indptr[lo]) : int(qp.kv_indptr[hi])]
                read.update((inst, s) for s in pages.tolist() if (inst, s) in where)
            for loc in sorted(read):
                loads[u].append((where[loc], *loc))
                writers.setdefault(loc, set()).add(u)
        for loc in sorted(set(where) - set(writers)):  # read by none (not expected): load it
            loads[0].append((where[loc], *loc))
            writers[loc] = {0}
    demotes: list[list[tuple]] = [[] for _ in range(num_subs)]
    copied = set()
    if tier.demotions:
        for sub, inst, *_, slot, _ in runs.tolist():
            writers.setdefault((inst, slot), set()).add(sub)
        for sub, _, _, inst, slot, _ in copies:
            writers.setdefault((inst, slot), set()).add(sub)
        for loc, block in tier.demotions:
            subs = writers.get((loc.instance_id, loc.slot_id), {0})
            if len(subs) == 1:
                demotes[next(iter(subs))].append((loc.instance_id, loc.slot_id, block))
                copied.add(block)
    out = []
    for u in range(num_subs):
        d = np.asarray(demotes[u], dtype=np.int32).reshape(-1, 3)
        ld = np.asarray(loads[u], dtype=np.int32).reshape(-1, 3)
        out.append(
            dict(
                demote_src_instance=frozen_i32(d[:, 0]),
                demote_src_slot=frozen_i32(d[:, 1]),
                demote_dst_block=frozen_i32(d[:, 2]),
                load_src_block=frozen_i32(ld[:, 0]),
                load_dst_instance=frozen_i32(ld[:, 1]),
                load_dst_slot=frozen_i32(ld[:, 2]),
            )
        )
    return out, frozenset(copied)
