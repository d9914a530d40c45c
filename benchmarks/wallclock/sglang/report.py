"""The SGLang wall-clock bench's table: per model, N and workload, each system's P90 goodput
(median over seeds, min-max), hit rate, load CV and CPU seconds per output token (medians over
seeds at the search's first rate, which every system ran), and the best TokenLake policy's
ratio to the tuned cache-aware router (median of the per-seed ratios, min-max)."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median

TOKENLAKE_PREFIX = "tokenlake-"
TUNED = "cache_aware-tuned"


def _median_range(values: list[float]) -> tuple[float, float, float]:
    return (median(values), min(values), max(values)) if values else (0.0, 0.0, 0.0)


def summarize(lines: Sequence[dict]) -> list[dict]:
    """One row per (model, num_servers, workload): ``systems`` {name: figures} and ratios."""
    good = [ln for ln in lines if ln["kind"] == "goodput"]
    rows = []
    for model, n, workload in sorted({(g["model"], g["num_servers"], g["workload"]) for g in good}):
        mine = [g for g in good if (g["model"], g["num_servers"], g["workload"]) == (model, n, workload)]  # fmt: skip
        seeds = sorted({g["seed"] for g in mine})
        by = {(g["system"], g["seed"]): g for g in mine}
        systems = {}
        for system in sorted({g["system"] for g in mine}):
            firsts = []
            for s in seeds:
                g = by.get((system, s))
                pts = [ln for ln in lines if ln["kind"] == "point" and g is not None
                       and (ln["model"], ln["num_servers"], ln["workload"], ln["seed"],
                            ln["system"]) == (model, n, workload, s, g["router"])]  # fmt: skip
                if pts:
                    firsts.append(pts[0])
            gp = [by[(system, s)]["p90_goodput"] for s in seeds if (system, s) in by]
            cpu = [p["cpu_s_per_output_token"] for p in firsts if p["cpu_s_per_output_token"]]
            systems[system] = {
                "goodput": _median_range(gp),
                "resolved": all(
                    by[(system, s)]["slo_missed_in_sweep"] for s in seeds if (system, s) in by
                ),  # fmt: skip
                "hit_rate": median(p["hit_rate"] for p in firsts) if firsts else 0.0,
                "load_cv": median(p["load_cv"] for p in firsts) if firsts else 0.0,
                "cpu_per_token": median(cpu) if cpu else 0.0,
            }
        baseline = TUNED if TUNED in systems else "cache_aware"
        ratios = []
        for s in seeds:
            ref = by.get((baseline, s), {}).get("p90_goodput")
            best = max((by[(k, s)]["p90_goodput"] for k in systems
                        if k.startswith(TOKENLAKE_PREFIX) and (k, s) in by), default=0.0)  # fmt: skip
            if ref:
                ratios.append(best / ref)
        rows.append({"model": model, "num_servers": n, "workload": workload, "seeds": seeds,
                     "systems": systems, "baseline": baseline,
                     "ratio": _median_range(ratios) if ratios else None})  # fmt: skip
    return rows


def format_table(lines: Sequence[dict]) -> str:
    head = (f"{'model':<12} {'N':>2} {'workload':<24} {'system':<24} {'P90 goodput req/s':>22} "
            f"{'hit':>6} {'load CV':>8} {'CPU s/tok':>10}")  # fmt: skip
    out = [head, "-" * len(head)]
    for r in summarize(lines):
        for name, s in r["systems"].items():
            mid, lo, hi = s["goodput"]
            value = f"{'' if s['resolved'] else '>='}{mid:.2f} ({lo:.2f}-{hi:.2f})"
            out.append(f"{r['model']:<12} {r['num_servers']:>2} {r['workload']:<24} {name:<24} "
                       f"{value:>22} {s['hit_rate']:>6.1%} {s['load_cv']:>8.1%} "
                       f"{s['cpu_per_token']:>10.4f}")  # fmt: skip
        if r["ratio"] is not None:
            mid, lo, hi = r["ratio"]
            out.append(f"{'':<12} {'':>2} {'':<24} best TokenLake / {r['baseline']}: "
                       f"{mid:.2f}x ({lo:.2f}-{hi:.2f}) over seeds {r['seeds']}")  # fmt: skip
    out.append("goodput: median over seeds (min-max); '>=': some seed met the SLO at every rate "
               "tried; hit rate, load CV (of the tokens each server computed) and CPU seconds per "
               "output token (every process of the side): medians at the first rate")  # fmt: skip
    return "\n".join(out)
