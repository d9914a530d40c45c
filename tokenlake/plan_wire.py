"""Plans on the wire: the versioned encoding of :class:`Plans` (and its query and transfer
plans, and chunks) for compute processes, and the range checks a receiver applies against
its own geometry before it touches anything.

    data = encode(plans)                                   # bytes, no pickle
    plans = decode(data, PlanLimits(num_instances, num_slots, segment_len))

Every plan field is encoded generically (a field the control plane adds travels too);
decoding rejects unknown versions, types and fields, wrong array kinds and lengths, and ids,
slots, offsets and lengths out of range, with :class:`~tokenlake.wire.WireError`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenlake.errors import InvalidArgumentError
from tokenlake.plans import Chunk, Plans, QueryPlan, TransferPlan
from tokenlake.wire import Codec, WireError

VERSION = 1
CODEC = Codec("plans", VERSION, (Plans, QueryPlan, TransferPlan, Chunk), max_bytes=1 << 28)


@dataclass(frozen=True)
class PlanLimits:
    """The receiver's geometry: ids below ``num_instances``, slots below ``num_slots``,
    token offsets within a segment of ``segment_len``, host-tier blocks below
    ``num_tier_blocks`` (``0``: no tier, so a plan that moves a segment to or from one is
    refused)."""

    num_instances: int
    num_slots: int
    segment_len: int
    num_tier_blocks: int = 0


def encode(obj: Plans | QueryPlan | TransferPlan | Chunk) -> bytes:
    return CODEC.encode(obj)


def decode(data: bytes, limits: PlanLimits, kind: type | None = None):
    """Decode and range-check one object (of ``kind`` when given)."""
    obj = CODEC.decode(data)
    if kind is not None and not isinstance(obj, kind):
        raise WireError(f"plans: expected a {kind.__name__}, got {type(obj).__name__}")
    try:
        check(obj, limits)
    except WireError:
        raise
    except InvalidArgumentError as e:
        raise WireError(str(e)) from None
    return obj


def check(obj: object, limits: PlanLimits) -> None:
    """Range-check a plan (or all of ``Plans``) against ``limits``."""
    if isinstance(obj, Plans):
        for qp in obj.query_plans:
            check_query_plan("plans", qp, limits)
        for tp in obj.transfer_plans:
            check_transfer_plan("plans", tp, limits)
    elif isinstance(obj, QueryPlan):
        check_query_plan("query_plan", obj, limits)
    elif isinstance(obj, TransferPlan):
        check_transfer_plan("transfer_plan", obj, limits)


# ---- range checks (shared by plan decoding, engine clients and engine messages) -----------
def _fail(name: str, what: str) -> None:
    raise InvalidArgumentError(f"{name}: {what}")


def check_array(name: str, arr: object, length: int | None = None) -> np.ndarray:
    """A 1-D int32 array (of ``length`` entries when given)."""
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype != np.int32:
        got = (
            f"{arr.dtype} {list(arr.shape)}" if isinstance(arr, np.ndarray) else type(arr).__name__
        )
        _fail(name, f"expected a 1-D int32 array, got {got}")
    if length is not None and len(arr) != length:
        _fail(name, f"expected {length} entries, got {len(arr)}")
    return arr


def check_values(name: str, arr: np.ndarray, low: int, high: int) -> None:
    """Every entry in ``[low, high)``."""
    if len(arr) and (int(arr.min()) < low or int(arr.max()) >= high):
        bad = int(arr.min()) if int(arr.min()) < low else int(arr.max())
        _fail(name, f"value {bad} out of range; allowed {low}..{high - 1}")


def check_indptr(name: str, arr: object, num_items: int, total: int) -> np.ndarray:
    """CSR offsets: ``num_items + 1`` entries from 0, non-decreasing, ending at ``total``."""
    arr = check_array(name, arr, num_items + 1)
    if int(arr[0]) != 0 or int(arr[-1]) != total or (num_items and np.any(np.diff(arr) < 0)):
        _fail(name, f"expected offsets 0..{total}, non-decreasing; got {arr[:8].tolist()}...")
    return arr


def check_id(name: str, value: object, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < high:
        _fail(name, f"expected an int in 0..{high - 1}, got {value!r}")
    return value


def check_query_plan(name: str, qp: QueryPlan, lim: PlanLimits) -> None:
    n, s, c = lim.num_instances, lim.num_slots, lim.segment_len
    check_id(f"{name}.origin", qp.origin, n)
    for field in ("epoch", "batch_index", "sub_batch_index"):
        check_id(f"{name}.{field}", getattr(qp, field), 1 << 62)
    r = len(qp.request_ids)
    rows = int(check_array(f"{name}.q_indptr", qp.q_indptr, r + 1)[-1]) if r + 1 else 0
    check_indptr(f"{name}.q_indptr", qp.q_indptr, r, rows)
    check_values(f"{name}.positions", check_array(f"{name}.positions", qp.positions, r), 0, 1 << 31)
    check_values(
        f"{name}.prefix_lens", check_array(f"{name}.prefix_lens", qp.prefix_lens, r), 0, 1 << 31
    )
    holders = check_array(f"{name}.holder_ids", qp.holder_ids)
    check_values(f"{name}.holder_ids", holders, 0, n)
    if len(np.unique(holders)) != len(holders):
        _fail(f"{name}.holder_ids", f"expected distinct instances, got {holders.tolist()}")
    entries = check_array(f"{name}.entry_req", qp.entry_req)
    check_values(f"{name}.entry_req", entries, 0, max(r, 1) if r else 0)
    check_indptr(f"{name}.holder_indptr", qp.holder_indptr, len(holders), len(entries))
    indices = check_array(f"{name}.kv_indices", qp.kv_indices)
    check_indptr(f"{name}.kv_indptr", qp.kv_indptr, len(entries), len(indices))
    check_values(f"{name}.kv_indices", indices, 0, s)
    last = check_array(f"{name}.last_len", qp.last_len, len(entries))
    check_values(f"{name}.last_len", last, 1, c + 1)


def check_transfer_plan(name: str, tp: TransferPlan, lim: PlanLimits) -> None:
    n, s, c = lim.num_instances, lim.num_slots, lim.segment_len
    check_id(f"{name}.origin", tp.origin, n)
    for field in ("epoch", "batch_index", "sub_batch_index", "num_rows"):
        check_id(f"{name}.{field}", getattr(tp, field), 1 << 31)
    dsts = check_array(f"{name}.dst_ids", tp.dst_ids)
    check_values(f"{name}.dst_ids", dsts, 0, n)
    if len(np.unique(dsts)) != len(dsts):
        _fail(f"{name}.dst_ids", f"expected distinct instances, got {dsts.tolist()}")
    k = len(check_array(f"{name}.run_len", tp.run_len))
    check_indptr(f"{name}.dst_indptr", tp.dst_indptr, len(dsts), k)
    check_runs(
        name, tp.run_src_row, tp.run_len, tp.run_dst_slot, tp.run_dst_offset, tp.num_rows, lim
    )
    m = len(check_array(f"{name}.copy_len", tp.copy_len))
    for field, high in (
        ("copy_src_instance", n),
        ("copy_dst_instance", n),
        ("copy_src_slot", s),
        ("copy_dst_slot", s),
    ):
        check_values(
            f"{name}.{field}", check_array(f"{name}.{field}", getattr(tp, field), m), 0, high
        )
    check_values(f"{name}.copy_len", tp.copy_len, 0, c + 1)
    check_tier_runs(name, tp, lim)


def check_tier_runs(name: str, tp: TransferPlan, lim: PlanLimits) -> None:
    """The host tier's runs: instances, slots and blocks in range; no block written twice
    or both written and read, no slot loaded twice. (A load may write a slot a demotion
    reads: the demotions run first.)"""
    n, s, b = lim.num_instances, lim.num_slots, lim.num_tier_blocks
    for prefix, fields in (
        ("demote", (("src_instance", n), ("src_slot", s), ("dst_block", b))),
        ("load", (("src_block", b), ("dst_instance", n), ("dst_slot", s))),
    ):
        last = f"{prefix}_{fields[-1][0]}"
        k = len(check_array(f"{name}.{last}", getattr(tp, last)))
        for field, high in fields:
            arr = check_array(f"{name}.{prefix}_{field}", getattr(tp, f"{prefix}_{field}"), k)
            if k and not high:
                _fail(f"{name}.{prefix}_{field}", "the receiver has no host tier; expected no runs")
            check_values(f"{name}.{prefix}_{field}", arr, 0, high)
    written = tp.demote_dst_block.tolist()
    if len(set(written)) != len(written) or set(written) & set(tp.load_src_block.tolist()):
        _fail(f"{name}.demote_dst_block", f"expected distinct blocks no load reads, got {written}")
    loaded = list(zip(tp.load_dst_instance.tolist(), tp.load_dst_slot.tolist(), strict=True))
    if len(set(loaded)) != len(loaded):
        _fail(f"{name}.load_dst_slot", f"expected distinct slots, got {loaded}")


def check_runs(name, src_row, length, dst_slot, dst_offset, num_rows: int, lim: PlanLimits) -> None:
    """Put runs: rows ``src_row[i]:src_row[i]+length[i]`` within ``num_rows``, landing in slot
    ``dst_slot[i]`` at ``dst_offset[i]:dst_offset[i]+length[i]`` within a segment."""
    k = len(check_array(f"{name}.run_len", length))
    for field, arr in (
        ("run_src_row", src_row),
        ("run_dst_slot", dst_slot),
        ("run_dst_offset", dst_offset),
    ):
        check_array(f"{name}.{field}", arr, k)
    check_values(f"{name}.run_len", length, 1, lim.segment_len + 1)
    check_values(f"{name}.run_dst_slot", dst_slot, 0, lim.num_slots)
    check_values(f"{name}.run_src_row", src_row, 0, max(num_rows, 1))
    check_values(f"{name}.run_dst_offset", dst_offset, 0, lim.segment_len)
    ends = src_row.astype(np.int64) + length
    if k and int(ends.max()) > num_rows:
        _fail(f"{name}.run_len", f"a run ends at row {int(ends.max())}, past {num_rows} rows")
    tops = dst_offset.astype(np.int64) + length
    if k and int(tops.max()) > lim.segment_len:
        _fail(
            f"{name}.run_dst_offset",
            f"a run ends at token {int(tops.max())}, past {lim.segment_len}",
        )
