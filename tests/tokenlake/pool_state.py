"""A pool's whole observable state as plain data, to compare before and after a call that
must change nothing (a rejected call, an abort before execution)."""

from __future__ import annotations

import numpy as np

import tokenlake as tl


def pool_state(pool: tl.Pool) -> dict:
    """Every node (key, parent, tokens, replicas, pins, readers, access count, eviction class,
    host-tier block and whether it is complete), the host tier's order, blocks used and loads,
    the eviction policy's protected count and ghosts, the replica
    LRU order, every request, every allocator's free slots, the balancer's load state, the
    iterations in flight and ``get_stats()``."""
    tree = pool.tree
    table = tree.table
    nodes = sorted(
        (
            n.key,
            n.parent.key,
            n.tokens.tobytes(),
            tuple(n.replicas),
            n.pin_count,
            int(table.readers[n.idx]),
            float(table.access[n.idx]) / pool.access.scale,
            n.protected,
            n.tier_block,
            bool(table.tier_ready[n.idx]),
        )
        for n in tree.nodes()
    )
    requests = sorted(
        (
            repr(rid),
            s.num_tokens,
            tuple(n.key for n in s.nodes),
            s.num_private,
            s.detached,
            None if s.open is None else (s.open.location, s.open.tokens.tobytes()),
        )
        for rid, s in pool.requests.items()
    )
    access = pool.access
    return {
        "nodes": nodes,
        "lru": tree.lru_order(),
        "clock": tree.clock,
        "epoch": pool.inflight.last_epoch,  # a refused gen_plans must not use up an epoch
        "requests": requests,
        "free_slots": [sorted(a.free_slots()) for a in pool.allocators],
        "live": pool.live_instances,
        "in_flight": pool.active_epochs,
        "window": access.window_load.tolist(),
        "recent_load": access.recent_load.tolist(),
        "scale": access.scale,
        "total_access": access.total_access_tokens,
        "stats": pool.get_stats(),
        "eviction": (tree.policy.num_protected, list(tree.policy.ghosts)),
        "tier": (list(tree.tier.lru.items()), tree.tier.num_used, dict(tree.tier.loading)),
    }


def assert_same_state(before: dict, after: dict, ignore: tuple[str, ...] = ()) -> None:
    for key in before:
        if key in ignore:
            continue
        a, b = before[key], after[key]
        if isinstance(a, np.ndarray):
            assert np.array_equal(a, b), key
        elif a != b:
            if isinstance(a, list) and isinstance(b, list):
                gone = [x for x in a if x not in b][:3]
                new = [x for x in b if x not in a][:3]
                raise AssertionError(f"{key} changed: before only {gone}; after only {new}")
            raise AssertionError(f"{key} changed: {a!r} -> {b!r}")


def assert_restored(before: dict, after: dict) -> None:
    """An abort before execution restores everything but the epoch counter: epochs are
    never reused, so the aborted plans can never look current again."""
    assert after["epoch"] > before["epoch"]
    assert_same_state(before, after, ignore=("epoch",))
