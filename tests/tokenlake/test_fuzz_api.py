"""A seeded fuzzer of the control-plane API: random calls against a pool (a workload of
new requests over shared documents, decodes, commits and aborts of overlapping iterations,
finishes, instance drops and restores) mixed with hostile values in every argument, and
hostile config constructions.

Figures (printed): calls, bad inputs accepted (must be 0), calls rejected, rejected calls
that changed the pool's state (must be 0: the whole state is compared before and after
each), crashes — any exception outside ``TokenLakeError`` or a broken invariant (must be 0).
``--fuzz-calls N`` (default 2,500) and ``--fuzz-seed S`` run a longer soak.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections import Counter
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from pool_state import pool_state

import tokenlake as tl
from tokenlake.cluster.balancer import BalancerConfig
from tokenlake.cluster.load_model import LoadModel
from tokenlake.cluster.profiles import A100_80G, LLAMA2_7B
from tokenlake.errors import TokenLakeError
from tokenlake.tree.policy import EvictionConfig

SEG = 8
SHAPE = tl.ModelShape(2, 4, 2, 8)

# values that are never a valid int argument (np.int64 is: it is not here)
NOT_INTS = [
    True, False, np.bool_(True), 1.0, 0.0, -0.0, 2.5, np.float64(1), np.float32(0), math.nan,
    math.inf, -math.inf, "1", b"1", None, [], [1], (1,), {}, {1}, object(), complex(1, 0),
    Fraction(1), Decimal(1), np.array(1), np.array([1]), range(1),
]  # fmt: skip
HUGE = [2**31, 2**32, 2**63, 2**64, -(2**63) - 1, 10**30, -1, -(2**31)]
NOT_SEQS = [None, 5, 1.5, "abc", b"ab", {1: 2}, {1, 2}, object(), np.zeros((2, 2)), iter([])]


class Fuzzer:
    def __init__(self, seed: int, eviction: str = "lru", num_tier_blocks: int = 0) -> None:
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.pool = tl.Pool(
            tl.PoolConfig(SHAPE, 4, 12, SEG, num_tier_blocks=num_tier_blocks),
            balancer=BalancerConfig(window=4, interval=2, overload_factor=1.0),
            load_model=LoadModel(A100_80G, LLAMA2_7B),
            seed=seed,
            eviction=EvictionConfig(eviction),
        )
        self.other_pool = tl.Pool(tl.PoolConfig(SHAPE, 4, 12, SEG))
        self.docs = [self.np_rng.integers(0, 500, SEG * k + 3).astype(np.int32) for k in (1, 2, 4)]
        self.tokens: dict = {}  # running request -> its known tokens
        self.inflight: list[tuple[tl.Plans, list[tl.Chunk]]] = []
        self.done_plans: list[tl.Plans] = []  # committed or aborted: stale for ever
        self.next_id = 0
        self.figures = Counter()
        self.failures: list[str] = []

    # ---- one call ----------------------------------------------------------------------------
    def call(self, name: str, fn, bad: bool) -> object:
        """Run ``fn``; ``bad`` says the arguments are invalid whatever the state."""
        self.figures["calls"] += 1
        before = pool_state(self.pool)
        try:
            result = fn()
        except TokenLakeError as exc:
            self.figures["rejected"] += 1
            self.figures[f"rejected {type(exc).__name__}"] += 1
            if pool_state(self.pool) != before:
                self.figures["rejected_changed_state"] += 1
                self.failures.append(f"{name}: rejected ({exc}) but changed the state")
            if not re.match(r"^[\w.\[\]/]+: ", str(exc)):
                self.failures.append(f"{name}: error names no argument: {exc}")
            return exc
        except Exception as exc:  # a crash: not one of ours
            self.figures["crashes"] += 1
            self.failures.append(f"{name}: crashed with {type(exc).__name__}: {exc}")
            return exc
        if bad:
            self.figures["accepted_bad"] += 1
            self.failures.append(f"{name}: accepted a bad input ({fn.__doc__ or ''}{_args(fn)})")
        self.figures["accepted"] += 1
        return result

    def check(self) -> None:
        try:
            self.pool.check_invariants()
        except AssertionError as exc:
            self.figures["crashes"] += 1
            self.failures.append(f"invariant broken: {exc}")

    # ---- value sources -----------------------------------------------------------------------
    def hostile_int(self) -> object:
        return self.rng.choice(NOT_INTS + HUGE)

    def hostile_seq(self) -> object:
        return self.rng.choice(NOT_SEQS)

    def valid_chunk(self) -> tl.Chunk | None:
        idle = [r for r in self.tokens if self.pool.in_flight_epoch(r) is None]
        if idle and self.rng.random() < 0.6:
            rid = self.rng.choice(idle)
            ids = self.tokens[rid]
            stored = self.pool.num_stored_tokens(rid)
            return tl.Chunk(rid, ids, stored, self.rng.randint(stored + 1, len(ids)))
        doc = self.rng.choice(self.docs)
        cut = self.rng.randint(1, len(doc))
        tail = self.np_rng.integers(0, 500, self.rng.randint(1, 12)).astype(np.int32)
        ids = np.concatenate([doc[:cut], tail])
        cached = min(self.pool.get_prefix_tree().match(ids).num_tokens, len(ids) - 1)
        rid = self.rng.choice([f"n{self.next_id}", self.next_id])
        self.next_id += 1
        return tl.Chunk(rid, ids, self.rng.choice([0, cached, cached - cached % SEG]))

    # ---- workload calls (valid arguments; the state may still refuse) ------------------------
    def gen_plans(self) -> None:
        chunks, seen = [], set()
        for _ in range(self.rng.randint(1, 4)):
            c = self.valid_chunk()
            if c.request_id not in seen:
                seen.add(c.request_id)
                chunks.append(c)
        num_batches = self.rng.randint(1, len(chunks))
        batches = [chunks[b::num_batches] for b in range(num_batches)]
        free = list(self.pool.free_instances)
        instances = None
        if free and self.rng.random() < 0.3:
            instances = [self.rng.sample(free, self.rng.randint(1, len(free))) for _ in batches]
        result = self.call(
            "gen_plans", lambda: self.pool.gen_plans(batches, None, None, instances), False
        )
        if isinstance(result, tl.Plans):
            self.inflight.append((result, chunks))
            for c in chunks:
                self.tokens.setdefault(c.request_id, c.token_ids)

    def settle(self) -> None:
        plans, chunks = self.inflight.pop(self.rng.randrange(len(self.inflight)))
        if self.rng.random() < 0.7:
            self.call("commit", lambda: self.pool.commit(plans), False)
            for c in chunks:  # a chunk that ended the known tokens produced one more
                if c.end == len(c.token_ids):
                    self.tokens[c.request_id] = np.append(c.token_ids, self.rng.randint(0, 499))
        else:
            executed = self.rng.random() < 0.5
            self.call("abort", lambda: self.pool.abort(plans, executed=executed), False)
            for rid in [r for r in self.tokens if r not in self.pool.requests]:
                del self.tokens[rid]
        self.done_plans.append(plans)

    def finish(self) -> None:
        rid = self.rng.choice(list(self.tokens))
        result = self.call("finish", lambda: self.pool.finish(rid), False)
        if result is None:
            del self.tokens[rid]

    def membership(self) -> None:
        dropped = sorted(set(range(4)) - set(self.pool.live_instances))
        if dropped and self.rng.random() < 0.6:
            self.call("restore_instance", lambda: self.pool.restore_instance(dropped[0]), False)
            return
        instance_id = self.rng.choice(self.pool.live_instances)
        failed = self.call("drop_instance", lambda: self.pool.drop_instance(instance_id), False)
        if isinstance(failed, list):
            for rid in failed:
                del self.tokens[rid]

    def reads(self) -> None:
        ids = self.rng.choice(self.docs)
        self.call("match", lambda: self.pool.get_prefix_tree().match(ids), False)
        self.call("get_stats", self.pool.get_stats, False)
        reqs = [(self.rng.randint(0, 5000), self.rng.randint(1, 500)) for _ in range(3)]
        self.call("get_cache_load", lambda: self.pool.get_cache_load(reqs), False)

    # ---- hostile calls (always invalid) -----------------------------------------------------
    def hostile(self) -> None:
        rng = self.rng
        pool = self.pool
        good = self.valid_chunk()
        kind = rng.randrange(16)
        if kind == 0:
            self.call("drop_instance", lambda: pool.drop_instance(self.hostile_int()), True)
        elif kind == 1:
            self.call("restore_instance", lambda: pool.restore_instance(self.hostile_int()), True)
        elif kind == 2:
            bad_id = rng.choice([True, 1.0, np.int64(0), None, [1], b"x", "", 2**63, "nobody", -7])
            fns = [pool.finish, pool.num_stored_tokens, pool.in_flight_epoch]
            if bad_id in ("nobody", -7):  # unknown: in_flight_epoch says None, not an error
                fns = fns[:2]
            fn = rng.choice(fns)
            self.call(fn.__name__, lambda: fn(bad_id), True)
        elif kind == 3:
            field = rng.choice(["request_id", "start", "end"])
            args = {"request_id": good.request_id, "token_ids": good.token_ids, "start": good.start}
            if field == "request_id":
                bad = [True, 1.5, np.float64(0), None, 2**63, [0], "", np.int64(3), b"x"]
            else:
                bad = [True, 1.5, np.float64(0), None, -5, 2**63, "x", [0], math.nan]
            args[field] = rng.choice(bad)
            self.call("Chunk", lambda: tl.Chunk(**args), True)
        elif kind == 4:
            bad_ids = rng.choice(
                [[1.5, 2], [True, 3], [-1], [2**31], "abc", np.array([0.5]), [[1]], None, []]
            )
            self.call("Chunk.token_ids", lambda: tl.Chunk("t", bad_ids, 0), True)
        elif kind == 5:
            self.call("gen_plans batches", lambda: pool.gen_plans(self.hostile_seq()), True)
        elif kind == 6:
            batch = [good, rng.choice(["x", 3, None, 1.5, object()])]
            self.call("gen_plans batch item", lambda: pool.gen_plans([batch]), True)
        elif kind == 7:
            not_none = [v for v in NOT_SEQS if v is not None]
            dops = rng.choice([[self.hostile_int()], rng.choice(not_none), [1, 1], []])
            self.call("gen_plans dops", lambda: pool.gen_plans([[good]], dops), True)
        elif kind == 8:
            not_none = [v for v in NOT_SEQS if v is not None]
            inst = rng.choice(
                [[[self.hostile_int()]], [rng.choice(not_none)], "0", [[0], [1]], [[0, 0]], [[]]]
            )
            self.call(
                "gen_plans instances", lambda: pool.gen_plans([[good]], None, None, inst), True
            )
        elif kind == 9:
            self.call("gen_plans twice", lambda: pool.gen_plans([[good], [good]]), True)
        elif kind == 10:
            tree = rng.choice([self.other_pool.get_prefix_tree(), "tree", 0])
            self.call("gen_plans tree", lambda: pool.gen_plans([[good]], None, tree), True)
        elif kind == 11:
            forged = self.forged_plans()
            fn = rng.choice([pool.commit, lambda p: pool.abort(p, executed=False)])
            self.call("commit/abort forged", lambda: fn(forged), True)
        elif kind == 12:
            if self.inflight:
                plans = rng.choice(self.inflight)[0]
                executed = rng.choice([1, 0, None, "yes", 1.0, np.float64(0)])
                self.call("abort executed", lambda: pool.abort(plans, executed=executed), True)
        elif kind == 13:
            bad = rng.choice(NOT_INTS + [-1, 2**40, 2**63])  # lengths are ints in [0, 2**40)
            reqs = rng.choice([[(bad, 1)], [(1, bad)], [(1,)], [(1, 2, 3)], self.hostile_seq()])
            self.call("get_cache_load", lambda: pool.get_cache_load(reqs), True)
        elif kind == 14:
            ids = rng.choice([[1.5], [True], "ab", None, np.zeros((2, 2), dtype=np.int32), [-3]])
            self.call("match", lambda: pool.get_prefix_tree().match(ids), True)
        else:
            self.hostile_config()

    def forged_plans(self) -> object:
        rng = self.rng
        choices = [object(), "plans", None, 7]
        if self.done_plans:
            choices.append(rng.choice(self.done_plans))  # committed or aborted: stale
        if self.inflight:
            live = rng.choice(self.inflight)[0]
            choices += [dataclasses.replace(live), dataclasses.replace(live, pool_id="forged")]
        plans = self.other_pool.gen_plans([[tl.Chunk("o", self.docs[0], 0)]])
        self.other_pool.abort(plans)
        choices.append(plans)
        return rng.choice(choices)

    def hostile_config(self) -> None:
        rng = self.rng
        which = rng.randrange(4)
        if which == 0:
            field = rng.choice(["num_layers", "num_q_heads", "num_kv_heads", "head_dim"])
            args = {"num_layers": 2, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 8}
            args[field] = rng.choice(NOT_INTS + HUGE + [0])
            self.call("ModelShape", lambda: tl.ModelShape(**args), True)
        elif which == 1:
            field = rng.choice(["num_instances", "num_slots", "segment_len", "namespace"])
            args = {"model": SHAPE, "num_instances": 2, "num_slots": 4, "segment_len": 8}
            if field == "namespace":
                args[field] = rng.choice(["", None, 0, b"ns", 1.5, "x" * 2000])
            else:
                args[field] = rng.choice(NOT_INTS + HUGE + [0])
            self.call("PoolConfig", lambda: tl.PoolConfig(**args), True)
        elif which == 2:
            field = rng.choice(
                ["window", "decay", "overload_factor", "heavy_hitter_k", "max_replications",
                 "interval", "replicate", "max_replica_fraction", "recent_decay"]
            )  # fmt: skip
            value = rng.choice(
                [math.nan, math.inf, -1, -0.5, 2**63, True, "1", None, 1.5, 0, np.float64("nan")]
            )
            valid = _balancer_accepts(field, value)
            self.call("BalancerConfig", lambda: BalancerConfig(**{field: value}), not valid)
        else:
            config = tl.PoolConfig(SHAPE, 2, 4, 8)
            kwargs = rng.choice(
                [{"config": "cfg"}, {"config": config, "seed": rng.choice([1.5, -1, True, 2**63])},
                 {"config": config, "hasher": 3}, {"config": config, "balancer": {}}]
            )  # fmt: skip
            self.call("Pool", lambda: tl.Pool(**kwargs), True)

    # ---- the run -----------------------------------------------------------------------------
    def run(self, num_calls: int) -> Counter:
        while self.figures["calls"] < num_calls:
            r = self.rng.random()
            if r < 0.30:
                self.hostile()
            elif r < 0.55 or not self.inflight:
                self.gen_plans()
            elif r < 0.80:
                self.settle()
            elif r < 0.88 and self.tokens:
                self.finish()
            elif r < 0.92:
                self.membership()
            else:
                self.reads()
            self.check()
        return self.figures


BALANCER_RANGES = {  # field: (low, high, low_open, high_open, int_only)
    "window": (1, 2**20, False, False, True),
    "max_replications": (0, 2**20, False, False, True),
    "interval": (1, 2**20, False, False, True),
    "decay": (0.0, 1.0, True, False, False),
    "overload_factor": (1.0, 1e6, False, False, False),
    "heavy_hitter_k": (0.0, 1e6, True, False, False),
    "max_replica_fraction": (0.0, 1.0, False, False, False),
    "recent_decay": (0.0, 1.0, False, True, False),
}


def _args(fn) -> str:
    """The values a lambda closed over, for failure messages."""
    cells = getattr(fn, "__closure__", None) or ()
    return repr([c.cell_contents for c in cells])[:300]


def _balancer_accepts(field: str, value: object) -> bool:
    """Whether ``BalancerConfig(**{field: value})`` is valid, by its documented ranges."""
    if field == "replicate":
        return isinstance(value, (bool, np.bool_))
    low, high, low_open, high_open, int_only = BALANCER_RANGES[field]
    if isinstance(value, (bool, np.bool_)):
        return False
    if int_only and not isinstance(value, (int, np.integer)):
        return False
    if not isinstance(value, (int, float, np.integer, np.floating)) or not math.isfinite(value):
        return False
    return (low < value if low_open else low <= value) and (
        value < high if high_open else value <= high
    )


def test_fuzz_the_api(request, capsys):
    num_calls = request.config.getoption("--fuzz-calls")
    seed = request.config.getoption("--fuzz-seed")
    fuzzer = Fuzzer(seed)
    figures = fuzzer.run(num_calls)
    line = (
        f"API fuzzer (seed {seed}): {figures['calls']} calls, {figures['accepted']} accepted, "
        f"{figures['rejected']} rejected, {figures['accepted_bad']} bad inputs accepted, "
        f"{figures['rejected_changed_state']} rejected calls changed state, "
        f"{figures['crashes']} crashes; rejections by type: "
        + ", ".join(f"{k.split()[1]} {v}" for k, v in sorted(figures.items()) if " " in k)
    )
    with capsys.disabled():
        print("\n" + line)
    assert not fuzzer.failures, "\n".join(fuzzer.failures[:20])
    assert figures["calls"] >= num_calls
    assert figures["accepted"] > num_calls // 5 and figures["rejected"] > num_calls // 5


@pytest.mark.parametrize("seed, eviction", [(1, "lru"), (3, "lru"), (0, "protect")])
def test_fuzz_more_seeds_and_eviction_policies(seed, eviction):
    """These seeds once dropped an instance while an in-flight iteration read a segment only
    that instance held: drop_instance failed half-way and lost a running request."""
    fuzzer = Fuzzer(seed, eviction)
    fuzzer.run(2500)
    assert not fuzzer.failures, "\n".join(fuzzer.failures[:20])


@pytest.mark.parametrize("seed, num_tier_blocks", [(5, 6), (6, 40)])
def test_fuzz_with_a_host_tier(seed, num_tier_blocks):
    """The same workload over a pool with a host tier below it (a small tier that evicts
    often, a large one that keeps every demoted segment): demotions, loads, tier evictions
    and their undo interleave with everything else; no invariant breaks."""
    fuzzer = Fuzzer(seed, "protect", num_tier_blocks)
    fuzzer.run(2500)
    assert not fuzzer.failures, "\n".join(fuzzer.failures[:20])
    stats = fuzzer.pool.get_stats()
    assert stats["tier_demotions"] > 0 and stats["tier_promotions"] > 0, stats
