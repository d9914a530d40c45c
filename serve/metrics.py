"""``/metrics``: the runtime's and the pool's counters in the Prometheus text format."""

from __future__ import annotations

from tokenlake.serve.runtime import Runtime

_COUNTERS = {
    "requests": "Requests received",
    "prompt_tokens": "Prompt tokens of finished requests",
    "cached_prompt_tokens": "Prompt tokens of finished requests found in the pool",
    "generation_tokens": "Tokens generated",
    "computed_tokens": "Tokens the compute engine ran (prefill and decode)",
    "iterations": "Scheduler iterations executed",
    "finished_stop": "Requests finished by a stop token or string",
    "finished_length": "Requests finished by max_tokens",
    "finished_abort": "Requests cancelled (client gone)",
    "finished_error": "Requests failed",
}
_POOL = {
    "hit_rate": "Share of prompt tokens served from the pool",
    "load_cv": "Coefficient of variation of per-instance prefix-attention load",
    "num_segments": "Sealed segments stored",
    "num_replicas": "Extra replicas of segments",
    "num_evictions": "Segments evicted",
    "slots_used": "Slots in use",
    "bytes_saved_by_dedup": "Bytes not stored thanks to deduplication",
}


def render(runtime: Runtime, model_name: str) -> str:
    """Prometheus exposition text (version 0.0.4)."""
    label = f'model_name="{_escape(model_name)}"'
    out = []

    def metric(name: str, kind: str, help_text: str, value: float, labels: str = label) -> None:
        out.append(f"# HELP tokenlake:{name} {help_text}")
        out.append(f"# TYPE tokenlake:{name} {kind}")
        out.append(f"tokenlake:{name}{{{labels}}} {float(value)!r}")

    counters = dict(runtime.counters)
    for key, help_text in _COUNTERS.items():
        metric(f"{key}_total", "counter", help_text, counters.get(key, 0))
    metric("num_requests_running", "gauge", "Requests in the scheduler", runtime.num_running)
    metric("num_requests_waiting", "gauge", "Requests queued", runtime.num_waiting)
    metric("iteration_seconds_total", "counter", "Seconds in iterations", runtime.iteration_seconds)
    stats = runtime.pool_stats
    for key, help_text in _POOL.items():
        value = stats.get(key, 0)
        metric(f"pool_{key}", "gauge", help_text, sum(value) if isinstance(value, list) else value)
    loads = stats.get("instance_load", [])
    out.append("# HELP tokenlake:pool_instance_load Prefix tokens read per instance")
    out.append("# TYPE tokenlake:pool_instance_load counter")
    for i, load in enumerate(loads):
        out.append(f'tokenlake:pool_instance_load{{{label},instance="{i}"}} {float(load)!r}')
    return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
