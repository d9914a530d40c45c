"""A lost instance: its replicas vanish, requests that depended on it fail, the rest go on
exactly, and nothing is ever placed there again."""

from __future__ import annotations

import numpy as np
import pytest
from harness import Harness, tokens

import tokenlake as tl
from tokenlake.cluster.balancer import BalancerConfig
from tokenlake.errors import InvalidArgumentError, IterationStateError


def running_on(h: Harness, instance_id: int) -> set:
    out = set()
    for rid, state in h.pool.requests.items():
        locs = [n.replicas for n in state.nodes]
        if state.open is not None and state.open.location.instance_id == instance_id:
            out.add(rid)
        if any(all(r.instance_id == instance_id for r in reps) for reps in locs):
            out.add(rid)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_drop_instance_fails_dependents_and_survivors_stay_exact(seed):
    h = Harness(4, 16, num_slots=48, balancer=BalancerConfig(replicate=seed % 2 == 0))
    rng = np.random.default_rng(seed)
    shared = tokens(seed, 16 * 3)
    seqs = {}
    for i in range(6):
        ids = np.concatenate([shared, tokens(10 * seed + i, int(rng.integers(5, 40)))])
        seqs[f"r{i}"] = ids
        h.step([[tl.Chunk(f"r{i}", ids, h.cached(ids))]])
    h.pool.finish("r5")  # a finished request leaves a tail behind
    victim = int(rng.integers(4))
    expect_failed = running_on(h, victim)
    plans = h.pool.gen_plans([[tl.Chunk("r0", np.append(seqs["r0"], 1), len(seqs["r0"]))]])
    with pytest.raises(IterationStateError):
        h.pool.drop_instance(victim)
    h.pool.abort(plans)
    failed = set(h.pool.drop_instance(victim))
    h.pool.check_invariants()
    assert failed == expect_failed
    assert victim not in h.pool.live_instances
    for node in h.pool.tree.nodes():
        assert all(r.instance_id != victim for r in node.replicas)
    assert h.pool.allocators[victim].num_used == 0
    # survivors decode exactly; failed requests recompute from what is still cached
    batches = []
    for rid, ids in seqs.items():
        if rid == "r5":
            continue
        ids = np.append(ids, 7)
        start = len(ids) - 1 if rid not in failed else min(h.cached(ids), len(ids) - 1)
        batches.append([tl.Chunk(rid if rid not in failed else rid + "-again", ids, start)])
    err = 0.0
    for i in range(0, len(batches), 3):
        err = max(err, h.step(batches[i : i + 3]))
    assert err <= h.tolerance
    for qp, tp in zip(h.last_plans.query_plans, h.last_plans.transfer_plans, strict=True):
        assert qp.origin != victim and victim not in qp.holder_ids.tolist()
        assert victim not in tp.dst_ids.tolist()
    with pytest.raises(InvalidArgumentError, match="instance_id"):
        h.pool.drop_instance(victim)


def test_cannot_drop_the_last_instance():
    h = Harness(1, 16, num_slots=8)
    with pytest.raises(InvalidArgumentError, match="last"):
        h.pool.drop_instance(0)


def test_restore_instance_places_segments_there_again():
    h = Harness(3, 16, num_slots=32)
    h.step([[tl.Chunk("a", tokens(1, 40), 0)]])
    h.pool.finish("a")
    h.pool.drop_instance(1)
    with pytest.raises(InvalidArgumentError, match="instance_id"):
        h.pool.restore_instance(0)  # live
    with pytest.raises(InvalidArgumentError, match="instance_id"):
        h.pool.restore_instance(3)  # not part of the pool
    h.pool.restore_instance(1)
    h.pool.check_invariants()
    assert 1 in h.pool.live_instances
    for i in range(8):  # hash placement sends some new segments to the restored instance
        h.step([[tl.Chunk(f"b{i}", tokens(10 + i, 48), 0)]])
        h.pool.finish(f"b{i}")
    assert h.pool.allocators[1].num_used > 0
    h.pool.check_invariants()
