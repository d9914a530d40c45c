"""Prometheus metrics, read back with prometheus-client's own parser: a plain program mounting
the pool's and the engines' collectors (values against what the test did), the engine
processes' counters and latency histograms, bounded pool history, and ``/metrics`` of a
running server."""

from __future__ import annotations

import time

import numpy as np
import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from harness import Harness, tokens  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import tokenlake as tl  # noqa: E402
from tokenlake.cluster.balancer import BalancerConfig  # noqa: E402
from tokenlake.serve.metrics.collector import EngineCollector, PoolCollector  # noqa: E402

C = 16


def samples(text: str) -> dict[tuple, float]:
    """``(sample name, sorted labels) -> value`` of an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(registry) -> dict[tuple, float]:
    return samples(generate_latest(registry).decode())


def key(name: str, **labels: str) -> tuple:
    return (name, tuple(sorted(labels.items())))


def test_a_plain_program_exports_pool_and_engine_metrics():
    h = Harness(num_instances=2, segment_len=C, num_slots=64, backend="cpu")
    registry = CollectorRegistry()
    registry.register(PoolCollector(h.pool.get_stats))
    registry.register(EngineCollector(h.cluster.engine_stats))
    doc = tokens(1, 4 * C)
    first = np.concatenate([doc, tokens(2, 5)])
    assert h.step([[tl.Chunk("a", first, 0)]]) <= h.tolerance
    second = np.concatenate([doc, tokens(3, 7)])
    hit = h.cached(second)
    assert hit == 4 * C  # the shared document's four sealed segments
    assert h.step([[tl.Chunk("b", second, hit)]]) <= h.tolerance
    aborted = h.pool.gen_plans([[tl.Chunk("c", tokens(4, 9), 0)]])
    h.pool.abort(aborted, executed=False)  # leaves no trace, also not in the histogram
    m = scrape(registry)
    assert m[("tokenlake:pool_hit_tokens_total", ())] == 4 * C
    prompt = len(first) + len(second)
    assert m[("tokenlake:pool_prompt_tokens_total", ())] == prompt
    assert m[("tokenlake:pool_miss_tokens_total", ())] == prompt - 4 * C
    assert m[("tokenlake:pool_hit_rate", ())] == pytest.approx(4 * C / prompt)
    assert m[("tokenlake:pool_segments", ())] == (len(first) // C) + (len(second) // C) - 4
    assert m[("tokenlake:pool_iterations_total", ())] == 2
    assert m[("tokenlake:pool_gen_plans_seconds_count", ())] == 2
    assert m[("tokenlake:pool_gen_plans_seconds_bucket", (("le", "+Inf"),))] == 2
    loads = [
        m[("tokenlake:pool_instance_load_tokens_total", (("tl_instance", str(i)),))] for i in (0, 1)
    ]
    assert loads == h.pool.get_stats()["instance_load"] and sum(loads) > 0
    # the client side: one query and one put per layer and iteration, each timed
    calls = 2 * h.shape.num_layers
    client = (("role", "client"),)  # a process's clients serve every instance: no tl_instance
    assert m[("tokenlake:engine_query_calls_total", client)] == calls
    assert m[("tokenlake:engine_put_calls_total", client)] == calls
    query = (("op", "query"), ("role", "client"))
    assert m[("tokenlake:engine_latency_seconds_count", query)] == calls
    le_inf = key("tokenlake:engine_latency_seconds_bucket", le="+Inf", **dict(query))
    assert m[le_inf] == calls
    assert m[("tokenlake:engine_latency_seconds_sum", query)] > 0
    q_bytes = h.shape.num_q_heads * h.shape.head_dim * 4  # q row + o row (float32)
    rows = (len(first) + len(second) - hit) * h.shape.num_layers
    assert m[("tokenlake:engine_query_bytes_total", client)] == rows * (
        2 * q_bytes + 4 * h.shape.num_q_heads
    )


def test_engine_processes_report_calls_latency_and_errors():
    from tokenlake.engines.clusters.mp import MPCluster
    from tokenlake.engines.dataplane_config import DataPlaneConfig

    h = Harness(num_instances=2, segment_len=C, num_slots=64, backend="cpu")
    with MPCluster(h.pool.config, DataPlaneConfig(separate_hosts=True), backend="cpu") as cluster:
        h.cluster = cluster
        registry = CollectorRegistry()
        registry.register(EngineCollector(cluster.engine_stats))
        for i in range(4):  # a document, then a turn on it: its prefix is read where it lives
            doc = tokens(10 + i, 3 * C + 1)
            assert h.step([[tl.Chunk(f"r{i}", doc, 0)]]) <= h.tolerance
            turn = np.concatenate([doc, tokens(20 + i, 5)])
            assert h.step([[tl.Chunk(f"t{i}", turn, h.cached(turn))]]) <= h.tolerance
        m = scrape(registry)
    engines = [k for k in m if k[0] == "tokenlake:engine_latency_seconds_count"]
    roles = {dict(labels)["role"] for _, labels in engines}
    assert {"query", "transfer", "client"} <= roles
    remote_queries = sum(
        v for (name, labels), v in m.items()
        if name == "tokenlake:engine_query_calls_total" and dict(labels)["role"] == "query"
    )  # fmt: skip
    run_query = sum(
        v for (name, labels), v in m.items()
        if name == "tokenlake:engine_latency_seconds_count" and dict(labels)["op"] == "RunQuery"
    )  # fmt: skip
    assert remote_queries > 0 and run_query == remote_queries  # every call timed once
    configured = [
        dict(labels)["role"] for (name, labels), v in m.items()
        if name == "tokenlake:engine_latency_seconds_count" and dict(labels)["op"] == "Configure"
    ]  # fmt: skip
    assert sorted(configured) == ["query", "query", "transfer", "transfer"]
    # no failures here, and the failure counters say so for every engine (0, not absent)
    for _, labels in engines:
        for counter in ("errors", "peer_failures"):
            assert m[(f"tokenlake:engine_{counter}_total", labels_without_op(labels))] == 0


def labels_without_op(labels: tuple) -> tuple:
    return tuple((k, v) for k, v in labels if k != "op")


def test_pool_history_stays_bounded():
    pool = tl.Pool(
        tl.PoolConfig(tl.ModelShape(1, 2, 1, 8), 2, 64, 4),
        balancer=BalancerConfig(window=1, replicate=False),
    )
    registry = CollectorRegistry()
    registry.register(PoolCollector(pool.get_stats))
    sizes = []
    for i in range(1100):  # more load-CV windows than the history keeps (1,024)
        ids = np.array([1, 2, 3, 4, 5, i % 7 + 10], dtype=np.int32)
        plans = pool.gen_plans(
            [[tl.Chunk(i, ids, min(pool.get_prefix_tree().match(ids).num_tokens, 5))]]
        )
        pool.commit(plans)
        pool.finish(i)
        if i in (10, 1099):
            sizes.append(len(generate_latest(registry)))
    stats = pool.get_stats()
    assert stats["num_load_cv_windows"] == 1100
    assert len(stats["load_cv_over_time"]) == 1024
    assert len(pool.access.cv_history) <= pool.access.cv_history.maxlen == 1024
    assert sizes[0] == sizes[1] or abs(sizes[0] - sizes[1]) < 200  # values, not history


def test_server_serves_prometheus_metrics(client):
    body = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13], "max_tokens": 3, "temperature": 0}
    assert client.post("/v1/completions", json=body).status_code == 200
    deadline = time.monotonic() + 10
    while True:  # engine counters are snapshotted by the runtime loop about once a second
        resp = client.get("/metrics")
        m = samples(resp.text)
        query = (("op", "query"), ("role", "client"))
        if m.get(("tokenlake:engine_latency_seconds_count", query), 0) > 0:
            break
        assert time.monotonic() < deadline, "engine metrics never refreshed"
        time.sleep(0.3)
    assert resp.headers["content-type"].startswith("text/plain")
    model = (("model_name", "tiny-random"),)
    assert m[("tokenlake:requests_total", model)] >= 1
    assert m[("tokenlake:generation_tokens_total", model)] >= 3
    assert m[("tokenlake:pool_prompt_tokens_total", ())] >= 9
    assert m[("tokenlake:pool_gen_plans_seconds_count", ())] >= 1
    assert ("tokenlake:pool_instance_load_tokens_total", (("tl_instance", "1"),)) in m
    assert m[("tokenlake:engine_put_calls_total", (("role", "client"),))] > 0
