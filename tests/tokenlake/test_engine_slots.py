"""Engine-allocated slots (``Pool(engine_slots=True)``, one copy of the KV): the engines pick
every page and write it in place; the pool records where, puts nothing, and lets a page go
back to its engine only when nothing reads it.

The reference is a naive model of each engine: which pages it holds, which it has free, and
what tokens it wrote in each. After every step, every segment the pool can hand out must sit
in a page its engine still holds, with exactly the segment's tokens in it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import tokenlake as tl

SEG = 4
SLOTS = 24


class Engine:
    """One instance's engine: its own page allocator (page 0 reserved, as SGLang's)."""

    def __init__(self, instance_id: int) -> None:
        self.instance_id = instance_id
        self.free = set(range(1, SLOTS))
        self.written: dict[int, tuple[int, ...]] = {}

    def alloc(self, rng: random.Random) -> int:
        slot = rng.choice(sorted(self.free))
        self.free.discard(slot)
        self.written[slot] = ()
        return slot

    def give_back(self, slots) -> None:
        for s in slots:
            assert s not in self.free, f"slot {s} handed back twice"
            self.free.add(s)
            self.written.pop(s, None)


class World:
    def __init__(self, seed: int, num_instances: int = 3) -> None:
        self.rng = random.Random(seed)
        shape = tl.ModelShape(1, 2, 1, 8, "float32")
        self.pool = tl.Pool(
            tl.PoolConfig(shape, num_instances, SLOTS, SEG), seed=seed, engine_slots=True
        )
        self.engines = [Engine(i) for i in range(num_instances)]
        self.docs = [[self.rng.randrange(1000) for _ in range(3 * SEG + 1)] for _ in range(3)]
        self.reqs: dict[str, dict] = {}  # rid -> {"tokens", "stored", "instance", "pages"}
        self.kept: list[tuple[int, int]] = []  # finished requests' pages an engine still caches
        self.next_id = 0

    def check(self) -> None:
        self.pool.check_invariants()
        for node in self.pool.tree.nodes():
            for loc in node.replicas:
                eng = self.engines[loc.instance_id]
                assert loc.slot_id not in eng.free, f"{node!r}: its page went back to the engine"
                assert eng.written[loc.slot_id][: len(node.tokens)] == tuple(node.tokens.tolist())

    def new_request(self) -> None:
        doc = self.rng.choice(self.docs)
        tokens = doc[: self.rng.randrange(SEG, len(doc) + 1)]
        tokens += [self.rng.randrange(1000) for _ in range(self.rng.randrange(1, 2 * SEG))]
        match = self.pool.get_prefix_tree().match(np.asarray(tokens, dtype=np.int32))
        start = min(match.num_tokens, len(tokens) - 1) // SEG * SEG  # a page boundary
        rid = f"r{self.next_id}"
        self.next_id += 1
        w = self.rng.randrange(len(self.engines))
        self.reqs[rid] = {"tokens": tokens, "stored": start, "instance": w, "pages": {}}

    def step(self, instance_id: int) -> None:
        """One iteration on ``instance_id``: each of its requests computes a few tokens."""
        mine = [r for r, s in self.reqs.items() if s["instance"] == instance_id]
        if not mine:
            return
        eng, chunks, slots = self.engines[instance_id], [], {}
        for rid in mine[:3]:
            s = self.reqs[rid]
            if rid not in self.pool.requests:  # new: what the pool holds now (may have shrunk)
                match = self.pool.get_prefix_tree().match(np.asarray(s["tokens"], np.int32))
                s["stored"] = min(s["stored"], match.num_tokens // SEG * SEG)
            if s["stored"] >= len(s["tokens"]):
                s["tokens"].append(self.rng.randrange(1000))  # a decode step
            end = min(len(s["tokens"]), s["stored"] + self.rng.randrange(1, 2 * SEG + 1))
            first_new = -(-s["stored"] // SEG)  # a partial segment continues the open tail
            starts = list(range(first_new, (end - 1) // SEG + 1))
            need = [k for k in starts if k not in s["pages"]]  # kept after an aborted step
            if len(need) > len(eng.free):
                continue
            s["pages"].update({k: eng.alloc(self.rng) for k in need})
            for pos in range(s["stored"], end):  # the engine writes in place, layer by layer
                page = s["pages"][pos // SEG]
                eng.written[page] += (s["tokens"][pos],)
            chunks.append(tl.Chunk(rid, np.asarray(s["tokens"], dtype=np.int32), s["stored"], end))
            slots[rid] = [s["pages"][k] for k in starts]
            s["end"] = end
        if not chunks:
            return
        plans = self.pool.gen_plans([chunks], instances=[[instance_id]], engine_slots=slots)
        for tp in plans.transfer_plans:
            assert len(tp.run_dst_slot) == 0 and len(tp.copy_dst_slot) == 0, "the pool put bytes"
        if self.rng.random() < 0.1:
            self.pool.abort(plans)
            for c in chunks:
                s = self.reqs[c.request_id]
                for pos in range(s["stored"], s["end"]):
                    page = s["pages"][pos // SEG]
                    eng.written[page] = eng.written[page][:-1]
            return
        self.pool.commit(plans)
        for c in chunks:
            self.reqs[c.request_id]["stored"] = self.reqs[c.request_id]["end"]

    def finish(self, rid: str) -> None:
        s = self.reqs.pop(rid)
        if self.pool.in_flight_epoch(rid) is None and rid in self.pool.requests:
            self.pool.finish(rid)
        eng = self.engines[s["instance"]]
        pages = sorted(s["pages"].values())
        if self.rng.random() < 0.5:  # the engine's own cache keeps them a while
            self.kept += [(s["instance"], p) for p in pages]
        else:
            eng.give_back(self.pool.release_slots(s["instance"], pages))

    def evict_kept(self) -> None:
        self.rng.shuffle(self.kept)
        cut = len(self.kept) // 2
        gone, self.kept = self.kept[:cut], self.kept[cut:]
        for w in range(len(self.engines)):
            pages = sorted(p for i, p in gone if i == w)
            if pages:
                self.engines[w].give_back(self.pool.release_slots(w, pages))

    def reclaim(self) -> None:
        for w, eng in enumerate(self.engines):
            eng.give_back(self.pool.reclaim(w))


@pytest.mark.parametrize("seed", range(6))
def test_engine_slots_never_lose_a_page_the_pool_reads(seed):
    world = World(seed)
    for _ in range(160):
        roll = world.rng.random()
        if roll < 0.25 and len(world.reqs) < 8:
            world.new_request()
        elif roll < 0.75:
            world.step(world.rng.randrange(len(world.engines)))
        elif roll < 0.85 and world.reqs:
            world.finish(world.rng.choice(sorted(world.reqs)))
        elif roll < 0.95:
            world.evict_kept()
        else:
            world.reclaim()
        world.check()
    for rid in sorted(world.reqs):
        world.finish(rid)
    world.kept, gone = [], world.kept
    for w in range(len(world.engines)):
        pages = sorted(p for i, p in gone if i == w)
        world.engines[w].give_back(world.pool.release_slots(w, pages))
        world.engines[w].give_back(world.pool.reclaim(w))
    world.check()
    assert world.pool.tree.num_nodes == 0, "a segment outlived every page it was in"
    for eng in world.engines:
        assert eng.free == set(range(1, SLOTS)), "a page never came back to its engine"


def test_shared_prefix_is_read_from_the_writer_and_held_until_unpinned():
    world = World(0, num_instances=2)
    pool, doc = world.pool, world.docs[0][: 2 * SEG]
    world.reqs["a"] = {"tokens": doc + [7], "stored": 0, "instance": 0, "pages": {}}
    while world.reqs["a"]["stored"] < len(doc) + 1:
        world.step(0)
    # a request on instance 1 reuses instance 0's two segments
    match = pool.get_prefix_tree().match(np.asarray(doc + [9, 9], dtype=np.int32))
    assert match.num_tokens >= 2 * SEG
    world.reqs["b"] = {"tokens": doc + [9, 9], "stored": 2 * SEG, "instance": 1, "pages": {}}
    world.step(1)
    holders = {loc.instance_id for n in pool.requests["b"].tree_nodes for loc in n.replicas}
    assert holders == {0}, "the prefix was not read where it was written"
    # instance 0's engine gives its pages up while b still runs: none comes back yet
    pages_a = sorted(world.reqs["a"]["pages"].values())
    pool.finish("a")
    world.reqs.pop("a")
    back = pool.release_slots(0, pages_a)
    held = {loc.slot_id for n in pool.requests["b"].tree_nodes for loc in n.replicas}
    assert held and not held & set(back), "a page b reads went back to the engine"
    world.engines[0].give_back(back)
    world.check()
    pool.finish("b")
    world.reqs.pop("b")
    later = pool.reclaim(0)
    assert held <= set(later), "b's prefix pages did not come back once b finished"
    world.engines[0].give_back(later)
    world.check()


def test_engine_slots_bad_input_changes_nothing():
    shape = tl.ModelShape(1, 2, 1, 8, "float32")
    pool = tl.Pool(tl.PoolConfig(shape, 2, SLOTS, SEG), engine_slots=True)
    chunk = tl.Chunk("x", np.arange(2 * SEG, dtype=np.int32), 0)
    with pytest.raises(tl.InvalidArgumentError, match=r"engine_slots\['x'\]: expected 2 slots"):
        pool.gen_plans([[chunk]], instances=[[0]], engine_slots={"x": [3]})
    with pytest.raises(tl.InvalidArgumentError, match=r"instances\[0\]"):
        pool.gen_plans([[chunk]], engine_slots={"x": [3, 4]})
    with pytest.raises(tl.InvalidArgumentError, match=r"slots\[1\]"):
        pool.release_slots(0, [1, SLOTS])
    plain = tl.Pool(tl.PoolConfig(shape, 2, SLOTS, SEG))
    with pytest.raises(tl.InvalidArgumentError, match="engine_slots"):
        plain.gen_plans([[chunk]], engine_slots={"x": [3, 4]})
    with pytest.raises(tl.InvalidArgumentError, match="engine_slots"):
        plain.release_slots(0, [1])
    pool.check_invariants()
    assert pool.requests == {} and pool.tree.num_nodes == 0
    plans = pool.gen_plans([[chunk]], instances=[[1]], engine_slots={"x": [3, 5]})
    pool.commit(plans)
    locs = sorted((loc.instance_id, loc.slot_id) for n in pool.tree.nodes() for loc in n.replicas)
    assert locs == [(1, 3), (1, 5)]
