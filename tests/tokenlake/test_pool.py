"""Pool behaviour: dedup, multi-turn reuse, eviction under pressure, pins, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import Harness, tokens

import tokenlake as tl
from tokenlake.engines import kernels
from tokenlake.errors import (
    InvalidArgumentError,
    IterationStateError,
    PoolFullError,
    StalePlanError,
    UnknownRequestError,
)


def snapshot(h: Harness):
    """Everything observable about the pool's contents."""
    tree = h.pool.tree
    nodes = sorted(
        (n.key, n.pin_count, tuple(n.replicas), n.tokens.tobytes()) for n in tree.nodes()
    )
    reqs = sorted(
        (str(rid), s.num_tokens, tuple(n.key for n in s.nodes), s.open.location if s.open else None)
        for rid, s in h.pool.requests.items()
    )
    free = [sorted(a._free) for a in h.pool.allocators]
    data = [p.data.clone() for p in h.cluster.kv_pools]
    return nodes, reqs, free, data, h.pool.active_epoch


def assert_same(before, after):
    assert before[:3] == after[:3]
    assert before[4] == after[4]
    for x, y in zip(before[3], after[3], strict=True):
        assert torch.equal(x, y)


def test_dedup_across_requests_stores_once():
    h = Harness(2, 16, num_slots=32)
    doc = tokens(1, 64)
    h.step([[tl.Chunk("a", doc, 0)]])
    h.pool.finish("a")
    used = sum(a.num_used for a in h.pool.allocators)
    ids = np.concatenate([doc, tokens(2, 10)])
    assert h.cached(ids) == 64
    h.step([[tl.Chunk("b", ids, 64)]])
    # b added only its own 10-token tail; the 4 shared segments are not stored again
    assert sum(a.num_used for a in h.pool.allocators) == used + 1
    assert h.pool.get_stats()["hit_rate"] == pytest.approx(64 / (64 + 74))


def test_second_turn_reuses_partial_tail_in_place():
    h = Harness(4, 16, num_slots=32)
    turn1 = tokens(3, 16 * 2 + 9)
    h.step([[tl.Chunk("s1", turn1, 0)]])
    h.pool.finish("s1")
    tail = h.pool.tree.match(turn1).partial
    assert tail is not None and tail.num_tokens == 9 and tail.pin_count == 0
    turn2 = np.concatenate([turn1, tokens(4, 20)])
    assert h.cached(turn2) == len(turn1)
    err = h.step([[tl.Chunk("s2", turn2, len(turn1))]])
    assert err <= h.tolerance
    tp = h.last_plans.transfer_plans[0]
    assert list(tp.copy_len) == [9]
    assert tp.copy_src_instance[0] == tail.replicas[0].instance_id == tp.copy_dst_instance[0]
    # the extended segment sealed at an aligned boundary and is shareable
    assert h.pool.tree.match(turn2[:48]).num_tokens == 48


def test_eviction_under_pressure_keeps_pinned_segments():
    """Many requests through a small pool: LRU eviction happens, never of a running
    request's segments, and every query stays exact."""
    h = Harness(2, 16, num_slots=12)
    rng = np.random.default_rng(0)
    prompts = [tokens(100 + i % 5, 16 * 2) for i in range(5)]
    running: dict[str, np.ndarray] = {}
    for step in range(30):
        batches = []
        for rid in list(running)[:1]:
            ids = np.append(running[rid], step)
            batches.append([tl.Chunk(rid, ids, len(ids) - 1)])
            running[rid] = ids
        rid = f"r{step}"
        ids = np.concatenate([prompts[rng.integers(5)], tokens(step, int(rng.integers(1, 20)))])
        hit = min(h.cached(ids), len(ids) - 1)
        batches.append([tl.Chunk(rid, ids, hit)])
        running[rid] = ids
        pinned = {n.key for s in h.pool.requests.values() for n in s.tree_nodes}
        assert h.step(batches) <= h.tolerance
        assert pinned <= {n.key for n in h.pool.tree.nodes()}, "a pinned segment was evicted"
        if len(running) > 2:
            done = next(iter(running))
            h.pool.finish(done)
            del running[done]
            h.pool.check_invariants()
    assert h.pool.get_stats()["num_evictions"] > 0


def test_pool_full_of_pinned_data_raises_and_changes_nothing():
    h = Harness(2, 16, num_slots=2)
    h.step([[tl.Chunk("a", tokens(1, 16 * 3 + 1), 0)]])
    before = snapshot(h)
    with pytest.raises(PoolFullError):
        h.pool.gen_plans([[tl.Chunk("b", tokens(2, 40), 0)]])
    assert_same(before, snapshot(h))
    h.pool.check_invariants()


def test_abort_restores_everything():
    h = Harness(2, 16, num_slots=16)
    ids = tokens(1, 40)
    h.step([[tl.Chunk("a", ids, 0, 20)]])
    before = snapshot(h)
    plans = h.pool.gen_plans([[tl.Chunk("a", ids, 20)], [tl.Chunk("b", ids[:30], 16)]])
    h.pool.abort(plans)
    assert_same(before, snapshot(h))
    h.pool.check_invariants()
    assert h.step([[tl.Chunk("a", ids, 20)]]) <= h.tolerance


