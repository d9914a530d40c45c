"""SGLang requests → pool requests, and one forward batch's rows → one iteration's plan rows.

SGLang names a running request by its row in ``ReqToTokenPool`` (``req_pool_idx``) and the
row's generation (bumped at every allocation), so a reused row is a new request. A pool
request starts where both sides have the KV: at most SGLang's prefix (the tokens it will not
recompute) and at most what the pool holds. Tokens SGLang cached but the pool does not (the
pool evicted them, or SGLang matched inside another request's still-open segment) are
*backfilled*: their K/V are read from SGLang's KV cache and put into the pool with the new
tokens, and the local causal attention covers them too.

Nothing here reads the device per request (on a GPU each read would wait for its stream):
:class:`HostTokens` keeps every row's token ids on the host, and the index tensors of a
forward are gathered on the device from host-built indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenlake.plans import Chunk

from .model_check import UnsupportedFeatureError
from .pool_runtime import BoundIteration, PoolRuntime


@dataclass(frozen=True)
class SeqInfo:
    """One request of a forward batch, on the host.

    ``new_len`` tokens are computed now at positions ``seq_len - new_len ... seq_len - 1``;
    SGLang already holds the KV of the ``prefix_len`` before them.
    """

    row: int
    generation: int
    rid: str | None
    seq_len: int
    new_len: int

    @property
    def prefix_len(self) -> int:
        return self.seq_len - self.new_len


@dataclass(eq=False)
class _Tracked:
    pool_id: str
    generation: int


class RequestTable:
    """Which pool request each SGLang row holds; finishes those SGLang released."""

    def __init__(self, runtime: PoolRuntime) -> None:
        self.runtime = runtime
        self._rows: dict[int, _Tracked] = {}
        self._serial = 0

    def __len__(self) -> int:
        return len(self._rows)

    def pool_id(self, row: int) -> str | None:
        tracked = self._rows.get(row)
        return tracked.pool_id if tracked else None

    def release(self, free_rows: set[int], generations: torch.Tensor) -> list[str]:
        """Finish the pool side of every row SGLang freed or reallocated (a request that
        finished, was aborted or retracted). Returns the finished pool ids."""
        done = []
        for row, tracked in list(self._rows.items()):
            if row in free_rows or int(generations[row]) != tracked.generation:
                self.runtime.finish(tracked.pool_id)
                del self._rows[row]
                done.append(tracked.pool_id)
        return done

    def forget(self, rows: list[int]) -> None:
        """Finish the pool side of ``rows`` now (their forward is not pooled)."""
        for row in rows:
            tracked = self._rows.pop(row, None)
            if tracked is not None:
                self.runtime.finish(tracked.pool_id)

    def chunk(self, seq: SeqInfo, token_ids: np.ndarray) -> Chunk:
        """The pool chunk computing ``seq``'s tokens: ``start`` is where the pool's KV ends
        (≤ SGLang's prefix); ``token_ids`` are the request's first ``seq_len`` tokens."""
        tracked = self._rows.get(seq.row)
        if tracked is not None and tracked.generation == seq.generation:
            stored = self.runtime.stored_len(tracked.pool_id)
            if stored is not None and stored <= seq.prefix_len:
                return Chunk(tracked.pool_id, token_ids, stored, seq.seq_len)
            # SGLang recomputes tokens the pool already has: start the pool side afresh
            self.runtime.finish(tracked.pool_id)
        self._serial += 1
        name = seq.rid if seq.rid is not None else f"row{seq.row}"
        tracked = _Tracked(f"{self.runtime.request_prefix}{name}#{self._serial}", seq.generation)
        self._rows[seq.row] = tracked
        start = min(self.runtime.match_len(token_ids[: seq.prefix_len]), seq.prefix_len)
        if self.runtime.engine_slots:  # SGLang's pages are the slots: start on a page
            start -= start % self.runtime.segment_len
        return Chunk(tracked.pool_id, token_ids, start, seq.seq_len)


class HostTokens:
    """Each SGLang request's token ids on the host, kept from forward to forward.

    The pool keys segments by token ids, and a forward batch carries only its new tokens'
    ids, on the device. A forward copies its new tokens to the host once (one read for the
    whole batch); a row seen for the first time with a prefix SGLang already holds (its radix
    cache's match) has that prefix read once, all such rows of a forward in one gather and
    one copy. Token ids of the rows of SGLang's ``req_to_token`` (``slot_tokens``: the token id of
    every KV slot, as the backend wrote it)."""

    def __init__(self, req_to_token: torch.Tensor, slot_tokens: torch.Tensor) -> None:
        self.req_to_token, self.slot_tokens = req_to_token, slot_tokens
        self._rows: dict[int, tuple[int, np.ndarray]] = {}  # row -> (generation, ids)

    def release(self, free_rows: set[int], generations: np.ndarray) -> None:
        """Forget rows SGLang freed or gave to another request."""
        for row, (generation, _) in list(self._rows.items()):
            if row in free_rows or int(generations[row]) != generation:
                del self._rows[row]

    def forward(self, seqs: Sequence[SeqInfo], new_ids: np.ndarray) -> list[np.ndarray]:
        """Each request's first ``seq_len`` token ids, ``new_ids`` being the forward's new
        tokens request by request (host copies)."""
        base = np.concatenate([[0], np.cumsum([s.new_len for s in seqs])]).astype(np.int64)
        unknown = [b for b, s in enumerate(seqs) if self._known(s) is None]
        fetched = self._fetch([seqs[b] for b in unknown])
        out = []
        for b, s in enumerate(seqs):
            prefix = fetched[unknown.index(b)] if b in unknown else self._known(s)
            ids = np.concatenate([prefix, new_ids[base[b] : base[b + 1]]]).astype(np.int32)
            self._rows[s.row] = (s.generation, ids)
            out.append(ids)
        return out

    def _known(self, s: SeqInfo) -> np.ndarray | None:
        entry = self._rows.get(s.row)
        if entry is None or entry[0] != s.generation or len(entry[1]) < s.prefix_len:
            return None
        return entry[1][: s.prefix_len]

    def _fetch(self, seqs: Sequence[SeqInfo]) -> list[np.ndarray]:
        """The prefixes of ``seqs`` from the device: one gather, one copy."""
        lens = [s.prefix_len for s in seqs]
        if not sum(lens):
            return [np.zeros(0, dtype=np.int32) for _ in seqs]
        rows = np.repeat([s.row for s in seqs], lens)
        slots = gather(self.req_to_token, rows, np.concatenate([np.arange(n) for n in lens]))
        ids = self.slot_tokens[slots.long()].cpu().numpy()
        if (ids < 0).any():
            row = int(rows[np.flatnonzero(ids < 0)[0]])
            raise UnsupportedFeatureError(
                "--attention-backend tokenlake does not support KV written outside the "
                f"attention backend (request row {row} has KV slots it never saw: "
                "hierarchical cache load-back or PD-disaggregation transfer)"
            )
        return np.split(ids, np.cumsum(lens)[:-1])


def engine_slots(
    seqs: Sequence[SeqInfo], chunks: Sequence[Chunk], req_to_token: torch.Tensor, seg: int
) -> list[np.ndarray]:
    """One copy of the KV (:mod:`.one_copy`): per chunk, the slot of every segment it starts,
    read from the request's SGLang page (page ``2s`` is slot ``s``), in order: one gather and
    one copy for the whole forward."""
    firsts = [
        np.arange(-(-c.start // seg), -(-s.seq_len // seg), dtype=np.int64) * seg
        for s, c in zip(seqs, chunks, strict=True)
    ]
    rows = np.repeat([s.row for s in seqs], [len(f) for f in firsts])
    locs = gather(req_to_token, rows, np.concatenate(firsts)).cpu().numpy().astype(np.int64)
    slots, rest = np.divmod(locs, 2 * seg)
    if rest.any():
        bad = np.flatnonzero(rest)
        raise AssertionError(
            f"row {int(rows[bad[0]])}: SGLang locations {locs[bad][:4].tolist()} do not start "
            f"an even page of {seg} tokens (is SGLang's allocator a SlotPageAllocator?)"
        )
    return np.split(slots.astype(np.int32), np.cumsum([len(f) for f in firsts])[:-1])


def gather(table: torch.Tensor, rows: np.ndarray, cols: np.ndarray) -> torch.Tensor:
    """``table[rows[i], cols[i]]`` for every ``i``, on ``table``'s device (no host read)."""
    device = table.device
    rows_t = torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(device)
    return table[rows_t, torch.from_numpy(np.asarray(cols, dtype=np.int64)).to(device)]


@dataclass(frozen=True)
class BatchMap:
    """Index tensors of one forward, built once and used by every layer.

    SGLang's token rows (``T`` new tokens, request by request in batch order) map to the
    plan's rows (request by request in plan order; each request's rows cover positions
    ``start ... seq_len - 1``: first its backfilled tokens, then its new ones).
    """

    it: BoundIteration
    new_plan_rows: torch.Tensor  # int64 [T]: plan row of each SGLang token row
    plan_new_rows: torch.Tensor  # int64 [T]: plan rows of new tokens, in plan order
    plan_src_rows: torch.Tensor  # int64 [T]: SGLang token row of each of those
    new_indptr: torch.Tensor  # int32 [R + 1]: new rows per plan request
    kv_indptr: torch.Tensor  # int32 [R + 1]: plan rows (backfill + new) per plan request
    backfill_plan_rows: torch.Tensor  # int64 [G]
    backfill_slots: torch.Tensor  # int64 [G]: SGLang KV slots of the backfilled tokens
    new_offsets: np.ndarray  # int64 [R + 1]: new_indptr on the host
    kv_offsets: np.ndarray  # int64 [R + 1]: kv_indptr on the host

    @property
    def num_backfill(self) -> int:
        return int(self.backfill_plan_rows.numel())


def map_batch(
    it: BoundIteration,
    seqs: Sequence[SeqInfo],
    chunks: Sequence[Chunk],
    req_to_token: torch.Tensor,
) -> BatchMap:
    """Index the plan of ``it`` (planned from ``chunks``, one per ``seqs`` entry)."""
    qp = it.query_plan
    device = it.q_buf.device
    order = {c.request_id: b for b, c in enumerate(chunks)}
    token_base = np.concatenate([[0], np.cumsum([s.new_len for s in seqs])])
    new_plan_rows = np.empty(int(token_base[-1]), dtype=np.int64)
    plan_new, plan_src, new_counts, fill_rows, fill_slots = [], [], [], [], []
    for r, pool_id in enumerate(qp.request_ids):
        b = order[pool_id]
        seq, chunk = seqs[b], chunks[b]
        lo, hi = int(qp.q_indptr[r]), int(qp.q_indptr[r + 1])
        if hi - lo != seq.seq_len - chunk.start or int(qp.positions[r]) != chunk.start:
            raise AssertionError(
                f"plan rows of {pool_id!r}: expected positions {chunk.start}..{seq.seq_len - 1}, "
                f"got {int(qp.positions[r])} and {hi - lo} rows"
            )
        num_fill = seq.prefix_len - chunk.start
        rows = np.arange(lo + num_fill, hi, dtype=np.int64)
        src = np.arange(token_base[b], token_base[b + 1], dtype=np.int64)
        new_plan_rows[src] = rows
        plan_new.append(rows)
        plan_src.append(src)
        new_counts.append(seq.new_len)
        if num_fill:
            fill_rows.append(np.arange(lo, lo + num_fill, dtype=np.int64))
            fill_slots.append(np.stack([np.full(num_fill, seq.row),
                                        np.arange(chunk.start, seq.prefix_len)]))  # fmt: skip

    def long(parts: list[np.ndarray]) -> torch.Tensor:
        arr = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return torch.from_numpy(arr.astype(np.int64)).to(device)

    i32 = dict(dtype=torch.int32, device=device)
    new_offsets = np.concatenate([[0], np.cumsum(new_counts)]).astype(np.int64)
    return BatchMap(
        it=it,
        new_plan_rows=torch.from_numpy(new_plan_rows).to(device),
        plan_new_rows=long(plan_new),
        plan_src_rows=long(plan_src),
        new_indptr=torch.tensor(new_offsets, **i32),
        kv_indptr=torch.tensor(qp.q_indptr, **i32),
        backfill_plan_rows=long(fill_rows),
        backfill_slots=_backfill_slots(req_to_token, fill_slots, device),
        new_offsets=new_offsets,
        kv_offsets=np.asarray(qp.q_indptr, dtype=np.int64),
    )


def _backfill_slots(req_to_token: torch.Tensor, where: list[np.ndarray], device) -> torch.Tensor:
    """SGLang KV slots of the backfilled tokens (``where``: ``[2, n]`` rows and columns of
    ``req_to_token`` per request), gathered on the device."""
    if not where:
        return torch.zeros(0, dtype=torch.int64, device=device)
    rows, cols = np.concatenate(where, axis=1)
    return gather(req_to_token, rows, cols).to(device, torch.int64)
