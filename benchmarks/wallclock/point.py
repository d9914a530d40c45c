"""One run of the wall-clock bench: a system (the URL requests go to, the servers whose
/metrics count them), a request list at one rate, and its JSON fields; and the batch-size-1
measurement the SLO is made of."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from tokenlake.benchmarks.wallclock.client import drive
from tokenlake.benchmarks.wallclock.measure import (
    Slo,
    attainment,
    delta,
    hit_rate,
    load_cv,
    p90,
    scrape,
    slo_from_solo,
)
from tokenlake.benchmarks.wallclock.workloads import TimedRequest

SOLO_REPEATS = 3
IDLE_WAIT_S = 120.0
RUNNING = ("tokenlake:num_requests_running", "tokenlake:num_requests_waiting")


@dataclass(frozen=True)
class System:
    url: str  # where the client sends requests
    servers: list[str]  # the tokenlake servers behind it


def wait_idle(servers: Sequence[str], timeout_s: float = IDLE_WAIT_S) -> None:
    """Until no server runs or queues a request (a run cut at its cap leaves some behind)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = 0.0
        for url in servers:
            for line in httpx.get(f"{url}/metrics", timeout=10.0).text.splitlines():
                if line.startswith(RUNNING):
                    busy += float(line.rpartition(" ")[2])
        if busy == 0:
            return
        time.sleep(0.5)
    raise TimeoutError(f"servers {list(servers)} still busy after {timeout_s:g} s")


def run_point(system: System, model: str, requests: Sequence[TimedRequest], rate: float,
              salt: int, slo: Slo, drain_s: float) -> dict:  # fmt: skip
    """Send ``requests`` at ``rate``; the point's JSON fields (without the identifying keys)."""
    wait_idle(system.servers)
    before = scrape(system.servers)
    limit_s = max(r.arrival_s for r in requests) / rate + drain_s
    records = drive(system.url, model, requests, rate, salt=salt, limit_s=limit_s)
    wait_idle(system.servers)
    deltas = [delta(b, a) for b, a in zip(before, scrape(system.servers), strict=True)]
    errors = sorted({r.error for r in records if r.error})
    return {
        "rate": round(rate, 4),
        "num_requests": len(records),
        "attainment": round(attainment(records, slo), 4),
        "ttft_p90_s": round(p90(r.ttft_s for r in records), 6),
        "tpot_p90_s": round(p90(r.tpot_s if r.finished else float("inf") for r in records), 6),
        "hit_rate": round(hit_rate(deltas), 4),
        "load_cv": round(load_cv(deltas), 4),
        "slo": slo.as_dict(),
        "finished": sum(r.finished for r in records),
        "hit_rate_usage": round(
            sum(r.cached_tokens for r in records) / max(1, sum(r.prompt_len + 1 for r in records)),
            4,
        ),
        "errors": errors[:3],
    }


def measure_solo(url: str, model: str, requests: Sequence[TimedRequest],
                 salts: Iterator[int]) -> tuple[Slo, float]:  # fmt: skip
    """The SLO from the workload's median-length prompt sent alone to the idle 1-instance
    server at ``url`` (a fresh text each time: an empty cache), after one warm-up; and the
    solo end-to-end seconds."""
    ordered = sorted(requests, key=lambda r: len(r.prompt_ids))
    median = ordered[len(ordered) // 2]
    probe = TimedRequest("solo", 0.0, median.prompt_ids, max(2, median.max_tokens), None)
    wait_idle([url])
    drive(url, model, [probe], 1.0, salt=next(salts), limit_s=120.0)  # warm-up
    ttft, tpot, e2e = [], [], []
    for _ in range(SOLO_REPEATS):
        (rec,) = drive(url, model, [probe], 1.0, salt=next(salts), limit_s=120.0)
        if not rec.finished:
            raise RuntimeError(f"the solo request failed on {url}: {rec.error}")
        ttft.append(rec.ttft_s)
        tpot.append(rec.tpot_s)
        e2e.append(rec.token_s[-1] - rec.sent_s)
    return slo_from_solo(ttft, tpot), float(np.median(e2e))
