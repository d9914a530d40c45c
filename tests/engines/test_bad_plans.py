"""Hand-built plans that address what the receiver does not have (a negative or too large
slot, a run past its segment or past the bound rows, an instance that is not served or is
lost): an engine client rejects each one up front with ``InvalidArgumentError`` naming the
field and its value, on both clusters, and no byte of any instance's pool changes (inside
one host the client writes copies and puts itself, with no engine in between). The valid
plan still runs exactly afterwards."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
from harness import Harness, tokens

import tokenlake as tl
from tokenlake.errors import InvalidArgumentError
from tokenlake.plans import frozen_i32

N, C, SLOTS = 3, 16, 64


def _digest(pools) -> str:
    h = hashlib.sha256()
    for pool in pools:
        h.update(pool.numpy().tobytes())
    return h.hexdigest()


def _planned(h: Harness):
    """Plans of an iteration whose transfer plan of origin 0 puts rows and copies a segment
    into another instance (a fork extending a partial tail)."""
    ids = tokens(7, 5 * C + 5)
    for k in range(N):  # some KV everywhere to protect
        assert h.step([[tl.Chunk(f"seed{k}", tokens(20 + k, 3 * C + 3), 0)]]) <= h.tolerance
    assert h.step([[tl.Chunk("r", ids, 0)]]) <= h.tolerance
    chunk = tl.Chunk("r", np.append(ids, [1, 2, 3]), len(ids))
    plans = h.pool.gen_plans([[chunk]])
    return plans, chunk


def _bad_transfers(tp, other: int) -> list[tuple[str, dict]]:
    """``(field named in the error, changes)`` of each bad variant of ``tp``."""
    one_copy = dict(
        copy_src_instance=frozen_i32([tp.origin]), copy_src_slot=frozen_i32([0]),
        copy_dst_instance=frozen_i32([other]), copy_dst_slot=frozen_i32([1]),
        copy_len=frozen_i32([C]),
    )  # fmt: skip

    def copy(**change):
        return {**one_copy, **{k: frozen_i32(v) for k, v in change.items()}}

    runs = len(tp.run_len)
    return [
        ("copy_dst_slot", copy(copy_dst_slot=[-1])),  # wrapped to the last slot before
        ("copy_dst_slot", copy(copy_dst_slot=[SLOTS])),
        ("copy_src_slot", copy(copy_src_slot=[-1])),
        ("copy_len", copy(copy_len=[C + 1])),
        ("copy_len", copy(copy_len=[-1])),
        ("copy_dst_instance", copy(copy_dst_instance=[N])),
        ("copy_dst_instance", copy(copy_dst_instance=[-1])),
        ("copy_src_instance", copy(copy_src_instance=[7])),
        ("copy_src_instance", {**copy(), "copy_len": frozen_i32([C, C])}),  # ragged columns
        ("run_dst_slot", {"run_dst_slot": frozen_i32([-1] * runs)}),
        ("run_dst_slot", {"run_dst_slot": frozen_i32([SLOTS] * runs)}),
        ("run_dst_offset", {"run_dst_offset": frozen_i32([C - 1] * runs),
                            "run_len": frozen_i32([2] * runs)}),
        ("run_len", {"run_src_row": frozen_i32([tp.num_rows - 1] * runs),
                     "run_len": frozen_i32([2] * runs)}),
        ("run_src_row", {"run_src_row": frozen_i32([-5] * runs)}),
        ("dst_ids", {"dst_ids": frozen_i32([N + 4] * len(tp.dst_ids))}),
    ]  # fmt: skip


def _check_rejected(h: Harness, pools) -> int:
    plans, chunk = _planned(h)
    k = next(i for i, tp in enumerate(plans.transfer_plans) if tp.num_rows)
    tp, qp = plans.transfer_plans[k], plans.query_plans[k]
    other = next(i for i in range(N) if i != tp.origin)
    client = h.cluster.engine(tp.origin)
    before = _digest(pools)
    cases = _bad_transfers(tp, other)
    for field, change in cases:
        bad = dataclasses.replace(tp, **change)
        with pytest.raises(InvalidArgumentError, match=f"transfer_plan.{field}") as e:
            client.init_transfer(bad)
        assert "allowed" in str(e.value) or "expected" in str(e.value) or "past" in str(e.value)
        assert _digest(pools) == before, f"{field}: {change} changed a pool"
    bad_q = dataclasses.replace(qp, kv_indices=frozen_i32([-1] * len(qp.kv_indices)))
    if len(qp.kv_indices):
        with pytest.raises(InvalidArgumentError, match="query_plan.kv_indices"):
            client.init_query(bad_q)
    assert _digest(pools) == before
    # nothing was bound: the valid plans of the same iteration run exactly
    assert h.execute(plans, [[chunk]]) <= h.tolerance
    h.pool.commit(plans)
    h.cluster.retire(plans.epoch)
    return len(cases)


def test_local_cluster_rejects_bad_plans_and_writes_nothing():
    h = Harness(N, C, SLOTS, backend="cpu")
    _check_rejected(h, [p.data for p in h.cluster.kv_pools])


def test_mp_cluster_rejects_bad_plans_and_writes_nothing(shared_cluster):
    h = shared_cluster.harness(N, C, SLOTS, backend="cpu")
    cluster = shared_cluster.cluster
    pools = [b.raw["pool"] for b in cluster.buffers]
    _check_rejected(h, pools)
    # a lost instance is not written to either
    victim = 2
    h.pool.drop_instance(victim)
    cluster.mark_lost(victim)
    empty = frozen_i32([])
    tp = tl.TransferPlan(
        10**6, 0, 0, 0, (), 0, empty, frozen_i32([0]), empty, empty, empty, empty,
        copy_src_instance=frozen_i32([0]), copy_src_slot=frozen_i32([0]),
        copy_dst_instance=frozen_i32([victim]), copy_dst_slot=frozen_i32([1]),
        copy_len=frozen_i32([C]),
    )  # fmt: skip
    before = _digest(pools)
    with pytest.raises(InvalidArgumentError, match="copy_dst_instance: instance 2 is lost"):
        cluster.engine(0).init_transfer(tp)
    assert _digest(pools) == before
