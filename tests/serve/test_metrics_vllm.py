"""``/metrics`` as a Grafana user of vLLM reads it, parsed with prometheus-client's own parser:
vLLM's request histograms with counts and sums equal to what the requests did, finish reasons
as one labelled counter, KV usage with vLLM's meaning beside its capacity and the cached
share, vLLM's prefix-cache counters, ``tl_instance`` (never ``instance``), seconds rather
than nanoseconds; both Grafana dashboards in ``deploy/`` (TokenLake's, and vLLM's published
one renamed) query only families and labels a real server exports, with data for its
model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tokenlake.serve.metrics.engines import EngineCollector  # noqa: E402
from tokenlake.serve.metrics.requests import RequestMetrics  # noqa: E402

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"
VLLM_DASHBOARD = DASHBOARD.with_name("vllm-grafana-dashboard.json")
MODEL = {"model_name": "tiny-random"}
# (prompt length, max_tokens): every request runs to max_tokens (ignore_eos)
REQUESTS = [(9, 4), (17, 1), (30, 6)]
HISTOGRAMS = (
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
    "request_inference_time_seconds", "time_per_output_token_seconds", "request_prompt_tokens",
    "request_generation_tokens", "iteration_tokens_total",
)  # fmt: skip


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, family: str, sample: str, **labels: str) -> float:
    found = [
        s.value for s in fams[family].samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    ]  # fmt: skip
    assert len(found) == 1, (sample, labels, found)
    return found[0]


@pytest.fixture(scope="module")
def scraped(server) -> tuple[dict, str, list[dict]]:
    """The server's /metrics after REQUESTS (a fresh server: nothing else counted)."""
    import httpx

    usages = []
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for i, (prompt_len, max_tokens) in enumerate(REQUESTS):
            body = {
                "prompt": [(7 * i + j) % 200 + 10 for j in range(prompt_len)],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            resp = client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            usages.append(resp.json()["usage"])
        text = client.get("/metrics").text
    return families(text), text, usages


def test_histograms_count_what_the_requests_did(scraped):
    fams, _, usages = scraped
    n = len(REQUESTS)
    generated = [u["completion_tokens"] for u in usages]
    assert generated == [m for _, m in REQUESTS]
    for name in HISTOGRAMS:
        family = fams[f"tokenlake:{name}"]
        assert family.type == "histogram", name
        buckets = [s for s in family.samples if s.name.endswith("_bucket")]
        counts = [s.value for s in buckets]
        assert counts == sorted(counts) and buckets[-1].labels["le"] == "+Inf", name
        count = value(fams, family.name, f"tokenlake:{name}_count", **MODEL)
        assert counts[-1] == count, name
        if name.endswith("_seconds"):
            assert value(fams, family.name, f"tokenlake:{name}_sum", **MODEL) >= 0
    hist = {
        name: value(fams, f"tokenlake:{name}", f"tokenlake:{name}_count", **MODEL)
        for name in HISTOGRAMS
    }
    for name in (
        "time_to_first_token_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
    ):  # fmt: skip
        assert hist[name] == n, name
    assert hist["inter_token_latency_seconds"] == sum(g - 1 for g in generated)
    assert hist["time_per_output_token_seconds"] == sum(g > 1 for g in generated)

    def total(name: str) -> float:
        return value(fams, f"tokenlake:{name}", f"tokenlake:{name}_sum", **MODEL)

    assert total("request_generation_tokens") == sum(generated)
    assert total("request_prompt_tokens") == sum(u["prompt_tokens"] for u in usages)
    computed = value(fams, "tokenlake:computed_tokens", "tokenlake:computed_tokens_total", **MODEL)
    assert total("iteration_tokens_total") == computed
    iterations = value(fams, "tokenlake:iterations", "tokenlake:iterations_total", **MODEL)
    assert hist["iteration_tokens_total"] == iterations
    # the per-request bucket a 4-token generation falls in: le=5 (1-2-5 buckets) holds 2 of 3
    gen = "tokenlake:request_generation_tokens"
    assert value(fams, gen, gen + "_bucket", le="5.0", **MODEL) == 2
    assert value(fams, gen, gen + "_bucket", le="1.0", **MODEL) == 1


def test_finish_reasons_preemptions_and_kv_capacity(server, scraped):
    fams, _, _ = scraped
    config = server.served.config
    finished = "tokenlake:request_success"
    assert fams[finished].type == "counter"
    reasons = {s.labels["finished_reason"]: s.value for s in fams[finished].samples}
    assert reasons == {"stop": 0, "length": len(REQUESTS), "abort": 0, "error": 0}
    assert value(fams, "tokenlake:num_preemptions", "tokenlake:num_preemptions_total") == 0
    capacity = config.num_slots * config.num_instances
    slots = "tokenlake:kv_cache_capacity_slots"
    assert value(fams, slots, slots, **MODEL) == capacity
    tokens = "tokenlake:kv_cache_capacity_tokens"
    assert value(fams, tokens, tokens, **MODEL) == capacity * config.segment_len
    used = {
        s.labels["tl_instance"]: s.value for s in fams["tokenlake:pool_instance_slots_used"].samples
    }
    per_instance = "tokenlake:kv_cache_instance_used_perc"
    usage = {s.labels["tl_instance"]: s.value for s in fams[per_instance].samples}
    assert set(usage) == {str(i) for i in range(config.num_instances)}
    assert usage == {i: n / config.num_slots for i, n in used.items()}
    assert sum(used.values()) > 0  # the prompts' segments stay cached
    used_total = value(fams, "tokenlake:kv_cache_used_slots", "tokenlake:kv_cache_used_slots")
    assert used_total == sum(used.values())
    # every request finished: vLLM's usage reads 0 (nothing held by a running request), and
    # the cached segments are TokenLake's cached-but-idle share
    kv = "tokenlake:kv_cache_usage_perc"
    assert value(fams, kv, kv, **MODEL) == 0
    cached = "tokenlake:kv_cache_cached_perc"
    assert value(fams, cached, cached, **MODEL) == pytest.approx(used_total / capacity)
    # vLLM's prefix-cache counters: prompt tokens looked up, and found
    queries = value(fams, "tokenlake:prefix_cache_queries",
                    "tokenlake:prefix_cache_queries_total", **MODEL)  # fmt: skip
    hits = value(fams, "tokenlake:prefix_cache_hits", "tokenlake:prefix_cache_hits_total", **MODEL)
    assert queries == sum(p for p, _ in REQUESTS) and 0 <= hits <= queries


def test_labels_and_units(scraped):
    fams, text, _ = scraped
    for family in fams.values():
        for s in family.samples:
            assert "instance" not in s.labels, s  # Prometheus would rename it at scrape
            assert s.labels.get("tl_instance") != "-1", s
            assert "_ns" not in s.name, s
            if s.labels.get("role") == "client":
                assert "tl_instance" not in s.labels, s
    for family in fams.values():
        assert family.documentation, family.name


def test_engine_nanoseconds_are_seconds_and_clients_have_no_instance():
    stats = {
        ("query", 1): {"query_thread_ns": 2_500_000_000, "query_calls": 3},
        ("client", -1): {"query_calls": 5},
    }
    out = {}
    for family in EngineCollector(lambda: stats).collect():
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = (s.value, family.documentation)
    thread = out[("tokenlake:engine_query_thread_seconds_total",
                  (("role", "query"), ("tl_instance", "1")))]  # fmt: skip
    assert thread[0] == 2.5 and "CPU time" in thread[1]
    assert out[("tokenlake:engine_query_calls_total", (("role", "client"),))][0] == 5
    assert out[("tokenlake:engine_errors_total", (("role", "client"),))][0] == 0


def test_request_timings_follow_the_clock():
    now = [100.0]
    metrics = RequestMetrics(max_model_len=64, clock=lambda: now[0])
    times = metrics.arrive()  # arrives at 100
    metrics.scheduled(times, 100.5)  # queued 0.5 s
    for t in (101.0, 101.25, 101.75):  # prefill 0.5 s, then two gaps of 0.25 and 0.5 s
        now[0] = t
        metrics.token(times)
    metrics.scheduled(times, 103.0)  # a later iteration changes nothing
    now[0] = 102.0
    metrics.finished(times, "stop", num_prompt_tokens=7, num_generated=3)
    metrics.iteration(40)
    snap = metrics.snapshot()
    h = snap.histograms

    def one(name: str) -> float:
        assert h[name].count == 1, name
        return h[name].sum

    assert one("request_queue_time_seconds") == 0.5
    assert one("time_to_first_token_seconds") == 1.0
    assert one("request_prefill_time_seconds") == 0.5
    assert one("request_decode_time_seconds") == 0.75
    assert one("request_inference_time_seconds") == 1.25
    assert one("e2e_request_latency_seconds") == 2.0
    assert one("time_per_output_token_seconds") == 0.375
    assert h["inter_token_latency_seconds"].count == 2
    assert h["inter_token_latency_seconds"].sum == 0.75
    # vLLM's ITL bounds ... 0.2, 0.3, 0.4, 0.5: 0.25 counts from le=0.3, 0.5 from le=0.5
    itl = dict(h["inter_token_latency_seconds"].buckets)
    assert (itl[0.2], itl[0.3], itl[0.4], itl[0.5]) == (0, 1, 1, 2)
    assert one("request_prompt_tokens") == 7
    assert [b for b, _ in h["request_prompt_tokens"].buckets] == [1, 2, 5, 10, 20, 50, float("inf")]
    assert dict(h["request_prompt_tokens"].buckets)[10] == 1
    assert dict(h["iteration_tokens_total"].buckets)[32] == 0
    assert dict(h["iteration_tokens_total"].buckets)[64] == 1
    assert snap.finished == {"stop": 1, "length": 0, "abort": 0, "error": 0}


METRIC_NAME = re.compile(r"tokenlake:[A-Za-z0-9_:]+")
BY_LABELS = re.compile(r"by \(([^)]*)\)")


def test_dashboard_queries_only_exported_families(scraped):
    fams, _, _ = scraped
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][1]["query"]["query"])
    samples = {s.name: set(s.labels) for f in fams.values() for s in f.samples}
    labels_of: dict[str, set] = {}
    for name, labels in samples.items():
        labels_of.setdefault(name, set()).update(labels)
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for wanted in ("time to first token", "inter-token", "hit rate", "load", "cv", "kv"):
        assert wanted in titles, wanted
    quantiles = [e for e in exprs if "histogram_quantile" in e]
    assert any("time_to_first_token_seconds_bucket" in e for e in quantiles)
    assert any("inter_token_latency_seconds_bucket" in e for e in quantiles)
    for expr in exprs:
        names = METRIC_NAME.findall(expr)
        assert names, expr
        for name in names:
            assert name in samples, f"{name} (in {expr!r}) is not exported"
        for group in BY_LABELS.findall(expr):
            for label in (x.strip() for x in group.split(",")):
                assert any(label in labels_of[n] for n in names), (label, expr)
    legends = [
        (t.get("legendFormat", ""), t["expr"]) for p in dashboard["panels"] for t in p["targets"]
    ]
    for legend, expr in legends:
        names = METRIC_NAME.findall(expr)
        for label in re.findall(r"\{\{(\w+)\}\}", legend):
            assert any(label in labels_of[n] for n in names), (label, expr)


