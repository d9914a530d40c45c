"""Per-layer doorbells (:mod:`tokenlake.engines.transport.doorbell`): inside one host a query's layer
reaches each holder as a few words in shared memory, not a message. Exact results, every
word checked by the holder against its own geometry, and a holder that never answers (dead
or stopped) gives the origin an error in bounded time, never a hang."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from engine_helpers import CONFIG, decode_batch, warm_up

import tokenlake as tl
from tokenlake.engines.dataplane_config import PeerFailedError, RemoteEngineError
from tokenlake.engines.transport import doorbell

WAIT_BOUND_S = 5.0  # far above any answer on an idle holder; far below the watchdog


def _area(num_instances: int = 3) -> doorbell.DoorbellArea:
    raw = torch.zeros(doorbell.nbytes(num_instances), dtype=torch.uint8)
    return doorbell.DoorbellArea(raw, num_instances)


class _Holder:
    """A fake query engine: records what it served, fails on layer 7."""

    def __init__(self) -> None:
        self.served: list[tuple[int, int, int]] = []
        self.errors: list[Exception] = []

    def serve(self, origin: int, binding: int, layer: int) -> None:
        if layer == 7:
            raise ValueError("layer: " + "x" * 1000)
        self.served.append((origin, binding, layer))


def test_each_ring_is_served_once_in_order_and_errors_come_back_truncated():
    area, holder = _area(), _Holder()
    server = doorbell.DoorbellServer(area, holder.serve, holder.errors.append)
    server.start()
    client = doorbell.DoorbellClient({0: area}, lambda h: True, WAIT_BOUND_S)
    expected = []
    for layer in range(5):
        tickets = [client.ring(0, origin, 40 + origin, layer) for origin in (1, 2)]
        client.wait(tickets, "test")
        expected += [(1, 41, layer), (2, 42, layer)]
    assert holder.served == expected  # each ring served exactly once
    with pytest.raises(RemoteEngineError, match="query engine 0: ValueError: layer: xxx") as e:
        client.wait([client.ring(0, 1, 41, 7)], "test")
    assert len(str(e.value)) < doorbell.ERROR_BYTES + 40  # the text is bounded
    assert len(holder.errors) == 1
    client.wait([client.ring(0, 1, 41, 3)], "test")  # the holder serves on after an error
    assert holder.served[-1] == (1, 41, 3)


def test_rebase_forgets_requests_rung_before_a_new_layout():
    area, holder = _area(), _Holder()
    client = doorbell.DoorbellClient({0: area}, lambda h: True, WAIT_BOUND_S)
    client.ring(0, 1, 5, 0)  # rung while no server runs (a previous engine's layout)
    server = doorbell.DoorbellServer(area, holder.serve, holder.errors.append)
    server.rebase()
    server.start()
    client.wait([client.ring(0, 2, 6, 1)], "test")
    assert holder.served == [(2, 6, 1)]


def test_a_dead_holder_fails_the_wait_fast_and_a_silent_one_at_the_timeout():
    area = _area()
    dead = doorbell.DoorbellClient({0: area}, lambda h: False, 60.0)
    t0 = time.monotonic()
    with pytest.raises(PeerFailedError, match="exited") as e:
        dead.wait([dead.ring(0, 1, 5, 0)], "query of layer 0")
    assert (e.value.instance_id, e.value.role) == (0, "query")
    assert time.monotonic() - t0 < WAIT_BOUND_S
    silent = doorbell.DoorbellClient({0: area}, lambda h: True, 0.3)
    t0 = time.monotonic()
    with pytest.raises(PeerFailedError, match="no answer"):
        silent.wait([silent.ring(0, 1, 5, 0)], "query of layer 0")
    assert 0.3 <= time.monotonic() - t0 < WAIT_BOUND_S


def _query_stats(cluster) -> dict[int, dict]:
    return {k[1]: v for k, v in cluster.engine_stats().items() if k[0] == "query"}


def test_layers_are_rung_not_sent_and_stay_exact(shared_cluster):
    h = shared_cluster.harness(4, 16, 64, backend="cpu")
    ids = warm_up(h, "abcd", 200)
    before = _query_stats(h.cluster)
    batch = decode_batch(h, ids, 5)
    assert h.step([batch]) <= h.tolerance  # against monolithic attention
    after = _query_stats(h.cluster)
    qp = h.last_plans.query_plans[0]
    remote = [int(v) for v in qp.holder_ids if v != qp.origin]
    assert remote, "the decode must read a page held elsewhere"
    layers = h.shape.num_layers
    for v in remote:
        rung = after[v].get("doorbell_calls", 0) - before[v].get("doorbell_calls", 0)
        timed = after[v]["RunQuery_seconds:count"] - before[v].get("RunQuery_seconds:count", 0)
        assert rung == layers  # one doorbell per layer of this holder's one part
        assert timed == rung  # and no RunQuery message beside them


def test_hostile_doorbell_words_are_refused_and_the_holder_serves_on(shared_cluster):
    h = shared_cluster.harness(4, 16, 64, backend="cpu")
    ids = warm_up(h, "abcd", 200)
    batch = decode_batch(h, ids, 6)
    assert h.step([batch]) <= h.tolerance
    qp = h.last_plans.query_plans[0]
    holder = next(int(v) for v in qp.holder_ids if v != qp.origin)
    n = len(h.cluster.buffers)
    areas = {i: doorbell.DoorbellArea(b.doorbells, n) for i, b in enumerate(h.cluster.buffers)}
    # the binding the origin rang last at that holder: a real one, still bound there
    words = areas[holder].words
    bound = words[qp.origin * doorbell.SLOT_WORDS + doorbell.BINDING]
    client = doorbell.DoorbellClient(areas, lambda i: True, CONFIG.timeout_s)
    errors_before = _query_stats(h.cluster)[holder].get("errors", 0)
    cases = [
        (qp.origin, 1 << 50, 0, "binding"),  # never bound
        (qp.origin, -3, 0, "binding"),
        (qp.origin, bound, h.shape.num_layers, "layer"),  # outside the model
        (qp.origin, bound, -1, "layer"),
        ((qp.origin + 1) % 4, bound, 0, "binding"),  # another origin's binding id
    ]
    for origin, binding, layer, field in cases:
        with pytest.raises(RemoteEngineError, match=field):
            client.wait([client.ring(holder, origin, binding, layer)], "hostile")
    assert _query_stats(h.cluster)[holder]["errors"] - errors_before == len(cases)
    assert h.step([decode_batch(h, ids, 7)]) <= h.tolerance  # still serving, still exact


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_doorbells_match_messages():
    """On a GPU the doorbell is rung after the origin's interprocess CUDA event is
    recorded; the holder's stream waits on that event before reading q."""
    from tokenlake.engines.clusters.mp import MPCluster
    from tokenlake.engines.dataplane_config import DataPlaneConfig

    shape = tl.ModelShape(num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=64)
    ids = np.arange(16 * 6 + 3, dtype=np.int32)
    config = DataPlaneConfig(max_q_rows=128, max_kv_rows=128, device="cuda")
    results = {}
    for bells in (False, True):
        pool = tl.Pool(tl.PoolConfig(shape, 2, num_slots=32, segment_len=16, device="cuda"))
        gen = torch.Generator().manual_seed(0)
        with MPCluster(pool, config, backend="torch", doorbells=bells) as cluster:
            plans = pool.gen_plans([[tl.Chunk("a", ids, 0)]], dops=[2])
            for tp in plans.transfer_plans:
                engine = cluster.engine(tp.origin)
                kv_buf = engine.init_transfer(tp)
                kv_buf.copy_(torch.randn(kv_buf.shape, generator=gen).to(kv_buf.dtype))
                for layer in range(shape.num_layers):
                    engine.put(kv_buf, layer)
            cluster.synchronize()
            pool.commit(plans)
            plans = pool.gen_plans([[tl.Chunk("a", np.append(ids, 1), len(ids))]])
            qp = plans.query_plans[0]
            assert len(qp.parts) == 2
            engine = cluster.engine(qp.origin)
            q_buf = engine.init_query(qp)
            q_buf.copy_(torch.randn(q_buf.shape, generator=gen).to(q_buf.dtype))
            results[bells] = [
                tuple(t.cpu() for t in engine.query(q_buf, layer))
                for layer in range(shape.num_layers)
            ]
            rung = sum(s.get("doorbell_calls", 0) for s in _query_stats(cluster).values())
            assert rung == (shape.num_layers if bells else 0)
            pool.abort(plans)
    for (o_m, lse_m), (o_d, lse_d) in zip(results[False], results[True], strict=True):
        torch.testing.assert_close(o_d, o_m, atol=0, rtol=0)
        torch.testing.assert_close(lse_d, lse_m, atol=0, rtol=0)


def test_doorbells_only_where_the_store_order_publishes_fields_first():
    assert doorbell.supported("x86_64") and doorbell.supported("AMD64")
    assert not doorbell.supported("aarch64") and not doorbell.supported("ppc64le")
