"""Hop-priced replication: a hot segment that small decodes read on another instance is
copied beside its main reader (``plan_replications(remote=...)``), checked against a plain
recount; without remote reads the orders are what they were."""

from __future__ import annotations

import numpy as np
import pytest
from harness import Harness, tokens

import tokenlake as tl
from tokenlake.cluster.balancer import BalancerConfig, heavy_hitters, plan_replications
from tokenlake.cluster.remote_reads import MIN_REMOTE_READS, RemoteReads

C = 16


def hot_pool(n: int, seed: int, config: BalancerConfig) -> Harness:
    """Documents read by several requests each, so the tree has heavy hitters."""
    h = Harness(n, C, num_slots=64, balancer=config)
    rng = np.random.default_rng(seed)
    docs = [tokens(10 * seed + d, C * int(rng.integers(1, 4))) for d in range(3)]
    for r in range(9):
        ids = np.concatenate([docs[r % 3], tokens(500 + r, 5)])
        h.step([[tl.Chunk(f"r{r}", ids, h.cached(ids))]])
        h.pool.finish(f"r{r}")
        h.pool.check_invariants()
    return h


def random_reads(pool: tl.Pool, n: int, seed: int) -> RemoteReads:
    rng = np.random.default_rng(100 + seed)
    remote = RemoteReads(n)
    keys = [node.key for node in pool.tree.nodes() if node.idx >= 0]
    for _ in range(int(rng.integers(1, 12))):
        chosen = [k for k in keys if rng.random() < 0.5]
        remote.record(chosen, int(rng.integers(0, n)))
    return remote


def expected_orders(pool: tl.Pool, remote: RemoteReads, budget: int) -> list[tuple[int, int]]:
    """Most accessed first: a copy on the instance that read it remotely most (ties: the
    lowest id), if it read it often enough and holds none; at most ``budget``."""
    out = []
    k = pool.balancer.num_heavy_hitters(len(pool.placement.live))
    for node in heavy_hitters(pool.tree, k):
        counts = remote.counts.get(node.key)
        if counts is None:
            continue
        reader = int(np.flatnonzero(counts == counts.max())[0])
        holds = {loc.instance_id for loc in node.replicas}
        if counts[reader] / remote.scale >= MIN_REMOTE_READS and reader not in holds:
            out.append((node.key, reader))
    return out[:budget]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("budget", [2, 32])
def test_copies_go_beside_the_main_remote_reader(seed, budget):
    n = 2 + seed % 3
    config = BalancerConfig(overload_factor=1e6, max_replications=budget, hop_bytes=1e6)
    h = hot_pool(n, seed, config)
    pool = h.pool
    live = list(pool.placement.live)
    remote = random_reads(pool, n, seed)
    orders = plan_replications(pool.tree, pool.access, live, config, remote=remote)
    assert [(o.node.key, o.destination) for o in orders] == expected_orders(pool, remote, budget)
    for o in orders:
        assert o.source in o.node.replicas
    # no remote reads, nothing overloaded: no orders, as before
    assert plan_replications(pool.tree, pool.access, live, config) == []
    assert plan_replications(pool.tree, pool.access, live, config, remote=RemoteReads(n)) == []
    pool.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_never_to_an_overloaded_reader_and_unchanged_without_reads(seed):
    n = 2 + seed % 3
    config = BalancerConfig(overload_factor=1.0, max_replications=32, hop_bytes=1e6)
    h = hot_pool(n, seed, config)
    pool = h.pool
    live = list(pool.placement.live)
    load = pool.access.window_load
    hot = {i for i in live if load[i] > load[live].mean()}
    base = plan_replications(pool.tree, pool.access, live, config)
    same = plan_replications(pool.tree, pool.access, live, config, remote=RemoteReads(n))
    assert [(o.node.key, o.destination) for o in same] == [
        (o.node.key, o.destination) for o in base
    ]
    remote = random_reads(pool, n, seed)
    orders = plan_replications(pool.tree, pool.access, live, config, remote=remote)
    assert [(o.node.key, o.destination) for o in orders[: len(base)]] == [
        (o.node.key, o.destination) for o in base
    ]  # the load-driven orders first, then the hop-driven ones
    for o in orders[len(base) :]:
        assert o.destination not in hot
        assert o.destination not in {loc.instance_id for loc in o.node.replicas}


def test_decodes_reading_remotely_get_a_copy_beside_them():
    """Through the pool: readers of a document decode one at a time, more of them running
    than there are instances (so load counts); once the document's instance is overloaded
    their segments go elsewhere, their decodes read the document remotely, and copies
    follow them; attention stays exact."""
    h = Harness(3, C, num_slots=48, balancer=BalancerConfig(hop_bytes=1e6))
    doc = tokens(1, 4 * C)
    errs = []
    for i in range(16):
        ids = np.concatenate([doc, tokens(100 + i, 20)])
        errs.append(h.step([[tl.Chunk(f"r{i}", ids, h.cached(ids))]]))
        for k in range(3):
            ids = np.append(ids, k).astype(np.int32)
            errs.append(h.step([[tl.Chunk(f"r{i}", ids, len(ids) - 1)]]))
            h.pool.check_invariants()
        if i >= 3:
            h.pool.finish(f"r{i - 3}")
    assert max(errs) <= h.tolerance
    remote = h.pool.iterations.remote
    assert remote is not None and remote.counts
    doc_nodes = [n for n in h.pool.tree.nodes() if n.idx >= 0 and n.key in remote.counts]
    assert any(
        remote.top_reader(n.key)[0] in {loc.instance_id for loc in n.replicas} for n in doc_nodes
    )


def test_remote_reads_decay_and_bound():
    remote = RemoteReads(3, decay=0.5, max_keys=4)
    remote.record([7, 8], 2)
    remote.record([7], 1)  # the earlier read of 7 on 2 has halved
    assert remote.top_reader(7) == (1, 1.0)
    assert remote.top_reader(8) == (2, 0.5)
    assert remote.top_reader(9) == (-1, 0.0)
    remote.record([9], 0)
    remote.record([9], 2)
    assert remote.top_reader(9) == (2, 1.0)  # the recent read outweighs the older one
    for _ in range(400):  # the scale renormalises instead of overflowing
        remote.record([1, 2, 3], 0)
    assert remote.scale <= 1e100 and remote.top_reader(1)[1] == pytest.approx(2.0)
    assert len(remote.counts) <= 4 and set(remote.counts) >= {1, 2}
