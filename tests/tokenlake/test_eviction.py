"""Eviction policies (``tokenlake.tree.policy``) against a brute-force model of each.

Cyclic multi-turn sessions whose contexts add up to twice the pool: every session runs two
turns back to back (the second reuses the first's prompt), then the sessions take turns
round robin. Plain LRU evicts each context just before its session comes back; ``"protect"``
keeps the prefixes that were reused. The pool (real ``gen_plans``/``commit``/``finish``) must
agree request by request with a naive model that re-derives every decision by scanning all
cached segments, and the protect policy must hit more than LRU on the same requests.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from pool_state import assert_restored, pool_state
from test_concurrent_iterations import ConcurrentIterations

import tokenlake as tl
from tokenlake.cluster.balancer import BalancerConfig
from tokenlake.tree.policy import EvictionConfig, EvictionPolicy
from tokenlake.tree.prefix_tree import Location, PrefixTree

SEG = 4
NUM_INSTANCES = 2
NUM_SLOTS = 20  # per instance: 40 slots in the pool
SESSIONS, CONTEXT, TURNS = 10, 8, 6  # 10 contexts of 8 segments: 2x the pool


def uid(session: int, j: int) -> int:
    """Segment ``j`` of a session's sequence (context, then one question per turn)."""
    return 1 + session * 100 + j


def prompt(session: int, turn: int) -> list[int]:
    return [uid(session, j) for j in range(CONTEXT + turn)]


def schedule() -> list[tuple[int, int]]:
    warm = [(s, t) for s in range(SESSIONS) for t in (1, 2)]
    return warm + [(s, t) for t in range(3, TURNS + 1) for s in range(SESSIONS)]


class NaiveModel:
    """The policy re-derived by brute force over a set of cached segments (uids). Stamps come
    from one clock as in the tree; every choice is a min over all segments."""

    def __init__(self, policy: str, capacity: int, fraction: float = 0.8) -> None:
        self.protects = policy != "lru"
        self.protects_finished = policy == "session"
        self.capacity = capacity
        self.max_protected = int(fraction * capacity)
        self.parent: dict[int, int | None] = {}
        self.stamp: dict[int, int] = {}
        self.protected: set[int] = set()
        self.ghosts: list[int] = []  # oldest first
        self.clock = 0

    def _touch(self, path: list[int]) -> None:
        for u in reversed(path):  # ancestors end most recent
            self.clock += 1
            self.stamp[u] = self.clock

    def match(self, seq: list[int]) -> int:
        n = 0
        while n < len(seq) and seq[n] in self.stamp:
            n += 1
        return n

    def _victim(self, pinned: set[int]) -> int:
        leaves = [u for u in self.stamp if u not in pinned and u not in set(self.parent.values())]
        return min(leaves, key=lambda u: (u in self.protected, self.stamp[u]))

    def serve(self, seq: list[int]) -> int:
        hit = self.match(seq)
        path, new = seq[:hit], seq[hit:]
        victims = []
        for _ in range(max(0, len(self.stamp) + len(new) - self.capacity)):  # gen_plans
            u = self._victim(set(path))
            victims.append(u)
            del self.stamp[u], self.parent[u]
            self.protected.discard(u)
        self._touch(path)  # commit: the admitted prefix was read
        if self.protects:
            self._reused(path)
            for u in victims:
                if u in self.ghosts:
                    self.ghosts.remove(u)
                self.ghosts.append(u)
            del self.ghosts[: max(0, len(self.ghosts) - self.capacity)]
        for i, u in enumerate(new):  # sealed in order, each the most recent
            self.parent[u] = seq[hit + i - 1] if hit + i else None
            if self.protects and u in self.ghosts:
                self.ghosts.remove(u)
                if len(self.protected) < self.max_protected:
                    self.protected.add(u)
            self._touch([u])
        if self.protects_finished:  # finish: the context is protected too
            self._reused(seq)
        self._touch(seq)  # finish
        return hit

    def _reused(self, path: list[int]) -> None:
        """Protect ``path``, demoting the least recently used others beyond the cap."""
        self.protected.update(path)
        while len(self.protected) > self.max_protected and self.protected - set(path):
            u = min(self.protected - set(path), key=self.stamp.__getitem__)
            self.protected.discard(u)


