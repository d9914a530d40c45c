"""One copy of the KV: three SGLang worker processes, joined to a running host by name,
whose KV caches *are* their instances' slots (``one_copy.SlotKVPool`` views,
``SlotPageAllocator`` pages), sharing one pool with ``engine_slots=True``. Nothing is put: the
pool attends every prefix from bytes only SGLang wrote, so any disagreement between the two
layouts shows up as an error against SGLang's ``torch_native`` backend on the same full
sequences (fp32, max abs error <= 1e-5). Also: the storage identity, the memory against
SGLang alone, a page another worker reads held back from SGLang until it is unpinned,
cross-worker hits, a retract and a worker that dies."""

from __future__ import annotations

import pytest

sgl_world = pytest.importorskip("sgl_world", reason="sglang is not installed")
mp_world = pytest.importorskip("mp_world")

import torch  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402

from tokenlake.serve.metrics.collector import render  # noqa: E402
from tokenlake.serve.metrics.sglang import shared_pool_registry  # noqa: E402

TOL = sgl_world.TOLERANCE
tokens = sgl_world.tokens
NUM_WORKERS, SEG, NUM_SLOTS = 3, 8, 48
L, H_Q, H_KV, D = 2, 4, 2, 16
WORLD = dict(num_q_heads=H_Q, num_kv_heads=H_KV, head_dim=D, num_layers=L, seed=7)


@pytest.fixture(scope="module")
def shared():
    """The host in this process with its buffers in named shared memory; the workers join
    knowing only the service's endpoint, the secret's file and their instance id, as
    separate SGLang servers would."""
    with mp_world.shared_pool(
        WORLD, NUM_WORKERS, NUM_SLOTS, SEG, one_copy=True, join=True
    ) as world:
        yield world


def test_sglang_kv_cache_is_the_instance_slots(shared) -> None:
    pool, cluster, service, w = shared
    layer_bytes = NUM_SLOTS * 2 * SEG * H_KV * D * 4
    # what SGLang alone allocates for the same usable capacity: (S - 1) pages of C tokens
    # (its page 0 is padding, as the pool's slot 0 is here)
    alone = MHATokenToKVPool((NUM_SLOTS - 1) * SEG, SEG, torch.float32, H_KV, D, L, "cpu", False)
    alone_bytes = sum(b.nbytes for b in alone.k_buffer + alone.v_buffer)
    for i in range(NUM_WORKERS):
        st = w.call(i, "kv_storage")
        assert st["same_storage"], f"worker {i}: SGLang's KV buffers are not the slots' bytes"
        assert st["k_ptrs"] == [layer * layer_bytes for layer in range(L)]
        assert st["v_ptrs"] == [layer * layer_bytes + SEG * H_KV * D * 4 for layer in range(L)]
        assert st["instance_bytes"] == alone_bytes  # one copy: 1.00x SGLang alone
        assert st["available_tokens"] == (NUM_SLOTS - 1) * SEG


