"""Plans on the wire: every plan field round-trips bit for bit (fields added to the plan
classes travel too), and the whitelist decoder rejects unknown versions, types, fields,
array kinds and lengths, and ids, slots, offsets and lengths out of the receiver's range."""

from __future__ import annotations

import dataclasses
import pickle

import msgpack
import numpy as np
import pytest
from harness import tokens

import tokenlake as tl
from tokenlake import plan_wire
from tokenlake.plan_wire import PlanLimits
from tokenlake.wire import WireError

SHAPE = tl.ModelShape(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8)
LIMITS = PlanLimits(num_instances=3, num_slots=32, segment_len=16)


def _plans() -> tl.Plans:
    pool = tl.Pool(tl.PoolConfig(SHAPE, 3, num_slots=32, segment_len=16))
    doc = tokens(1, 16 * 3 + 5)
    first = pool.gen_plans([[tl.Chunk("a", doc, 0)]])
    pool.commit(first)
    pool.finish("a")
    ext = np.concatenate([doc, tokens(2, 20)])
    hit = pool.get_prefix_tree().match(ext).num_tokens
    return pool.gen_plans([[tl.Chunk("b", ext, hit)], [tl.Chunk(7, tokens(3, 40), 0)]], dops=[1, 2])


def _same(a, b) -> None:
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f.name
        elif isinstance(x, tuple) and x and dataclasses.is_dataclass(x[0]):
            for u, v in zip(x, y, strict=True):
                _same(u, v)
        else:
            assert x == y, f.name


def test_plans_round_trip_bit_for_bit():
    plans = _plans()
    assert any(tp.num_copies for tp in plans.transfer_plans)  # copy-on-extend travels too
    out = plan_wire.decode(plan_wire.encode(plans), LIMITS)
    _same(plans, out)
    assert out.query_plans[0].parts == () or out.query_plans[0].parts[0].rows.dtype == np.int32
    for qp in plans.query_plans:
        _same(qp, plan_wire.decode(plan_wire.encode(qp), LIMITS, tl.QueryPlan))
    chunk = tl.Chunk("c", tokens(4, 9), 3, 7)
    _same(chunk, plan_wire.decode(plan_wire.encode(chunk), LIMITS, tl.Chunk))


def _payload(obj) -> dict:
    return msgpack.unpackb(plan_wire.encode(obj), raw=False)


def _rejects(payload: dict, match: str, limits: PlanLimits = LIMITS) -> None:
    with pytest.raises(WireError, match=match):
        plan_wire.decode(msgpack.packb(payload, use_bin_type=True), limits)


def test_decoder_rejects_what_is_not_a_plan():
    qp = _plans().query_plans[0]
    good = _payload(qp)
    _rejects({**good, "v": 2}, "version")
    _rejects({**good, "t": "Pool"}, "unknown type")
    _rejects({**good, "f": {**good["f"], "evil": 1}}, "unknown fields")
    fields = dict(good["f"])
    del fields["origin"]
    _rejects({**good, "f": fields}, "origin: missing")
    _rejects({**good, "f": {**good["f"], "origin": True}}, "origin")
    _rejects({**good, "f": {**good["f"], "epoch": 1.5}}, "epoch")
    _rejects({**good, "f": {**good["f"], "kv_indices": [1, 2]}}, "kv_indices")
    ragged = msgpack.ExtType(1, b"\x00\x01\x02")
    _rejects({**good, "f": {**good["f"], "kv_indices": ragged}}, "ragged")
    for bad in (pickle.dumps(qp), b"\xc1", b"", msgpack.packb([1, 2])):
        with pytest.raises(WireError, match="plans"):
            plan_wire.decode(bad, LIMITS)
    with pytest.raises(WireError, match="QueryPlan"):
        plan_wire.decode(plan_wire.encode(qp), LIMITS, tl.TransferPlan)


def _i32(values) -> msgpack.ExtType:
    return msgpack.ExtType(1, np.asarray(values, dtype="<i4").tobytes())


def test_decoder_range_checks_against_the_receivers_geometry():
    plans = _plans()
    qp = next(q for q in plans.query_plans if len(q.kv_indices))
    tp = next(t for t in plans.transfer_plans if len(t.run_len))
    q, t = _payload(qp), _payload(tp)
    small = PlanLimits(num_instances=3, num_slots=int(qp.kv_indices.max()), segment_len=16)
    _rejects(q, "kv_indices", small)  # a slot this receiver does not have
    _rejects({**q, "f": {**q["f"], "origin": 3}}, "origin")
    _rejects({**q, "f": {**q["f"], "holder_ids": _i32([-1] * len(qp.holder_ids))}}, "holder_ids")
    last = qp.last_len.copy()
    last[0] = 17
    _rejects({**q, "f": {**q["f"], "last_len": _i32(last)}}, "last_len")
    ptr = qp.kv_indptr.copy()
    ptr[-1] += 1
    _rejects({**q, "f": {**q["f"], "kv_indptr": _i32(ptr)}}, "kv_indptr")
    slot = tp.run_dst_slot.copy()
    slot[0] = -1  # the negative index that once wrapped to another slot
    _rejects({**t, "f": {**t["f"], "run_dst_slot": _i32(slot)}}, "run_dst_slot")
    off = tp.run_dst_offset.copy()
    off[0] = 16 - int(tp.run_len[0]) + 1
    _rejects({**t, "f": {**t["f"], "run_dst_offset": _i32(off)}}, "run_dst_offset")
    _rejects({**t, "f": {**t["f"], "num_rows": int(tp.num_rows) - 1}}, "run_len|run_src_row")
    _rejects({**t, "f": {**t["f"], "copy_len": _i32([10**6] * tp.num_copies)}}, "copy_len")
