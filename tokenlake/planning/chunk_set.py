"""One iteration's chunks as arrays, and the pieces the sub-batches run.

Most chunks of a serving iteration are decode steps whose new tokens stay inside the
request's open tail: they allocate nothing, reserve nothing in the tree and write one run into
a slot the request already owns. Those are kept "in place" — columns of arrays, no objects —
so planning and committing them is vectorized; every other chunk (a new request, a chunk
that fills or starts a segment) is a :class:`PlannedChunk` whose writes the segment planner
decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np


class PlannedChunk(Protocol):
    """What a chunk set needs of a planned chunk (:class:`tokenlake.iteration.requests.
    PlannedChunk`): its request's state. Structural, so planning does not import iteration."""

    state: Any


class Pieces(NamedTuple):
    """Sub-batch ``sub[p]`` runs rows ``lo[p]:hi[p]`` of chunk ``chunk[p]``; pieces are in
    sub-batch order and ``row_base[p]`` is the piece's first row in its sub-batch's buffers."""

    chunk: np.ndarray  # int64 [P]
    lo: np.ndarray
    hi: np.ndarray
    sub: np.ndarray
    row_base: np.ndarray
    subs: list[tuple[int, int]]  # (batch, j) of every sub-batch, in order

    @property
    def rows(self) -> np.ndarray:
        return self.hi - self.lo


class ChunkSet:
    """Per chunk, in batch order: its request, state, tokens, batch, ``start``/``end``, the
    :class:`PlannedChunk` (``None`` when in place) and the open tail it reads as its last
    prefix page (``open_inst``/``open_slot``/``open_len``, ``open_len == 0`` when none).
    ``new`` lists ``(index, Chunk)`` of the new requests, whose state and planned chunk
    :meth:`admitted` fills in. Built by :func:`tokenlake.iteration.admission.scan_chunks`."""

    def __init__(self, request_ids: list, states: list, token_ids: list, planned: list,
                 cols: np.ndarray, in_place: np.ndarray, new: list) -> None:  # fmt: skip
        self.request_ids, self.states, self.token_ids = request_ids, states, token_ids
        self.planned, self.in_place, self.new = planned, in_place, new
        # cols: int64 [6, num_chunks] = batch, start, end, open inst, open slot, open len
        self.batch, self.start, self.end = cols[0], cols[1], cols[2]
        self.open_inst, self.open_slot, self.open_len = cols[3], cols[4], cols[5]

    def admitted(self, index: int, pc: PlannedChunk) -> None:
        """A new request's chunk, once admitted (its state and planned chunk exist)."""
        self.states[index], self.planned[index] = pc.state, pc

    def __len__(self) -> int:
        return len(self.request_ids)

    @property
    def planned_chunks(self) -> list[PlannedChunk]:
        return [pc for pc in self.planned if pc is not None]

    # ---- pieces --------------------------------------------------------------------------
    def pieces(self, dops: Sequence[int]) -> Pieces:
        """Every batch's rows split into ``dops[b]`` contiguous, near-equal sub-batches."""
        rows = self.end - self.start
        num_batches = len(dops)
        if all(d == 1 for d in dops):  # the common case, vectorized
            chunk = np.arange(len(self))
            lo, hi, sub = np.zeros_like(rows), rows, self.batch
            subs = [(b, 0) for b in range(num_batches)]
        else:
            parts, subs = [], []
            bounds = np.searchsorted(self.batch, np.arange(num_batches + 1))
            for b, dop in enumerate(dops):
                first = len(subs)
                idx = np.arange(bounds[b], bounds[b + 1])
                subs += [(b, j) for j in range(dop)]
                parts.extend(_split(idx, rows[idx], dop, first))
            chunk, lo, hi, sub = (np.asarray(c, dtype=np.int64) for c in zip(*parts, strict=True))
        piece_rows = hi - lo
        ends = np.cumsum(piece_rows)
        first = np.searchsorted(sub, np.arange(len(subs)))
        sub_base = (ends - piece_rows)[np.minimum(first, len(sub) - 1)] if len(sub) else first
        row_base = ends - piece_rows - sub_base[sub]
        return Pieces(chunk, lo, hi, sub, row_base, subs)

    # ---- writes -------------------------------------------------------------------------
    def runs(self, pieces: Pieces) -> tuple[np.ndarray, list[tuple]]:
        """Put runs ``[sub, dst_inst, src_row, len, slot, offset]`` and copy orders
        ``(sub, src_inst, src_slot, dst_inst, dst_slot, len)`` of every piece."""
        in_place = self.in_place[pieces.chunk]
        c = pieces.chunk[in_place]
        lo = pieces.lo[in_place]
        fast = np.stack(
            [
                pieces.sub[in_place],
                self.open_inst[c],
                pieces.row_base[in_place],
                pieces.hi[in_place] - lo,
                self.open_slot[c],
                self.open_len[c] + lo,
            ],
            axis=1,
        )
        runs, copies = [], []
        for p in np.flatnonzero(~in_place).tolist():
            pc = self.planned[int(pieces.chunk[p])]
            _planned_runs(pc, int(pieces.sub[p]), int(pieces.lo[p]), int(pieces.hi[p]),
                          int(pieces.row_base[p]), runs, copies)  # fmt: skip
        slow = np.asarray(runs, dtype=np.int64).reshape(-1, 6)
        return np.concatenate([fast, slow]) if len(slow) else fast, copies

    def commit_in_place(self) -> int:
        """Advance the in-place chunks' requests (their open tails grew); returns the tokens
        they put."""
        idx = np.flatnonzero(self.in_place)
        firsts = (self.start[idx] - self.open_len[idx]).tolist()
        for i, first, end in zip(idx.tolist(), firsts, self.end[idx].tolist(), strict=True):
            state = self.states[i]
            state.num_tokens = end
            state.open.tokens = self.token_ids[i][first:end]
        return int((self.end[idx] - self.start[idx]).sum())


def _split(idx: np.ndarray, sizes: np.ndarray, dop: int, first_sub: int) -> list[tuple]:
    """``(chunk, lo, hi, sub)`` pieces of one batch split into ``dop`` sub-batches."""
    total = int(sizes.sum())
    bounds = [round(total * j / dop) for j in range(dop + 1)]
    out, sizes = [], sizes.tolist()
    for j in range(dop):
        lo_row, hi_row, base = bounds[j], bounds[j + 1], 0
        for ci, size in zip(idx.tolist(), sizes, strict=True):
            a, b = max(lo_row, base), min(hi_row, base + size)
            if a < b:
                out.append((ci, a - base, b - base, first_sub + j))
            base += size
    return out


def _planned_runs(pc: PlannedChunk, sub: int, lo: int, hi: int, row_base: int, runs, copies):
    """Runs and copy orders of one piece of a planned chunk."""
    for w in pc.writes:
        loc = w.location
        w_lo = w.chunk_offset
        a, z = max(lo, w_lo), min(hi, w_lo + w.num_new)
        if a < z:
            offset = w.num_before + a - w_lo
            runs.append((sub, loc.instance_id, row_base + a - lo, z - a, loc.slot_id, offset))
        if lo == 0 and w.copy_from is not None:
            src = w.copy_from
            copies.append(
                (sub, src.instance_id, src.slot_id, loc.instance_id, loc.slot_id, w.num_before)
            )
