"""Turns planned chunks and dispatch groups into immutable Query/Transfer plans."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenlake.plans import Plans, QueryPlan, TransferPlan, frozen_i32
from tokenlake.requests import PlannedChunk

Piece = tuple[int, int, int]  # (chunk index in batch, first row, end row) within the chunk


def split_rows(chunks: Sequence[PlannedChunk], dop: int) -> list[list[Piece]]:
    """Split a batch's rows into ``dop`` contiguous, near-equal sub-batches."""
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


class PlanBuilder:
    """Builds plans; ``load`` accumulates tokens read per instance (rows × prefix tokens)."""

    def __init__(self, segment_len: int, num_instances: int) -> None:
        self.segment_len = segment_len
        self.num_instances = num_instances

    def build(
        self,
        epoch: int,
        batches: Sequence[Sequence[PlannedChunk]],
        groups: Sequence[tuple[int, ...]],
    ) -> tuple[Plans, np.ndarray]:
        load = np.zeros(self.num_instances, dtype=np.float64)
        query_plans, transfer_plans = [], []
        for b, (chunks, group) in enumerate(zip(batches, groups, strict=True)):
            for j, pieces in enumerate(split_rows(chunks, len(group))):
                args = (epoch, b, j, group[j], chunks, pieces)
                query_plans.append(self._query_plan(*args, load))
                transfer_plans.append(self._transfer_plan(*args))
        plans = Plans(epoch, tuple(query_plans), tuple(transfer_plans), tuple(groups))
        return plans, load

    def _query_plan(self, epoch, b, j, origin, chunks, pieces, load) -> QueryPlan:
        seg = self.segment_len
        holders: dict[int, list[tuple[int, list[int], int]]] = {}
        q_indptr, positions, prefix_lens = [0], [], []
        for r, (ci, lo, hi) in enumerate(pieces):
            pc = chunks[ci]
            q_indptr.append(q_indptr[-1] + hi - lo)
            positions.append(pc.start + lo)
            prefix_lens.append(pc.start)
            per_instance: dict[int, tuple[list[int], int]] = {}
            for node, loc, num_tokens in pc.prefix_pages(seg):
                slots, _ = per_instance.get(loc.instance_id, ([], 0))
                slots.append(loc.slot_id)
                # the one partial page is the last prefix page, hence last on its holder
                per_instance[loc.instance_id] = (slots, num_tokens)
                load[loc.instance_id] += (hi - lo) * num_tokens
                if node is not None:
                    node.num_accesses += hi - lo
            for instance_id, (slots, last) in per_instance.items():
                holders.setdefault(instance_id, []).append((r, slots, last))
        holder_ids = sorted(holders)
        holder_indptr, entry_req, kv_indptr, kv_indices, last_len = [0], [], [0], [], []
        for instance_id in holder_ids:
            for r, slots, last in holders[instance_id]:
                entry_req.append(r)
                kv_indices.extend(slots)
                kv_indptr.append(len(kv_indices))
                last_len.append(last)
            holder_indptr.append(len(entry_req))
        return QueryPlan(
            epoch=epoch,
            batch_index=b,
            sub_batch_index=j,
            origin=origin,
            request_ids=tuple(chunks[ci].state.request_id for ci, _, _ in pieces),
            q_indptr=frozen_i32(q_indptr),
            positions=frozen_i32(positions),
            prefix_lens=frozen_i32(prefix_lens),
            holder_ids=frozen_i32(holder_ids),
            holder_indptr=frozen_i32(holder_indptr),
            entry_req=frozen_i32(entry_req),
            kv_indptr=frozen_i32(kv_indptr),
            kv_indices=frozen_i32(kv_indices),
            last_len=frozen_i32(last_len),
        )

    def _transfer_plan(self, epoch, b, j, origin, chunks, pieces) -> TransferPlan:
        runs: list[tuple[int, int, int, int, int]] = []  # dst, src_row, len, slot, offset
        copies: list[tuple[int, int, int, int, int]] = []
        row_base = 0
        for ci, lo, hi in pieces:
            pc = chunks[ci]
            for w in pc.writes:
                w_lo, w_hi = w.chunk_offset, w.chunk_offset + w.num_new
                a, z = max(lo, w_lo), min(hi, w_hi)
                if a < z:
                    loc = w.location
                    runs.append(
                        (
                            loc.instance_id,
                            row_base + a - lo,
                            z - a,
                            loc.slot_id,
                            w.num_before + a - w_lo,
                        )
                    )
                if lo == 0 and w.copy_from is not None:
                    src, dst = w.copy_from, w.location
                    copies.append(
                        (src.instance_id, src.slot_id, dst.instance_id, dst.slot_id, w.num_before)
                    )
            row_base += hi - lo
        runs.sort(key=lambda run: run[0])
        dst_ids, counts = np.unique(
            np.array([run[0] for run in runs], dtype=np.int64), return_counts=True
        )
        dst_indptr = np.concatenate([[0], np.cumsum(counts)])
        cols = list(zip(*runs, strict=True)) if runs else [()] * 5
        ccols = list(zip(*copies, strict=True)) if copies else [()] * 5
        return TransferPlan(
            epoch=epoch,
            batch_index=b,
            sub_batch_index=j,
            origin=origin,
            request_ids=tuple(chunks[ci].state.request_id for ci, _, _ in pieces),
            num_rows=row_base,
            dst_ids=frozen_i32(dst_ids),
            dst_indptr=frozen_i32(dst_indptr),
            run_src_row=frozen_i32(cols[1]),
            run_len=frozen_i32(cols[2]),
            run_dst_slot=frozen_i32(cols[3]),
            run_dst_offset=frozen_i32(cols[4]),
            copy_src_instance=frozen_i32(ccols[0]),
            copy_src_slot=frozen_i32(ccols[1]),
            copy_dst_instance=frozen_i32(ccols[2]),
            copy_dst_slot=frozen_i32(ccols[3]),
            copy_len=frozen_i32(ccols[4]),
        )
