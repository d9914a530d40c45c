"""One run of the SGLang wall-clock bench (a request list sent through one system's router at
one rate, on servers that stay up: every run sends fresh text, so no run hits what an earlier
one cached), and the SLO's calibration (batch-size-1 on one idle baseline server, written to
a file once per model and read by every later invocation)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from tokenlake.benchmarks.wallclock.client import drive
from tokenlake.benchmarks.wallclock.measure import Slo, attainment, p90, slo_from_solo
from tokenlake.benchmarks.wallclock.sglang.sides import Side, scrape_counters
from tokenlake.benchmarks.wallclock.workloads import TimedRequest
from tokenlake.cluster.balancer import coefficient_of_variation

SOLO_REPEATS = 3
COUNTERS_SETTLE_S = 1.0  # SGLang counts a request's tokens as it finishes; let the last land


def run_point(side: Side, system: str, model: str, requests: Sequence[TimedRequest],
              rate: float, salt: int, slo: Slo, drain_s: float) -> dict:  # fmt: skip
    """Send ``requests`` at ``rate`` through ``side``'s router for ``system``; the point's
    JSON fields (without the identifying keys)."""
    limit_s = max(r.arrival_s for r in requests) / rate + drain_s
    before, cpu_before = scrape_counters(side.servers), side.cpu_by_role()
    records = drive(side.routers[system], model, requests, rate, salt=salt, limit_s=limit_s)
    time.sleep(COUNTERS_SETTLE_S)
    after, cpu_after = scrape_counters(side.servers), side.cpu_by_role()
    cpu_by_role = {k: round(v - cpu_before.get(k, 0.0), 3) for k, v in sorted(cpu_after.items())}
    cpu = sum(cpu_by_role.values())
    d = [{k: a[k] - b[k] for k in a} for b, a in zip(before, after, strict=True)]
    prompt = sum(x["sglang:prompt_tokens_total"] for x in d)
    cached = sum(x["sglang:cached_tokens_total"] for x in d)
    output = sum(r.num_tokens for r in records)
    work = [x["sglang:prompt_tokens_total"] - x["sglang:cached_tokens_total"]
            + x["sglang:generation_tokens_total"] for x in d]  # fmt: skip
    errors = sorted({r.error for r in records if r.error})
    return {
        "rate": round(rate, 4),
        "num_requests": len(records),
        "attainment": round(attainment(records, slo), 4),
        "ttft_p90_s": round(p90(r.ttft_s for r in records), 6),
        "tpot_p90_s": round(p90(r.tpot_s if r.finished else float("inf") for r in records), 6),
        "max_gap_p90_s": round(p90(r.max_gap_s for r in records), 6),
        "prompt_tokens": round(prompt),
        "cached_tokens": round(cached),
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "load_cv": round(float(coefficient_of_variation(np.asarray(work))), 4)
        if sum(work) > 0
        else 0.0,
        "server_work_tokens": [round(w) for w in work],
        "cpu_s": round(cpu, 3),
        "cpu_s_by_process": cpu_by_role,
        "output_tokens": output,
        "cpu_s_per_output_token": round(cpu / output, 6) if output else None,
        "slo": slo.as_dict(),
        "finished": sum(r.finished for r in records),
        "errors": errors[:3],
    }


def warm_up(url: str, model: str) -> None:
    """One short request (a server's first forwards pay one-off costs); one repeated
    character, so it leaves nothing a run can hit."""
    drive(url, model, [TimedRequest("warm-up", 0.0, (0,) * 16, 2, None)], 1.0, salt=0,
          limit_s=120.0)  # fmt: skip


def measure_solo(url: str, model: str, requests: Sequence[TimedRequest],
                 salts: Iterator[int]) -> dict:  # fmt: skip
    """The workload's median-length prompt sent alone to the idle server at ``url`` (fresh
    text each time), after one warm-up: the SLO (10x its TTFT and TPOT) and the solo E2E."""
    ordered = sorted(requests, key=lambda r: len(r.prompt_ids))
    median = ordered[len(ordered) // 2]
    probe = TimedRequest("solo", 0.0, median.prompt_ids, max(2, median.max_tokens), None)
    drive(url, model, [probe], 1.0, salt=next(salts), limit_s=120.0)
    ttft, tpot, e2e = [], [], []
    for _ in range(SOLO_REPEATS):
        (rec,) = drive(url, model, [probe], 1.0, salt=next(salts), limit_s=120.0)
        if not rec.finished:
            raise RuntimeError(f"the solo request failed on {url}: {rec.error}")
        ttft.append(rec.ttft_s)
        tpot.append(rec.tpot_s)
        e2e.append(rec.token_s[-1] - rec.sent_s)
    slo = slo_from_solo(ttft, tpot)
    return {**slo.as_dict(), "solo_e2e_s": round(float(np.median(e2e)), 6),
            "solo_ttft_s": round(float(np.median(ttft)), 6),
            "solo_tpot_s": round(float(np.median(tpot)), 6)}  # fmt: skip


def read_slo_file(path: Path, model: str) -> dict[str, dict]:
    """``{workload: {"ttft_s", "tpot_s", "solo_e2e_s"}}`` for ``model`` ({} if absent)."""
    if not path.exists():
        return {}
    return json.loads(path.read_text()).get(model, {}).get("workloads", {})


def write_slo_file(path: Path, model: str, per_workload: dict[str, dict]) -> None:
    """Record ``model``'s calibrated SLOs (other models' entries kept)."""
    data = json.loads(path.read_text()) if path.exists() else {}
    old = data.get(model, {}).get("workloads", {})
    data[model] = {"workloads": {**old, **per_workload},
                   "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "load_avg": round(os.getloadavg()[0], 2),
                   "rule": "10x the batch-size-1 TTFT and TPOT of the workload's median prompt "
                           "on one idle baseline SGLang server"}  # fmt: skip
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
