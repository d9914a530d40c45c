"""The wall-clock bench's table: per model and workload, each system's P90 goodput (median over
seeds, min-max), hit rate and load CV (medians over seeds at the sweep's first rate, which
both systems ran), and TokenLake's ratio to the router."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median


def _first_point(lines, model, workload, seed, system) -> dict | None:
    points = [ln for ln in lines if ln["kind"] == "point" and ln["system"] == system
              and (ln["model"], ln["workload"], ln["seed"]) == (model, workload, seed)]  # fmt: skip
    return points[0] if points else None


def summarize(lines: Sequence[dict]) -> list[dict]:
    """One row per (model, workload) with both systems' medians and ranges."""
    rows = []
    keys = sorted({(ln["model"], ln["workload"]) for ln in lines if ln["kind"] == "goodput"})
    for model, workload in keys:
        row: dict = {"model": model, "workload": workload}
        ratios = []
        seeds = sorted({ln["seed"] for ln in lines if ln["kind"] == "goodput"
                        and (ln["model"], ln["workload"]) == (model, workload)})  # fmt: skip
        for system in ("tokenlake", "router"):
            good = {ln["seed"]: ln for ln in lines if ln["kind"] == "goodput"
                    and (ln["model"], ln["workload"], ln["system"]) == (model, workload, system)}  # fmt: skip
            values = [good[s]["p90_goodput"] for s in seeds if s in good]
            firsts = [p for s in seeds if (p := _first_point(lines, model, workload, s, system))]
            tried = [r for s in seeds if s in good for r, _ in good[s].get("points", [])]
            row[system] = {
                "lowest_tried": min(tried) if tried else 0.0,
                "goodput": median(values) if values else 0.0,
                "range": (min(values), max(values)) if values else (0.0, 0.0),
                "resolved": all(good[s]["slo_missed_in_sweep"] for s in seeds if s in good),
                "hit_rate": median(p["hit_rate"] for p in firsts) if firsts else 0.0,
                "load_cv": median(p["load_cv"] for p in firsts) if firsts else 0.0,
            }
        for s in seeds:
            t = [ln for ln in lines if ln["kind"] == "goodput" and ln["seed"] == s
                 and (ln["model"], ln["workload"]) == (model, workload)]  # fmt: skip
            by = {ln["system"]: ln["p90_goodput"] for ln in t}
            if by.get("router"):
                ratios.append(by.get("tokenlake", 0.0) / by["router"])
        row["ratio"] = median(ratios) if ratios else None
        row["ratio_range"] = (min(ratios), max(ratios)) if ratios else None
        rows.append(row)
    return rows


def format_table(lines: Sequence[dict]) -> str:
    head = (f"{'model':<12} {'workload':<14} {'TokenLake req/s':>20} {'router req/s':>20} "
            f"{'ratio':>15} {'hit TL/router':>14} {'load CV TL/router':>18}")  # fmt: skip
    out = [head, "-" * len(head)]
    for r in summarize(lines):
        cells = []
        for system in ("tokenlake", "router"):
            s = r[system]
            at_least = "" if s["resolved"] else ">="
            value = f"{at_least}{s['goodput']:.2f}"
            if s["goodput"] == 0 and s["lowest_tried"]:  # missed at every rate tried
                value = f"<{s['lowest_tried']:.2f}"
            cells.append(f"{value} ({s['range'][0]:.2f}-{s['range'][1]:.2f})")
        ratio = "-" if r["ratio"] is None else (
            f"{r['ratio']:.2f}x ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})")  # fmt: skip
        t, k = r["tokenlake"], r["router"]
        out.append(f"{r['model']:<12} {r['workload']:<14} {cells[0]:>20} {cells[1]:>20} "
                   f"{ratio:>15} {t['hit_rate']:>6.1%}/{k['hit_rate']:<6.1%} "
                   f"{t['load_cv']:>8.1%}/{k['load_cv']:<8.1%}")  # fmt: skip
    out.append("goodput: median over seeds (min-max); '>=': some seed met the SLO at every rate "
               "tried; '<': the median missed it at every rate tried (0 in the JSON); hit rate "
               "and load CV at the sweep's first rate")  # fmt: skip
    return "\n".join(out)
