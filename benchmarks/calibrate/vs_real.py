"""The simulator against the real cluster: the wall-clock runs' workloads, rates, instance
count and SLO thresholds replayed in the simulator, priced by a CPU profile measured on this
machine (``tokenlake bench calibrate-cpu``), side by side with the real figures.

    tokenlake bench sim-vs-real --real /tmp/tl/wallclock/results.jsonl \\
        --hardware-profile tiny.json --hardware-profile bench.json

``--real`` holds ``tokenlake bench wallclock``'s JSON lines (:mod:`tokenlake.benchmarks.
wallclock`'s schema). For every (model, workload, seed, system) measured there, the same
request list (``build_workload`` with the same seed and count) runs through the simulated
setup (:mod:`tokenlake.benchmarks.sim.served_cpu`) at each measured rate; attainment uses the
real run's thresholds and rule, and the run is cut where the real one was (the last arrival
plus ``--drain-s``). A goodput is the highest measured rate whose attainment is at least 0.9,
for both sides (the real bisection's answer is one of its probes). A model without
``--hardware-profile`` is calibrated first (a minute or two: it also starts real servers). Prints one table and JSON lines: ``kind`` "point" (real and simulated
attainment at a rate) and "goodput".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from tokenlake.benchmarks.sim.cpu_profile import CpuProfile, load_cpu_profile
from tokenlake.benchmarks.sim.metrics import hit_rate
from tokenlake.benchmarks.sim.served_cpu import (
    SYSTEMS,
    Arrival,
    ServedSettings,
    attainment,
    idle_costs,
    sim_slo,
    simulate_served,
    to_requests,
)

TARGET = 0.9
ATTAINMENT_TOLERANCE = 0.10  # points
GOODPUT_TOLERANCE = 0.25  # relative


def read_real(path: Path) -> tuple[dict, dict]:
    """(points, goodputs) of a wall-clock JSON lines file: ``points[(model, workload, seed,
    system)]`` = [line, ...] by rate; ``goodputs[same key]`` = line. Raises ``ValueError``
    naming the line that is not a JSON object with the needed fields."""
    points, goodputs = defaultdict(list), {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(line, dict) or line.get("bench") != "wallclock-router":
            continue
        try:
            key = (line["model"], line["workload"], int(line["seed"]), line["system"])
            if line["kind"] == "point":
                line["rate"], line["attainment"] = float(line["rate"]), float(line["attainment"])
                line["slo"]["ttft_s"], line["slo"]["tpot_s"]  # noqa: B018 -- must be there
                points[key].append(line)
            elif line["kind"] == "goodput":
                goodputs[key] = line
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{n}: bad or missing field {e}") from None
    for lines in points.values():
        lines.sort(key=lambda x: x["rate"])
    return dict(points), goodputs


def goodput(points: list[tuple[float, float]]) -> float:
    """The highest rate whose attainment is at least :data:`TARGET` (0 if none)."""
    return max((r for r, a in points if a >= TARGET), default=0.0)


def compare(
    real_points: dict, real_goodputs: dict, profiles: dict, settings, drain_s, own_slo=False,
    from_idle=True,
) -> list:  # fmt: skip
    """One "point" row per real point and one "goodput" row per (model, workload, seed,
    system), each with the simulated figure beside the real one. ``own_slo``: the SLO rule
    applied to the simulated server's own batch-size-1 latencies (default: the real run's
    thresholds; both attainments are in the rows). ``from_idle``: the background load and the cost per
    request taken from the real run's idle figures (:func:`idle_costs`; else as given)."""
    from tokenlake.benchmarks.wallclock.client import ALPHABET
    from tokenlake.benchmarks.wallclock.workloads import build_workload

    rows, cache = [], {}
    for (model, workload, seed, system), lines in sorted(real_points.items()):
        if system not in SYSTEMS or model not in profiles:
            continue
        n = int(lines[0]["num_requests"])
        if (model, workload, seed, n) not in cache:
            timed = build_workload(workload, seed=seed, num_requests=n, vocab_size=len(ALPHABET))
            reqs = to_requests(
                [t.prompt_ids for t in timed], [t.max_tokens for t in timed], settings.segment_len
            )
            cache[(model, workload, seed, n)] = (timed, reqs)
        timed, reqs = cache[(model, workload, seed, n)]
        cfg = dataclasses.replace(
            settings, num_instances=int(lines[0].get("num_instances", settings.num_instances))
        )
        if from_idle:
            cfg = idle_costs(profiles[model], cfg, timed, lines[0]["slo"], settings.segment_len)
        own = sim_slo(profiles[model], cfg, timed, settings.segment_len)
        sim_points, real_pts = [], []
        for line in lines:
            rate, real_slo = line["rate"], line["slo"]
            slo = own if own_slo else real_slo
            arrivals = [
                Arrival(r, t.arrival_s / rate, t.session_id)
                for r, t in zip(reqs, timed, strict=True)
            ]
            limit = max(a.send_s for a in arrivals) + drain_s
            records, load = simulate_served(
                system, profiles[model], cfg, arrivals, limit, settings.segment_len
            )
            sim = attainment(records, slo["ttft_s"], slo["tpot_s"])
            by_rule = attainment(records, own["ttft_s"], own["tpot_s"])
            ttfts = [r.first_token_s - r.arrival_s if r.num_tokens else math.inf for r in records]
            tpots = [
                (r.last_token_s - r.first_token_s) / (r.num_tokens - 1) if r.num_tokens > 1 else 0.0
                for r in records
            ]
            sim_points.append((rate, sim))
            real_pts.append((rate, line["attainment"]))
            rows.append({
                "bench": "sim-vs-real", "kind": "point", "model": model, "workload": workload,
                "seed": seed, "system": system, "num_instances": cfg.num_instances,
                "rate": rate, "num_requests": n, "slo": real_slo, "sim_slo": own,
                "slo_used": "sim's own" if own_slo else "real",
                "background_threads": cfg.background_threads,
                "request_overhead_s": cfg.request_overhead_s,
                "real_attainment": line["attainment"], "sim_attainment": round(sim, 4),
                "error_points": round(100 * (sim - line["attainment"]), 1),
                "sim_attainment_by_rule": round(by_rule, 4),
                "solo_ttft_real_over_sim": round(real_slo["ttft_s"] / own["ttft_s"], 3),
                "solo_tpot_real_over_sim": round(real_slo["tpot_s"] / own["tpot_s"], 3),
                "real_ttft_p90_s": line.get("ttft_p90_s"), "sim_ttft_p90_s": _p90(ttfts),
                "real_tpot_p90_s": line.get("tpot_p90_s"), "sim_tpot_p90_s": _p90(tpots),
                "real_max_gap_p90_s": line.get("max_gap_p90_s"),
                "sim_max_gap_p90_s": _p90([r.max_tbt_s if r.finished else math.inf
                                           for r in records]),
                "real_hit_rate": line.get("hit_rate"), "sim_hit_rate": round(hit_rate(records), 4),
                "real_load_cv": line.get("load_cv"), "sim_load_cv": round(load.cv(), 4),
            })  # fmt: skip
        real_g = real_goodputs.get((model, workload, seed, system), {}).get("p90_goodput")
        real_g = goodput(real_pts) if real_g is None else float(real_g)
        sim_g = goodput(sim_points)
        rows.append({
            "bench": "sim-vs-real", "kind": "goodput", "model": model, "workload": workload,
            "seed": seed, "system": system, "real_p90_goodput": real_g,
            "sim_p90_goodput": sim_g,
            "error": round(sim_g / real_g - 1, 3) if real_g > 0 else None,
        })  # fmt: skip
    return rows