def make_pool(policy: str) -> tl.Pool:
    shape = tl.ModelShape(1, 2, 1, 8, "float32")
    config = tl.PoolConfig(shape, NUM_INSTANCES, NUM_SLOTS, SEG)
    return tl.Pool(
        config, balancer=BalancerConfig(replicate=False), eviction=EvictionConfig(policy)
    )


def serve(pool: tl.Pool, rid: str, seq: list[int]) -> int:
    """One request through the pool: its whole prompt in one iteration, then finish; returns
    the cached segments it started from."""
    ids = np.repeat(np.asarray(seq, dtype=np.int32), SEG)
    start = pool.get_prefix_tree().match(ids).num_tokens
    assert start % SEG == 0
    pool.commit(pool.gen_plans([[tl.Chunk(rid, ids, start)]]))
    pool.finish(rid)
    pool.check_invariants()
    return start // SEG


def cached(pool: tl.Pool) -> tuple[set[int], set[int]]:
    nodes = list(pool.tree.nodes())
    return {int(n.tokens[0]) for n in nodes}, {int(n.tokens[0]) for n in nodes if n.protected}


def come_and_go() -> list[tuple[int, int]]:
    """Sessions that start one after another and end: three live at a time (their contexts
    fit the pool together), each with four turns, served round robin."""
    out, live = [], []
    for s in range(3 * SESSIONS):
        live.append([s, 0])
        for session in list(live):
            session[1] += 1
            out.append((session[0], session[1]))
            if session[1] == 4:
                live.remove(session)
    return out


def run(policy: str, turns: list[tuple[int, int]] | None = None) -> list[int]:
    pool = make_pool(policy)
    model = NaiveModel(policy, NUM_INSTANCES * NUM_SLOTS)
    hits = []
    for i, (s, t) in enumerate(schedule() if turns is None else turns):
        seq = prompt(s, t)
        got, want = serve(pool, f"r{i}", seq), model.serve(seq)
        assert got == want, f"request {i} (session {s}, turn {t}): pool hit {got}, model {want}"
        keys, protected = cached(pool)
        assert keys == set(model.stamp), f"request {i}: cached segments differ"
        assert protected == model.protected, f"request {i}: protected segments differ"
        hits.append(got)
    return hits


def test_protect_keeps_hitting_where_lru_thrashes_and_both_match_the_model():
    lru, protect = run("lru"), run("protect")
    rounds = len(schedule()) - 2 * SESSIONS  # the round-robin part
    lru_hits, protect_hits = sum(lru[-rounds:]), sum(protect[-rounds:])
    context_hits = rounds * CONTEXT
    # LRU thrashes: at twice the pool no context survives until its session's next turn
    assert lru_hits < 0.1 * context_hits
    assert protect_hits > lru_hits + 0.3 * context_hits
    assert sum(lru[: 2 * SESSIONS]) == sum(protect[: 2 * SESSIONS])  # same warm-up hits


def test_session_keeps_the_contexts_of_sessions_that_come_and_go():
    """Sessions that end leave protected contexts behind; under "protect" a new session's
    first context waits on probation and is evicted first. "session" protects it at finish
    and the cap demotes the ended sessions' contexts. On a strict cycle larger than the pool
    it is LRU. All three match the brute-force model."""
    turns = come_and_go()
    later = [i for i, (_, t) in enumerate(turns) if t > 1]
    hits = {p: run(p, turns) for p in ("lru", "protect", "session")}
    later_hits = {p: sum(h[i] for i in later) for p, h in hits.items()}
    assert later_hits["session"] > later_hits["protect"] + 0.3 * len(later) * CONTEXT
    assert later_hits["session"] >= later_hits["lru"]
    assert sum(run("session")) == sum(run("lru"))  # the strict cycle: as LRU


