"""The C++ transfer grouping (``_C.plan_transfers``, csrc/transfer_plan.h) behind
``PlanBuilder._transfer_plans`` against the numpy implementation it replaced (kept here as the
reference), on random runs and copies."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tokenlake import _C
from tokenlake.planning.builder import PlanBuilder, _PieceInfo
from tokenlake.tree.segment_table import SegmentTable


def per_group_indptr(starts, bounds, total):
    """Each group's offsets relative to its first element, end appended, concatenated."""
    ext = np.append(starts, total)
    out = []
    for g in range(len(bounds) - 1):
        lo, hi = bounds[g], bounds[g + 1]
        out += (ext[lo : hi + 1] - ext[lo]).tolist()
    return np.asarray(out, dtype=np.int32)


def reference(num_instances, headers, runs, copies, heads):
    """Stable sort by (sub-batch, destination), then per-sub-batch slices (numpy)."""
    runs = runs[np.argsort(runs[:, 0] * num_instances + runs[:, 1], kind="stable")]
    n = len(runs)
    new_dst = np.ones(n, dtype=bool)
    new_dst[1:] = (runs[1:, 0] != runs[:-1, 0]) | (runs[1:, 1] != runs[:-1, 1])
    d_start = np.flatnonzero(new_dst)
    num = np.arange(len(headers) + 1)
    r_b = np.searchsorted(runs[:, 0], num).tolist()
    d_b = np.searchsorted(runs[d_start, 0], num).tolist()
    d_ptr = per_group_indptr(d_start, d_b, n)
    c = np.asarray(copies, dtype=np.int64).reshape(-1, 6)
    c = c[np.argsort(c[:, 0], kind="stable")]
    c_b = np.searchsorted(c[:, 0], num).tolist()
    rows = np.concatenate([[0], np.cumsum(heads.rows)]).tolist()
    fp = heads.first_piece
    out = []
    for u, head in enumerate(headers):
        r, d, k = slice(r_b[u], r_b[u + 1]), slice(d_b[u], d_b[u + 1]), slice(c_b[u], c_b[u + 1])
        out.append(
            dict(
                **head,
                num_rows=rows[fp[u + 1]] - rows[fp[u]],
                dst_ids=runs[d_start[d], 1],
                dst_indptr=d_ptr[d_b[u] + u : d_b[u + 1] + u + 1],
                run_src_row=runs[r, 2],
                run_len=runs[r, 3],
                run_dst_slot=runs[r, 4],
                run_dst_offset=runs[r, 5],
                copy_src_instance=c[k, 1],
                copy_src_slot=c[k, 2],
                copy_dst_instance=c[k, 3],
                copy_dst_slot=c[k, 4],
                copy_len=c[k, 5],
                **dict.fromkeys(TIER_FIELDS, np.zeros(0, dtype=np.int32)),  # no host-tier moves
            )
        )
    return out


TIER_FIELDS = ("demote_src_instance", "demote_src_slot", "demote_dst_block", "load_src_block",
               "load_dst_instance", "load_dst_slot")  # fmt: skip


@pytest.mark.parametrize("seed", range(60))
def test_transfer_plans_equal_the_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    n_inst, num_subs = int(rng.integers(1, 7)), int(rng.integers(1, 5))
    n, m = int(rng.integers(0, 40)), int(rng.integers(0, 6))
    runs = np.stack(
        [rng.integers(0, num_subs, n), rng.integers(0, n_inst, n)]
        + [rng.integers(0, 100, n) for _ in range(4)],
        axis=1,
    ).astype(np.int64)
    copies = [
        (int(rng.integers(num_subs)), int(rng.integers(n_inst)), int(rng.integers(50)),
         int(rng.integers(n_inst)), int(rng.integers(50)), int(rng.integers(1, 9)))
        for _ in range(m)
    ]  # fmt: skip
    piece_rows = rng.integers(1, 5, int(rng.integers(num_subs, 12)))
    first = np.sort(rng.choice(np.arange(1, len(piece_rows)), num_subs - 1, replace=False))
    fp = [0, *first.tolist(), len(piece_rows)]
    heads = _PieceInfo(fp, [], piece_rows, piece_rows * 0, piece_rows * 0)
    headers = [dict(epoch=1, batch_index=0, sub_batch_index=u, origin=u % n_inst, request_ids=())
               for u in range(num_subs)]  # fmt: skip
    builder = PlanBuilder(SegmentTable(n_inst), 4, n_inst, 1.0, 1.0, 1.0)
    got = builder._transfer_plans(headers, runs, copies, heads)
    want = reference(n_inst, headers, runs, copies, heads)
    assert len(got) == len(want)
    for plan, expected in zip(got, want, strict=True):
        for f in dataclasses.fields(plan):
            value = getattr(plan, f.name)
            if isinstance(value, np.ndarray):
                assert value.dtype == np.int32 and not value.flags.writeable, f.name
                np.testing.assert_array_equal(value, expected[f.name], err_msg=f.name)
            else:
                assert value == expected[f.name], f.name


def test_plan_transfers_rejects_out_of_range_ids():
    runs = np.array([[0, 5, 0, 1, 0, 0]], dtype=np.int64)  # instance 5 of 2
    out = (np.empty((4, 1), np.int32), np.empty(1, np.int32), np.empty(2, np.int32),
           np.empty((5, 0), np.int32), np.empty(6, np.int64))  # fmt: skip
    with pytest.raises(ValueError, match="out of range"):
        _C.plan_transfers(1, 2, runs, np.zeros((0, 6), np.int64), *out)