def table(rows: list[dict]) -> list[str]:
    """The markdown table: per model x workload x system, attainment real / simulated at
    each rate (every seed's points), median P90 goodput over seeds, and the errors."""
    groups = defaultdict(lambda: {"points": [], "goodputs": []})
    for r in rows:
        g = groups[(r["model"], r["workload"], r["system"])]
        g["points" if r["kind"] == "point" else "goodputs"].append(r)
    out = [
        "| model | workload | system | attainment real / sim at rate (req/s) | max error "
        "| P90 goodput real / sim (median over seeds) | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for (model, workload, system), g in sorted(groups.items()):
        by_rate = defaultdict(list)
        for p in g["points"]:
            by_rate[p["rate"]].append((p["real_attainment"], p["sim_attainment"]))
        cells = ", ".join(
            f"{rate:g}: {_pct(statistics.median(a for a, _ in v))} / "
            f"{_pct(statistics.median(s for _, s in v))}"
            for rate, v in sorted(by_rate.items())
        )
        worst = max((abs(p["error_points"]) for p in g["points"]), default=0.0)
        real = statistics.median(x["real_p90_goodput"] for x in g["goodputs"])
        sim = statistics.median(x["sim_p90_goodput"] for x in g["goodputs"])
        err = f"{sim / real - 1:+.0%}" if real > 0 else "—"
        ok = worst <= 100 * ATTAINMENT_TOLERANCE and real > 0 and abs(sim / real - 1) <= 0.25
        out.append(
            f"| {model} | {workload} | {system} | {cells} | {worst:.0f} pts | {real:g} / {sim:g} "
            f"| {err}{'' if ok else ' (misses)'} |"
        )
    return out


def _p90(values: list[float]) -> float | None:
    """The wall-clock bench's P90 (linear interpolation; None where a request never got
    there, as its inf)."""
    arr = np.asarray(values, dtype=float)
    return round(float(np.percentile(arr, 90)), 6) if np.isfinite(arr).all() else None


def _pct(x: float) -> str:
    return f"{x:.0%}"


def load_profiles(files: list[Path], models: set[str], repeats: int) -> dict[str, CpuProfile]:
    profiles = {}
    for f in files:
        profile = load_cpu_profile(f)
        profiles[profile.name] = profile
    for model in sorted(models - set(profiles)):
        from tokenlake.benchmarks.calibrate.hardware import calibrate

        print(f"calibrating {model} (no --hardware-profile for it)", file=sys.stderr)
        profiles[model] = calibrate(model, repeats, quick=False)
    return profiles


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--real", type=Path, required=True, help="the wall-clock bench's JSON lines")
    p.add_argument(
        "--hardware-profile", type=Path, action="append", default=[], metavar="FILE",
        help="a profile from tokenlake bench calibrate-cpu (one per model; repeatable)",
    )  # fmt: skip
    p.add_argument("--segment-len", type=int, default=32, help="the real servers' flag")
    p.add_argument("--num-slots", type=int, default=96, help="the real servers' flag")
    p.add_argument("--chunk-len", type=int, default=256, help="the real servers' flag")
    p.add_argument("--drain-s", type=float, default=30.0, help="the real runs' cap after arrivals")
    p.add_argument(
        "--request-overhead-ms", type=float, default=None,
        help="the serving path's cost per request with --idle-costs none (default 0)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="calibration runs per case")
    p.add_argument(
        "--compute-lanes", type=int, default=1,
        help="batches a server computes at once: 1 as tokenlake serve sets it; 0 for runs of "
        "a serve from before it did (one per instance)",
    )  # fmt: skip
    p.add_argument(
        "--idle-costs", choices=("solo", "none"), default="solo",
        help="solo: the host's background load and the cost per request from the real run's "
        "batch-size-1 figures; none: no background, --request-overhead-ms per request",
    )  # fmt: skip
    p.add_argument(
        "--slo", choices=("thresholds", "rule"), default="thresholds",
        help="thresholds: the real runs' numbers; rule: 10x the simulated server's own "
        "batch-size-1 latencies (as the real bench derives its thresholds)",
    )  # fmt: skip
    args = p.parse_args(argv)
    try:
        real_points, real_goodputs = read_real(args.real)
        if not real_points:
            raise ValueError(f"{args.real}: no wallclock-router point lines")
        models = {k[0] for k in real_points}
        profiles = load_profiles(args.hardware_profile, models, args.repeats)
    except (OSError, ValueError) as e:  # a bad file: say which and why, no traceback
        p.error(str(e))
    overhead = args.request_overhead_ms
    settings = ServedSettings(
        segment_len=args.segment_len, num_slots=args.num_slots, chunk_len=args.chunk_len,
        request_overhead_s=0.0 if overhead is None else overhead / 1e3,
        compute_lanes=args.compute_lanes,
    )  # fmt: skip
    rows = compare(
        real_points, real_goodputs, profiles, settings, args.drain_s, args.slo == "rule",
        args.idle_costs == "solo",
    )  # fmt: skip
    print("\n".join(table(rows)))
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
