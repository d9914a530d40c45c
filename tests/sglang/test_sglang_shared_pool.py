"""One pool shared by three SGLang worker processes (``control_service`` +
``shared_runtime``): each worker a real SGLang world and one instance of the pool, its engines
co-processes sharing its buffers. Extend, decode, mixed and chunked prefill with prefixes
reused across workers, a retract, and a worker that dies; every output against SGLang's
``torch_native`` backend on the same full sequences (fp32, max abs error <= 1e-5)."""

from __future__ import annotations

import pytest

sgl_world = pytest.importorskip("sgl_world", reason="sglang is not installed")
mp_world = pytest.importorskip("mp_world")

from tokenlake.serve.metrics.collector import render  # noqa: E402
from tokenlake.serve.metrics.sglang import shared_pool_registry  # noqa: E402

TOL = sgl_world.TOLERANCE
tokens = sgl_world.tokens
NUM_WORKERS, SEGMENT_LEN, NUM_SLOTS = 3, 8, 160
WORLD = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, num_layers=2, kv_size=1024, seed=7)


@pytest.fixture(scope="module")
def shared():
    with mp_world.shared_pool(WORLD, NUM_WORKERS, NUM_SLOTS, SEGMENT_LEN) as world:
        yield world


def test_prefixes_are_reused_across_workers_exactly(shared) -> None:
    pool, cluster, service, w = shared
    doc = tokens(1, 45)
    a = doc + tokens(2, 6)
    w.call(0, "add", rid="a", tokens=a + tokens(3, 8))
    assert w.call(0, "step", work={"a": len(a)}) <= TOL  # extend on worker 0
    for _ in range(2):
        assert w.call(0, "step", work={"a": 1}) <= TOL  # decode
    before = w.call(1, "stats")
    # worker 1: a request on the same document; its SGLang cache has nothing, the pool has
    # worker 0's segments (wherever they were placed): the whole document is reused
    b = doc + tokens(5, 30)
    assert w.call(1, "load_add", rid="b", tokens=b) == len(doc)
    assert w.call(1, "step", work={"b": 12}) <= TOL  # chunked prefill: first chunk
    assert w.call(1, "step", work={"b": 18}) <= TOL  # last chunk
    after = w.call(1, "stats")
    assert after["num_hit_tokens"] == before["num_hit_tokens"] + len(doc)  # the pool's hits
    hits = sum(
        after.get(k, 0) - before.get(k, 0) for k in ("local_hit_tokens", "cross_worker_hit_tokens")
    )
    assert hits == len(doc)  # split by where the document's segments live
    assert after["cross_worker_hit_tokens"] > before.get("cross_worker_hit_tokens", 0)
    # worker 2: a mixed batch, one request reusing worker 0's whole turn so far
    w.call(2, "add", rid="c", tokens=tokens(6, 20) + [1, 2, 3])
    assert w.call(2, "step", work={"c": 20}) <= TOL
    turn = w.call(0, "tokens", rid="a")
    d = turn + tokens(7, 9)
    n = w.call(2, "load_add", rid="d", tokens=d)
    assert len(turn) - SEGMENT_LEN < n <= len(turn)  # a running request's open tail too
    assert w.call(2, "step", work={"c": 1, "d": len(d) - n}, mode="mixed") <= TOL
    # all three decode at once, each in its own forward and its own iteration in flight
    for i, rid in ((0, "a"), (1, "b"), (2, "d")):
        assert w.call(i, "step", work={rid: 1}) <= TOL
    # a retract on worker 1: SGLang frees the row and recomputes the request in a new one
    b_done = w.call(1, "tokens", rid="b")
    w.call(1, "release", rid="b")
    w.call(1, "add", rid="b", tokens=b_done + [9])
    assert w.call(1, "step", work={"b": len(b_done) + 1}) <= TOL
    # a prompt over the staging buffers' 256 rows is attended from worker 1's own cache
    w.call(1, "add", rid="long", tokens=tokens(8, 300) + [4])
    assert w.call(1, "step", work={"long": 300}) <= TOL
    assert w.call(1, "step", work={"long": 1}) <= TOL
    assert w.call(1, "num_local_forwards") == 2
    stats = w.call(0, "stats")
    assert stats["hit_rate"] > 0 and stats["cross_worker_hit_tokens"] > 0
    assert stats["local_hit_tokens"] + stats["cross_worker_hit_tokens"] == stats["num_hit_tokens"]
    assert max(w.call(i, "max_err") for i in range(NUM_WORKERS)) <= TOL
    pool_stats = pool.get_stats()
    assert pool_stats["num_hit_tokens"] == stats["num_hit_tokens"]
    # the same counters on /metrics of the process hosting the pool
    text = render(shared_pool_registry(service)).decode()
    cross = mp_world.metric_sample(text, "tokenlake:sglang_cross_worker_hit_tokens_total")
    assert cross == stats["cross_worker_hit_tokens"] > 0
    assert (
        mp_world.metric_sample(text, "tokenlake:pool_hit_tokens_total") == stats["num_hit_tokens"]
    )
    assert mp_world.metric_sample(text, "tokenlake:sglang_workers") == NUM_WORKERS


def test_a_worker_that_dies_is_dropped_and_the_others_go_on(shared) -> None:
    pool, cluster, service, w = shared
    doc = tokens(11, 64)
    w.call(2, "add", rid="x", tokens=doc + tokens(12, 4))
    assert w.call(2, "step", work={"x": 64}) <= TOL
    w.call(0, "add", rid="y", tokens=tokens(13, 30) + [5])
    assert w.call(0, "step", work={"y": 30}) <= TOL
    w.kill(2)
    mp_world.wait_lost(service, 2)
    assert 2 in service.lost and pool.live_instances == (0, 1)
    assert 2 in cluster.lost
    # the survivors go on: worker 0 decodes (its segments on instance 2 are gone: the pool
    # restarts the request and backfills from worker 0's own SGLang cache), worker 1 reuses
    # what is left of worker 2's document
    assert w.call(0, "step", work={"y": 1}) <= TOL
    n = w.call(1, "load_add", rid="z", tokens=doc + tokens(14, 10))
    assert 0 <= n <= 64
    assert w.call(1, "step", work={"z": 74 - n}) <= TOL
    assert w.call(1, "step", work={"z": 1}) <= TOL
    assert max(w.call(i, "max_err") for i in (0, 1)) <= TOL
    pool.check_invariants()
