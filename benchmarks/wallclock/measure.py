"""The wall-clock bench's figures: the SLO (the simulator's rule: a multiple of the
batch-size-1 latencies), attainment and percentiles from recorded requests, and hit rate and
load CV from the servers' /metrics counters (the difference across one run)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenlake.benchmarks.wallclock.client import Record
from tokenlake.cluster.balancer import coefficient_of_variation

SLO_SCALE = 10.0  # the simulator's: every token within 10x its batch-size-1 latency
HIT_TOKENS = "tokenlake:pool_hit_tokens_total"
PROMPT_TOKENS = "tokenlake:pool_prompt_tokens_total"
INSTANCE_LOAD = "tokenlake:pool_instance_load_tokens_total"


@dataclass(frozen=True)
class Slo:
    """A request meets it when its first token comes within ``ttft_s`` of sending and every
    later token within ``tpot_s`` of the one before."""

    ttft_s: float
    tpot_s: float

    def met_by(self, rec: Record) -> bool:
        return rec.finished and rec.ttft_s <= self.ttft_s and rec.max_gap_s <= self.tpot_s

    def as_dict(self) -> dict:
        return {"ttft_s": round(self.ttft_s, 6), "tpot_s": round(self.tpot_s, 6)}


def slo_from_solo(solo_ttft_s: Sequence[float], solo_tpot_s: Sequence[float],
                  scale: float = SLO_SCALE) -> Slo:  # fmt: skip
    """``scale`` times the median batch-size-1 TTFT and TPOT measured at idle."""
    if not solo_ttft_s or not solo_tpot_s:
        raise ValueError("slo_from_solo: expected at least one solo TTFT and TPOT")
    return Slo(scale * float(np.median(solo_ttft_s)), scale * float(np.median(solo_tpot_s)))


def attainment(records: Sequence[Record], slo: Slo) -> float:
    """The fraction of requests meeting ``slo`` (an unfinished or failed one misses)."""
    return sum(slo.met_by(r) for r in records) / len(records) if records else 0.0


def p90(values: Sequence[float]) -> float:
    """The 90th percentile (linear interpolation); inf if empty or any value is inf."""
    arr = np.asarray(list(values), dtype=float)
    return float(np.percentile(arr, 90)) if arr.size and np.isfinite(arr).all() else float("inf")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name with labels: value} for the counters used here."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith((HIT_TOKENS, PROMPT_TOKENS, INSTANCE_LOAD)):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def scrape(urls: Sequence[str], timeout_s: float = 10.0) -> list[dict[str, float]]:
    import httpx

    return [parse_metrics(httpx.get(f"{u}/metrics", timeout=timeout_s).text) for u in urls]


@dataclass(frozen=True)
class ServerDelta:
    """What one server counted during a run: hit and prompt tokens, prefix tokens read per
    instance."""

    hit_tokens: float
    prompt_tokens: float
    instance_load: tuple[float, ...]


def delta(before: dict[str, float], after: dict[str, float]) -> ServerDelta:
    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    loads = sorted((k for k in after if k.startswith(INSTANCE_LOAD)), key=_instance_of)
    return ServerDelta(d(HIT_TOKENS), d(PROMPT_TOKENS), tuple(d(k) for k in loads))


def _instance_of(sample: str) -> int:
    return int(sample.split('tl_instance="', 1)[1].split('"', 1)[0])


def hit_rate(deltas: Sequence[ServerDelta]) -> float:
    """Hit tokens over prompt tokens, summed over the servers."""
    prompt = sum(d.prompt_tokens for d in deltas)
    return sum(d.hit_tokens for d in deltas) / prompt if prompt else 0.0


def load_cv(deltas: Sequence[ServerDelta]) -> float:
    """CV of the prefix tokens each instance read over the run (every server's instances)."""
    loads = [x for d in deltas for x in d.instance_load]
    return float(coefficient_of_variation(np.asarray(loads))) if sum(loads) > 0 else 0.0
