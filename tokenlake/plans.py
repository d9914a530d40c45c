"""Immutable plans: what the control plane decides and the data plane executes unchanged.

All index arrays are read-only int32 numpy arrays in FlashInfer's ragged vocabulary
(``*_indptr`` offsets, ``*_indices`` values). Plans are plain data: cheap to log, diff, send
and test without an accelerator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from tokenlake.keys import as_tokens
from tokenlake.validate import check_int, check_request_id, fail, is_int


def read_only(arr: np.ndarray) -> np.ndarray:
    """Mark an array the caller owns read-only, so plans can hold slices of it as they are."""
    arr.flags.writeable = False
    return arr


def frozen_i32(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """A read-only contiguous int32 array (a view when ``values`` already is one)."""
    arr = np.ascontiguousarray(values, dtype=np.int32)
    if arr.flags.writeable:
        arr = arr.view()
        arr.flags.writeable = False
    return arr


@dataclass(frozen=True, slots=True)  # slots: gen_plans reads every chunk's fields
class Chunk:
    """One request's work in one iteration: compute tokens ``token_ids[start:end]``.

    ``token_ids`` holds every token known for the request (prompt, then generated tokens);
    at a request's first chunk it is the whole prompt. ``start`` is the number of tokens
    whose KV is already in the pool: for a new request at most the prefix-tree match, for a
    running one exactly what it has stored. ``end`` defaults to ``len(token_ids)``.

    Checked when built: ``request_id`` an int (int64) or a non-empty str, ``token_ids``
    integers in ``[0, 2**31)``, ``0 <= start < end <= len(token_ids)`` as ints
    (:class:`~tokenlake.InvalidArgumentError` otherwise).
    """

    request_id: int | str
    token_ids: np.ndarray
    start: int
    end: int = -1

    def __post_init__(self) -> None:
        request_id = check_request_id("Chunk.request_id", self.request_id)
        token_ids = as_tokens(self.token_ids, "Chunk.token_ids")
        n = len(token_ids)
        if not n:
            raise fail("Chunk.token_ids", "at least one token id", self.token_ids)
        start = check_int("Chunk.start", self.start, low=0, high=n)
        end = n if is_int(self.end) and self.end == -1 else self.end
        end = check_int("Chunk.end", end, low=start + 1, high=n + 1)
        for name, value in (("request_id", request_id), ("token_ids", token_ids)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "end", end)

    @property
    def num_new_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class HolderPart:
    """The part of a :class:`QueryPlan` one holder instance computes.

    ``rows`` are the rows of the sub-batch's ``q_buf`` it needs, request by request;
    ``q_indptr`` / ``kv_indptr`` / ``kv_indices`` / ``last_len`` are ready for
    :func:`tokenlake.engines.kernels.partial_attention` on that holder's pool.
    """

    instance_id: int
    rows: np.ndarray  # int32 [num_part_rows]
    q_indptr: np.ndarray  # int32 [num_part_reqs + 1]
    kv_indptr: np.ndarray  # int32 [num_part_reqs + 1]
    kv_indices: np.ndarray  # int32 [nnz] slot ids on instance_id
    last_len: np.ndarray  # int32 [num_part_reqs]


@dataclass(frozen=True)
class QueryPlan:
    """Prefix attention of one sub-batch, run from ``origin``.

    Request ``r`` owns q rows ``q_indptr[r]:q_indptr[r+1]``; its first row is token position
    ``positions[r]``. Entries ``holder_indptr[h]:holder_indptr[h+1]`` belong to holder
    ``holder_ids[h]``; entry ``e`` is request ``entry_req[e]``'s pages
    ``kv_indices[kv_indptr[e]:kv_indptr[e+1]]`` on that holder, the last one holding
    ``last_len[e]`` valid tokens. A request with no entries has an empty prefix.
    """

    epoch: int
    batch_index: int
    sub_batch_index: int
    origin: int
    request_ids: tuple
    q_indptr: np.ndarray  # [num_reqs + 1]
    positions: np.ndarray  # [num_reqs]
    prefix_lens: np.ndarray  # [num_reqs]
    holder_ids: np.ndarray  # [num_holders]
    holder_indptr: np.ndarray  # [num_holders + 1]
    entry_req: np.ndarray  # [num_entries]
    kv_indptr: np.ndarray  # [num_entries + 1]
    kv_indices: np.ndarray  # [nnz]
    last_len: np.ndarray  # [num_entries]

    @property
    def num_rows(self) -> int:
        return int(self.q_indptr[-1])

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @cached_property
    def parts(self) -> tuple[HolderPart, ...]:
        out = []
        for h, instance_id in enumerate(self.holder_ids.tolist()):
            lo, hi = int(self.holder_indptr[h]), int(self.holder_indptr[h + 1])
            reqs = self.entry_req[lo:hi]
            starts, ends = self.q_indptr[reqs], self.q_indptr[reqs + 1]
            rows = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)])
            q_indptr = np.concatenate([[0], np.cumsum(ends - starts)])
            kv_lo, kv_hi = int(self.kv_indptr[lo]), int(self.kv_indptr[hi])
            out.append(
                HolderPart(
                    instance_id=instance_id,
                    rows=frozen_i32(rows),
                    q_indptr=frozen_i32(q_indptr),
                    kv_indptr=frozen_i32(self.kv_indptr[lo : hi + 1] - kv_lo),
                    kv_indices=frozen_i32(self.kv_indices[kv_lo:kv_hi]),
                    last_len=frozen_i32(self.last_len[lo:hi]),
                )
            )
        return tuple(out)


@dataclass(frozen=True)
class TransferPlan:
    """Where one sub-batch's new KV goes, run from ``origin``.

    ``kv_buf`` rows ``run_src_row[i] : run_src_row[i] + run_len[i]`` go to token offsets
    ``run_dst_offset[i]...`` of slot ``run_dst_slot[i]``; runs are grouped by destination
    instance: runs ``dst_indptr[d]:dst_indptr[d+1]`` go to ``dst_ids[d]``. ``copy_*`` are
    whole-segment copies (all layers, first ``copy_len`` tokens) done before any put: the
    copy-on-extend of a partial tail and, later, replication orders.

    The host tier's runs, whole segments of all layers, come before the copies:
    ``demote_*`` copy slot ``demote_src_slot[i]`` of instance ``demote_src_instance[i]``
    into host-tier block ``demote_dst_block[i]`` (a segment evicted from the pool; this plan
    writes that slot afterwards), then ``load_*`` copy block ``load_src_block[i]`` into slot
    ``load_dst_slot[i]`` of ``load_dst_instance[i]`` (a hit in the tier, loaded before the
    layers that read it).
    """

    epoch: int
    batch_index: int
    sub_batch_index: int
    origin: int
    request_ids: tuple
    num_rows: int
    dst_ids: np.ndarray  # [num_dsts]
    dst_indptr: np.ndarray  # [num_dsts + 1]
    run_src_row: np.ndarray  # [num_runs]
    run_len: np.ndarray
    run_dst_slot: np.ndarray
    run_dst_offset: np.ndarray
    copy_src_instance: np.ndarray = field(default_factory=lambda: frozen_i32([]))
    copy_src_slot: np.ndarray = field(default_factory=lambda: frozen_i32([]))
    copy_dst_instance: np.ndarray = field(default_factory=lambda: frozen_i32([]))
    copy_dst_slot: np.ndarray = field(default_factory=lambda: frozen_i32([]))
    copy_len: np.ndarray = field(default_factory=lambda: frozen_i32([]))
    demote_src_instance: np.ndarray = field(default_factory=lambda: frozen_i32([]))
    demote_src_slot: np.ndarray = field(default_factory=lambda: frozen_i32([]))
    demote_dst_block: np.ndarray = field(default_factory=lambda: frozen_i32([]))
    load_src_block: np.ndarray = field(default_factory=lambda: frozen_i32([]))
    load_dst_instance: np.ndarray = field(default_factory=lambda: frozen_i32([]))
    load_dst_slot: np.ndarray = field(default_factory=lambda: frozen_i32([]))

    @property
    def num_copies(self) -> int:
        return len(self.copy_len)

    @property
    def num_demotions(self) -> int:
        return len(self.demote_dst_block)

    @property
    def num_loads(self) -> int:
        return len(self.load_src_block)

    def rows_to(self, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-row ``(src_row, dst_slot, dst_offset)`` of destination ``dst_ids[d]``."""
        lo, hi = int(self.dst_indptr[d]), int(self.dst_indptr[d + 1])
        lens = self.run_len[lo:hi].astype(np.int64)
        if not len(lens):
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        step = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        src = np.repeat(self.run_src_row[lo:hi], lens) + step
        slot = np.repeat(self.run_dst_slot[lo:hi], lens)
        offset = np.repeat(self.run_dst_offset[lo:hi], lens) + step
        return src, slot, offset


@dataclass(frozen=True)
class Plans:
    """Everything one ``gen_plans`` call decided for one iteration.

    ``query_plans[i]`` and ``transfer_plans[i]`` describe the same sub-batch; batch ``b``
    runs on instances ``groups[b]`` (its DoP), sub-batch ``j`` of it on ``groups[b][j]``.
    ``(pool_id, epoch)`` identifies the iteration: ``pool_id`` is unique per
    :class:`~tokenlake.Pool` object and epochs are never reused, so a plan of another pool or
    of an earlier (committed or aborted) iteration never looks current.
    """

    epoch: int
    query_plans: tuple[QueryPlan, ...]
    transfer_plans: tuple[TransferPlan, ...]
    groups: tuple[tuple[int, ...], ...]
    pool_id: str = ""

    @property
    def origins(self) -> tuple[int, ...]:
        """The compute instances this iteration runs on (every sub-batch's origin)."""
        return tuple(i for group in self.groups for i in group)