def policy_state(pool: tl.Pool) -> dict:
    policy = pool.tree.policy
    protected = sorted(n.key for n in pool.tree.nodes() if n.protected)
    return {"protected": protected, "count": policy.num_protected, "ghosts": list(policy.ghosts)}


@pytest.mark.parametrize("fresh_len", [20, 36])
def test_abort_restores_protected_classes_and_ghosts(fresh_len):
    """A fresh request evicts probation and protected segments (some of them last copies of
    their node); aborting before execution restores the pool, classes and ghosts included;
    aborting after execution keeps the victims evicted and remembers them as ghosts."""
    pool = make_pool("protect")
    for i, (s, t) in enumerate(schedule()[:26]):
        serve(pool, f"r{i}", prompt(s, t))
    before, policy_before = pool_state(pool), policy_state(pool)
    assert policy_before["protected"] and policy_before["ghosts"]
    ids = np.repeat(np.arange(5000, 5000 + fresh_len, dtype=np.int32), SEG)
    plans = pool.gen_plans([[tl.Chunk("fresh", ids, 0)]])
    (it,) = pool.iterations_in_flight()
    assert any(v.node.protected for v in it.victims), "the scenario must evict protected data"
    pool.check_invariants()
    pool.abort(plans, executed=False)
    pool.check_invariants()
    assert_restored(before, pool_state(pool))
    assert policy_state(pool) == policy_before
    plans = pool.gen_plans([[tl.Chunk("fresh", ids, 0)]])
    (it,) = pool.iterations_in_flight()
    gone = [v.node.key for v in it.victims if v.node.idx < 0]
    pool.abort(plans)  # executed: the victims stay evicted
    pool.check_invariants()
    assert gone and set(gone) <= set(pool.tree.policy.ghosts)


def small_tree(policy: str) -> tuple[PrefixTree, list]:
    """Three single-segment prefixes, oldest first; the newest (``c``) has a second copy."""
    tree = PrefixTree(SEG, tl.SegmentHasher("t"), 2, EvictionPolicy(EvictionConfig(policy), 8))
    nodes = [
        tree.insert(tree.root, np.full(SEG, i + 1, dtype=np.int32), Location(0, i)).node
        for i in range(3)
    ]
    tree.add_replica(nodes[2], Location(1, 0))
    return tree, nodes


def test_protect_evicts_probation_before_protected_copies_included():
    tree, (a, b, c) = small_tree("protect")
    assert tree.evict_lru()[0] is a  # nothing protected yet: plain LRU
    tree.mark_reused([c])  # a later request reused it: protected, both copies
    assert c.protected and tree.policy.num_protected == 1
    assert tree.evict_lru()[0] is b  # older probation first, although c has a spare copy
    node, loc = tree.evict_lru()  # only protected data is left: its copies go in LRU order
    assert node is c and len(c.replicas) == 1
    tree.check_invariants()


@pytest.mark.parametrize("bad", ["lfu", 3, None])
def test_config_rejects_unknown_policies(bad):
    with pytest.raises(tl.InvalidArgumentError, match="EvictionConfig.policy"):
        EvictionConfig(bad)


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0.5"])
def test_config_rejects_fractions_outside_0_1(bad):
    with pytest.raises(tl.InvalidArgumentError, match="protected_fraction"):
        EvictionConfig("protect", protected_fraction=bad)


class ProtectedIterations(ConcurrentIterations):
    """The concurrent-iterations state machine (overlapping iterations, partial executions,
    commits and aborts in any order, finishes, replication, drops) over a pool whose eviction
    protects reused prefixes: invariants, exactness and exact aborts hold as under LRU."""

    eviction = EvictionConfig("protect", protected_fraction=0.3)


TestProtectedIterations = ProtectedIterations.TestCase
TestProtectedIterations.settings = settings(ConcurrentIterations.TestCase.settings, max_examples=20)