BAD_PLANS = [
    ("batches", lambda ids: ([],)),
    ("batches[0]", lambda ids: ([[]],)),
    ("batches[0]", lambda ids: ([["not a chunk"]],)),
    ("Chunk.start", lambda ids: ([[tl.Chunk("new", ids[::-1], 5)]],)),  # nothing cached
    ("Chunk.start", lambda ids: ([[tl.Chunk("a", ids, 3)]],)),  # a has 20 stored
    ("Chunk.end", lambda ids: ([[tl.Chunk("a", ids, 20, 20)]],)),
    ("twice", lambda ids: ([[tl.Chunk("a", ids, 20)], [tl.Chunk("a", ids, 20)]],)),
    ("dops", lambda ids: ([[tl.Chunk("a", ids, 20)]], [1, 1])),
    ("dops[0]", lambda ids: ([[tl.Chunk("a", ids, 20)]], [0])),
    ("dops", lambda ids: ([[tl.Chunk("a", ids, 20)], [tl.Chunk("b", ids, 0)]], [2, 1])),
]


@pytest.mark.parametrize("name,args", BAD_PLANS, ids=[b[0] for b in BAD_PLANS])
def test_bad_gen_plans_input_names_argument_and_changes_nothing(name, args):
    h = Harness(2, 16, num_slots=16)
    ids = tokens(1, 40)
    h.step([[tl.Chunk("a", ids, 0, 20)]])
    before = snapshot(h)
    with pytest.raises(InvalidArgumentError, match=name.replace("[", r"\[").replace("]", r"\]")):
        h.pool.gen_plans(*args(ids))
    assert_same(before, snapshot(h))
    h.pool.check_invariants()


def test_bad_data_plane_input_names_argument_and_changes_nothing():
    h = Harness(2, 16, num_slots=16)
    ids = tokens(1, 40)
    h.step([[tl.Chunk("a", ids, 0, 20)]])
    plans = h.pool.gen_plans([[tl.Chunk("a", ids, 20)]])
    qp, tp = plans.query_plans[0], plans.transfer_plans[0]
    engine = h.cluster.engine(qp.origin)
    other = h.cluster.engine(1 - qp.origin)
    q_buf, kv_buf = engine.init_query(qp), engine.init_transfer(tp)
    kv_buf.normal_()
    before = snapshot(h)
    cases = [
        ("query_plan", lambda: other.init_query(qp)),
        ("query_plan", lambda: engine.init_query("plan")),
        ("transfer_plan", lambda: other.init_transfer(tp)),
        ("q_buf", lambda: engine.query(q_buf.clone(), 0)),
        ("q_buf", lambda: engine.query(q_buf[:1], 0)),
        ("q_buf", lambda: engine.query(q_buf.to(torch.bfloat16), 0)),
        ("q_buf", lambda: engine.query(None, 0)),
        ("layer", lambda: engine.query(q_buf, 2)),
        ("layer", lambda: engine.query(q_buf, -1)),
        ("kv_buf", lambda: engine.put(torch.zeros(2, 21, 2, 2, 16), 0)),  # longer than planned
        ("kv_buf", lambda: engine.put(kv_buf[:, :5], 0)),
        ("layer", lambda: engine.put(kv_buf, 7)),
        ("instance_id", lambda: h.cluster.engine(5)),
    ]
    for name, call in cases:
        with pytest.raises(InvalidArgumentError, match=name):
            call()
        assert_same(before, snapshot(h))
    with pytest.raises(IterationStateError):
        h.pool.finish("a")
    other_plans = h.pool.gen_plans([[tl.Chunk("z", ids, 0)]])  # on the other, free instance
    assert set(other_plans.origins).isdisjoint(plans.origins)
    with pytest.raises(IterationStateError, match="free"):
        h.pool.gen_plans([[tl.Chunk("y", ids, 0)]])  # no instance left to run it
    h.pool.abort(other_plans, executed=False)
    h.pool.abort(plans)
    h.cluster.retire(plans.epoch)  # the control plane tells the data plane
    h.pool.check_invariants()
    # everything bound to the aborted iteration is now stale
    for call in (
        lambda: engine.query(q_buf, 0),
        lambda: engine.put(kv_buf, 0),
        lambda: engine.init_query(qp),
        lambda: h.pool.commit(plans),
    ):
        before = snapshot(h)
        with pytest.raises(StalePlanError):
            call()
        assert_same(before, snapshot(h))
    with pytest.raises(UnknownRequestError, match="request_id"):
        h.pool.finish("nobody")
    h.pool.check_invariants()


def test_kernel_rejects_wrong_device_dtype_shape():
    pool_layer = torch.zeros(4, 2, 16, 2, 8)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    good = dict(
        q=torch.zeros(3, 4, 8),
        q_indptr=i32(0, 3),
        pool_layer=pool_layer,
        kv_indptr=i32(0, 1),
        kv_indices=i32(2),
        last_len=i32(16),
    )
    bad = {
        "q": [
            torch.zeros(3, 4, 8, device="meta"),
            torch.zeros(3, 4, 8, dtype=torch.float64),
            torch.zeros(3, 3, 8),
        ],
        "kv_indptr": [torch.tensor([0, 1]), i32(0, 1, 1)],
        "last_len": [i32(16, 16)],
        "pool_layer": [torch.zeros(4, 3, 16, 2, 8)],
    }
    for name, values in bad.items():
        for value in values:
            with pytest.raises(InvalidArgumentError, match=name):
                kernels.partial_attention(**{**good, name: value}, backend="torch")