def test_prefixes_are_attended_where_sglang_wrote_them(shared) -> None:
    pool, cluster, service, w = shared
    doc = tokens(1, 45)
    a = doc + tokens(2, 6)
    w.call(0, "add", rid="a", tokens=a + tokens(3, 8))
    assert w.call(0, "step", work={"a": len(a)}) <= TOL  # extend on worker 0
    for _ in range(2):
        assert w.call(0, "step", work={"a": 1}) <= TOL  # decode
    # every segment the pool holds lives where worker 0's SGLang put it: its own instance
    assert {loc.instance_id for n in pool.tree.nodes() for loc in n.replicas} == {0}
    before = w.call(1, "stats")
    b = doc + tokens(5, 30)
    assert w.call(1, "load_add", rid="b", tokens=b) == len(doc)
    assert w.call(1, "step", work={"b": 12}) <= TOL  # chunked prefill: first chunk
    assert w.call(1, "step", work={"b": 18}) <= TOL  # last chunk
    after = w.call(1, "stats")
    cross = after["cross_worker_hit_tokens"] - before.get("cross_worker_hit_tokens", 0)
    assert cross == len(doc) // SEG * SEG  # whole segments, read on worker 0
    # worker 2: a mixed batch, one request reusing worker 0's turn so far
    w.call(2, "add", rid="c", tokens=tokens(6, 20) + [1, 2, 3])
    assert w.call(2, "step", work={"c": 20}) <= TOL
    turn = w.call(0, "tokens", rid="a")
    d = turn + tokens(7, 9)
    n = w.call(2, "load_add", rid="d", tokens=d)
    assert w.call(2, "step", work={"c": 1, "d": len(d) - n}, mode="mixed") <= TOL
    for i, rid in ((0, "a"), (1, "b"), (2, "d")):
        assert w.call(i, "step", work={rid: 1}) <= TOL
    # worker 0's SGLang frees a's pages while b and d still read them: held back
    free0 = w.call(0, "kv_storage")["available_tokens"]
    w.call(0, "release", rid="a")
    held = pool.allocators[0].released_slots()
    assert held, "pages other workers read went back to SGLang"
    assert w.call(0, "kv_storage")["available_tokens"] < free0 + (len(a) + 2 + SEG - 1) // SEG * SEG
    # a retract on worker 1: SGLang frees the row and recomputes the request in a new one
    b_done = w.call(1, "tokens", rid="b")
    w.call(1, "release", rid="b")
    w.call(1, "add", rid="b2", tokens=b_done + [9])
    assert w.call(1, "step", work={"b2": len(b_done) + 1}) <= TOL
    w.call(2, "release", rid="d")
    w.call(2, "release", rid="c")
    w.call(2, "add", rid="e", tokens=tokens(9, 5))
    assert w.call(2, "step", work={"e": 5}) <= TOL  # worker 2's pool side finishes d and c
    w.call(1, "release", rid="b2")
    w.call(1, "add", rid="f", tokens=tokens(10, 5))
    assert w.call(1, "step", work={"f": 5}) <= TOL
    w.call(0, "add", rid="g", tokens=tokens(15, 3))
    assert w.call(0, "step", work={"g": 3}) <= TOL  # its commit brings a's pages back
    assert pool.allocators[0].released_slots() == []
    assert w.call(0, "kv_storage")["available_tokens"] == (NUM_SLOTS - 2) * SEG  # all but g's
    assert max(w.call(i, "max_err") for i in range(NUM_WORKERS)) <= TOL
    stats = w.call(0, "stats")
    assert (
        stats.get("local_hit_tokens", 0) + stats["cross_worker_hit_tokens"]
        == stats["num_hit_tokens"]
    )
    assert stats["cross_worker_hit_tokens"] > 0
    text = render(shared_pool_registry(service)).decode()
    assert (
        mp_world.metric_sample(text, "tokenlake:sglang_cross_worker_hit_tokens_total")
        == stats["cross_worker_hit_tokens"]
    )
    pool.check_invariants()


def test_a_worker_that_dies_is_dropped_and_the_others_go_on(shared) -> None:
    pool, cluster, service, w = shared
    doc = tokens(11, 40)
    w.call(2, "add", rid="x", tokens=doc + tokens(12, 4))
    assert w.call(2, "step", work={"x": 40}) <= TOL
    n = w.call(0, "load_add", rid="y", tokens=doc + tokens(13, 6))
    assert n == 40
    assert w.call(0, "step", work={"y": 6}) <= TOL  # reads worker 2's segments
    w.kill(2)
    mp_world.wait_lost(service, 2)
    assert 2 in service.lost and pool.live_instances == (0, 1)
    # worker 0 goes on: its prefix on instance 2 is gone, so the pool restarts y and
    # takes the lost segments from worker 0's own pages (the loaded copy), exact
    assert w.call(0, "step", work={"y": 1}) <= TOL
    assert w.call(0, "step", work={"y": 1}) <= TOL
    w.call(1, "add", rid="z", tokens=tokens(14, 12))
    assert w.call(1, "step", work={"z": 12}) <= TOL
    assert max(w.call(i, "max_err") for i in (0, 1)) <= TOL
    pool.check_invariants()