SELECTOR = re.compile(r"(tokenlake:[A-Za-z0-9_:]+)\{([^}]*)\}")
BY_ANY = re.compile(r"by ?\(([^)]*)\)")


def test_vllm_dashboard_every_metric_and_label_exists(scraped):
    """vLLM's own dashboard (renamed): each metric of each query is exported, each label its
    selectors and ``by`` clauses name is on that metric, and ``model_name="$model_name"``
    selects this server's samples."""
    fams, _, _ = scraped
    dashboard = json.loads(VLLM_DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 20 and all("vllm:" not in e for e in exprs)
    variable = dashboard["templating"]["list"][1]["query"]["query"]
    assert variable == "label_values(model_name)"
    samples: dict[str, list[dict]] = {}
    for f in fams.values():
        for s in f.samples:
            samples.setdefault(s.name, []).append(s.labels)
    for expr in exprs:
        names = METRIC_NAME.findall(expr)
        assert names, expr
        for name in names:
            assert name in samples, f"{name} (in {expr!r}) is not exported"
        for name, selector in SELECTOR.findall(expr):
            wanted = dict(re.findall(r'(\w+)="([^"]*)"', selector))
            assert set(wanted) == {"model_name"}, expr
            mine = [lb for lb in samples[name] if lb.get("model_name") == MODEL["model_name"]]
            assert mine, f"{name}: no sample with model_name={MODEL['model_name']}"
        for group in BY_ANY.findall(expr):
            for label in (x.strip() for x in group.split(",")):
                assert any(label in lb for n in names for lb in samples[n]), (label, expr)
