"""One run of the wall-clock bench: a system started afresh (empty caches, as the simulator
starts), a request list sent at one rate, its JSON fields, the system stopped; and the
batch-size-1 measurement the SLO is made of."""

from __future__ import annotations

import contextlib
import dataclasses
import os
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
from tokenlake.benchmarks.wallclock.processes import Fleet, ServerSettings
from tokenlake.benchmarks.wallclock.workloads import TimedRequest

SOLO_REPEATS = 3
SYSTEMS = ("tokenlake", "router")


@dataclass(frozen=True)
class System:
    url: str  # where the client sends requests
    servers: list[str]  # the tokenlake servers behind it


@dataclass(frozen=True)
class Launch:
    """How to start the two systems: TokenLake's one server over ``num_instances``, the
    router over as many 1-instance servers; each system's torch threads add up to ``cores``."""

    fleet: Fleet
    settings: ServerSettings
    num_instances: int
    router_args: tuple[str, ...] = ()
    cores: int = os.cpu_count() or 1
    tokenlake_data_plane: str | None = None  # TokenLake's server only (None: settings')

    @contextlib.contextmanager
    def started(self, name: str) -> Iterator[System]:
        n, procs = self.num_instances, []
        try:
            if name == "tokenlake":
                settings = self.settings
                if self.tokenlake_data_plane is not None:
                    settings = dataclasses.replace(settings, data_plane=self.tokenlake_data_plane)
                urls, procs = self.fleet.serve(settings, 1, n, self.cores)
                yield System(urls[0], urls)
            elif name == "router":
                urls, procs = self.fleet.serve(self.settings, n, 1, max(1, self.cores // n))
                url, proc = self.fleet.router(urls, self.router_args)
                procs.append(proc)
                yield System(url, urls)
            else:
                raise ValueError(f"name: expected one of {SYSTEMS}, got {name!r}")
        finally:
            self.fleet.stop(procs)


def run_point(launch: Launch, name: str, requests: Sequence[TimedRequest], rate: float,
              salt: int, slo: Slo, drain_s: float) -> dict:  # fmt: skip
    """Start system ``name``, send ``requests`` at ``rate``, stop it; the point's JSON fields
    (without the identifying keys)."""
    limit_s = max(r.arrival_s for r in requests) / rate + drain_s
    with launch.started(name) as system:
        warm_up(system.url, launch.settings.served_name, requests[0])
        before = scrape(system.servers)
        records = drive(system.url, launch.settings.served_name, requests, rate, salt=salt,
                        limit_s=limit_s)  # fmt: skip
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
        "ttft_mean_s": round(float(np.mean([r.ttft_s for r in records if r.token_s] or [0])), 6),
        "max_gap_p90_s": round(p90(r.max_gap_s for r in records), 6),
        # which half of the SLO a miss failed: the first token alone, every token gap alone
        "attainment_ttft_only": round(
            sum(r.finished and r.ttft_s <= slo.ttft_s for r in records) / len(records), 4
        ),
        "attainment_gap_only": round(
            sum(r.finished and r.max_gap_s <= slo.tpot_s for r in records) / len(records), 4
        ),
        "errors": errors[:3],
    }


def warm_up(url: str, model: str, request: TimedRequest) -> None:
    """One short request first (the first forward of a process pays one-off costs): one
    repeated character, shorter than a segment, so it leaves nothing a run can hit."""
    short = TimedRequest("warm-up", 0.0, (0,) * min(16, len(request.prompt_ids)), 2, None)
    drive(url, model, [short], 1.0, salt=0, limit_s=120.0)


def measure_solo(launch: Launch, requests: Sequence[TimedRequest],
                 salts: Iterator[int]) -> tuple[Slo, float]:  # fmt: skip
    """The SLO from the workload's median-length prompt sent alone to an idle 1-instance
    server (a fresh text each time: an empty cache), after one warm-up; and the solo
    end-to-end seconds."""
    ordered = sorted(requests, key=lambda r: len(r.prompt_ids))
    median = ordered[len(ordered) // 2]
    probe = TimedRequest("solo", 0.0, median.prompt_ids, max(2, median.max_tokens), None)
    model = launch.settings.served_name
    urls, procs = launch.fleet.serve(
        launch.settings, 1, 1, max(1, launch.cores // launch.num_instances)
    )
    try:
        drive(urls[0], model, [probe], 1.0, salt=next(salts), limit_s=120.0)  # warm-up
        ttft, tpot, e2e = [], [], []
        for _ in range(SOLO_REPEATS):
            (rec,) = drive(urls[0], model, [probe], 1.0, salt=next(salts), limit_s=120.0)
            if not rec.finished:
                raise RuntimeError(f"the solo request failed on {urls[0]}: {rec.error}")
            ttft.append(rec.ttft_s)
            tpot.append(rec.tpot_s)
            e2e.append(rec.token_s[-1] - rec.sent_s)
    finally:
        launch.fleet.stop(procs)
    return slo_from_solo(ttft, tpot), float(np.median(e2e))
