"""What the goodput harness prints and writes: one JSON line per run, stall warnings, the
results table, ``summary.json`` and the plots."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from tokenlake.benchmarks.goodput.runs import knob_label, knob_prefill
from tokenlake.benchmarks.goodput.sim_options import describe
from tokenlake.benchmarks.sim.confidence import SystemGoodput
from tokenlake.benchmarks.sim.metrics import hit_rate
from tokenlake.benchmarks.sim.runner import RunResult
from tokenlake.benchmarks.sim.step_timer import ClusterSpec
from tokenlake.benchmarks.workloads import Workload


def infinite_hit_rate(w: Workload) -> float:
    """Token share of prompts an infinite shared prefix cache would serve (whole blocks)."""
    seen, hit, total = set(), 0, 0
    for r in sorted(w.requests, key=lambda r: (r.arrival_s, r.rid)):
        k = 0
        while k < len(r.block_ids) and r.block_ids[k] in seen:
            k += 1
        hit += min(k * w.block_size, r.input_len - 1)
        total += r.input_len
        seen.update(r.block_ids)
    return hit / total if total else 0.0


def _latency_ms(res: RunResult) -> tuple[float | None, float | None]:
    done = [r for r in res.records if r.finished]
    if not done:
        return None, None
    ttft = 1e3 * float(np.mean([r.input_token_latency for r in done]))
    tbt = [(r.finish_s - r.first_token_s) / max(r.output_len - 1, 1) for r in done]
    return ttft, 1e3 * float(np.mean(tbt))


class GoodputReport:
    def __init__(self, args: argparse.Namespace, spec: ClusterSpec, knobs_of=None) -> None:
        """``knobs_of(system)``: the knob values swept for a system (its first is its
        setting outside --goodput)."""
        self.args, self.spec = args, spec
        self.knobs_of = knobs_of or (lambda system: list(args.prefill_tokens))
        self.name = args.workload or Path(args.trace).name.split(".")[0]
        self.out = Path(args.out) if args.out else None
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "runs.jsonl").unlink(missing_ok=True)
        self.summary: dict = {"workload": self.name, "systems": {}}
        self.goodputs: dict[str, SystemGoodput] = {}
        self.totals: dict[str, dict] = defaultdict(lambda: defaultdict(int))

    # ---- output --------------------------------------------------------------------------
    def log(self, line: dict) -> None:
        print(json.dumps(line), flush=True)
        if self.out:
            with open(self.out / "runs.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")

    def warn(self, message: str) -> None:
        print(f"WARNING: {message}", file=sys.stderr, flush=True)

    def header(self, probe: Workload, seeds: list[int]) -> None:
        a, spec = self.args, self.spec
        self.summary.update(requests=probe.num_requests, seeds=seeds, note=probe.note)
        print(
            f"goodput harness: {self.name} ({probe.note}), {probe.num_requests} requests per "
            f"run; {spec.num_instances} instances x TP{spec.tp} {spec.hardware}, {spec.model}, "
            f"{spec.capacity_tokens:,} KV tokens per instance; TokenLake segment "
            f"{a.segment_len}; prefill knob {a.prefill_tokens}, baselines "
            f"{getattr(a, 'baseline_prefill_tokens', a.prefill_tokens)}; page groups "
            f"{getattr(a, 'page_groups', 'on')}; router mixed chunked prefill "
            f"{'on' if a.mixed_chunk else 'off'}; seeds {seeds}; infinite-cache prefix hit "
            f"rate {infinite_hit_rate(probe):.1%}; {describe(a)}",
            flush=True,
        )

    @staticmethod
    def seeds_vary(a: Workload, b: Workload) -> bool:
        return [(r.arrival_s, r.block_ids) for r in a.requests] != [
            (r.arrival_s, r.block_ids) for r in b.requests
        ]

    def run(self, res: RunResult, rate, seed: int, knob: int, spec: ClusterSpec) -> None:
        s = res.summary()
        line = {"workload": self.name, "rate": None if rate is None else round(rate, 4)}
        line.update(seed=seed, prefill_tokens=knob_prefill(knob), **s)
        if knob_label(knob) != str(knob_prefill(knob)):
            line["knob"] = knob_label(knob)
        if spec.cache_tokens:
            line["cache_tokens"] = spec.cache_tokens
        self.log(line)
        t = self.totals[res.system]
        t["runs"] += 1
        t["stalled_runs"] += s["stalled"] > 0
        t["stalled_requests"] += s["stalled"]
        t["rejected_requests"] += s["rejected"]
        if s["stalled"]:
            at = "its own timing" if rate is None else f"{rate:.4g} req/s"
            self.warn(
                f"{res.system} on {self.name} at {at}, seed {seed}: {s['stalled']} of "
                f"{s['total']} requests stalled (never finished; run stopped: {s['stop']})"
            )

    # ---- goodput -------------------------------------------------------------------------
    def goodput(self, system: str, g: SystemGoodput) -> None:
        self.goodputs[system] = g
        print(
            f"{system}: P90 goodput {g.median:.3g} req/s [{g.low:.3g}-{g.high:.3g}] at "
            f"prefill {knob_label(g.knob)} (seed {self.args.seed}: "
            + ", ".join(f"{knob_label(k)}: {v:.3g}" for k, v in g.by_knob.items())
            + ")",
            file=sys.stderr,
            flush=True,
        )

    def knob_of(self, system: str):
        g = self.goodputs.get(system)
        return g.knob if g else self.knobs_of(system)[0]

    def unresolved(self, system: str, where: str) -> None:
        """A run of this system's bisection was still cut by the wall budget after its
        re-runs: no goodput is reported for it (never a failure)."""
        self.warn(f"{system}: unresolved ({where} cut by --wall-budget; raise it)")
        self.summary["systems"][system] = {"unresolved": where}

    def at_own_goodput(self, system: str, results: list[RunResult], rates: list[float]) -> None:
        """Hit rate and load CV of ``system`` at its own goodput, seed by seed (``rates``):
        at another system's goodput a system may reject or stall most requests."""
        g = self.goodputs[system]
        t, loads = results[0].load.matrix()
        self.summary["systems"][system] = {
            "p90_goodput": round(g.median, 4),
            "lower_bound": g.lower_bound,
            "p90_goodput_min": round(g.low, 4),
            "p90_goodput_max": round(g.high, 4),
            "goodputs": [round(x, 4) for x in g.goodputs],
            "prefill_tokens": knob_prefill(g.knob),
            "knob": knob_label(g.knob),
            "by_prefill_tokens": {knob_label(k): round(v, 4) for k, v in g.by_knob.items()},
            "points": [[s, knob_label(k), round(r, 4), a] for s, k, r, a in g.points],
            "rates": [round(r, 4) for r in rates],
            "hit_rate": round(statistics.median(hit_rate(r.records) for r in results), 4),
            "load_cv": round(statistics.median(r.load.cv() for r in results), 4),
            "load_times": t.tolist(),
            "loads": loads.tolist(),
        }

    def goodput_table(self) -> None:
        rows = self.summary["systems"]
        print(
            f"\nP90 goodput (median [min-max] over seeds {self.summary['seeds']}), each system at "
            "its best prefill setting; hit rate and load CV at each system's own goodput"
        )
        head = f"{'system':24s} {'prefill':>16s} {'P90 goodput (req/s)':>24s} {'hit':>6s}"
        print(head + f" {'CV':>6s} {'runs':>5s} {'stalled':>8s} {'rejected':>8s}")
        for s, r in rows.items():
            t = self.totals[s]
            if "unresolved" in r:
                print(f"{s:24s} {'':>16s} {'unresolved':>24s} ({r['unresolved']})")
                continue
            ge = ">=" if r["lower_bound"] else ""
            rng = f"{ge}{r['p90_goodput']:.3g} [{r['p90_goodput_min']:.3g}-{r['p90_goodput_max']:.3g}]"
            print(
                f"{s:24s} {r['knob']:>16s} {rng:>24s} {r['hit_rate']:>6.1%} "
                f"{r['load_cv']:>6.1%} {t['runs']:>5d} {t['stalled_requests']:>8d} "
                f"{t['rejected_requests']:>8d}"
            )
        for s, r in rows.items():
            t = self.totals[s]
            self.log(
                {
                    "workload": self.name,
                    "system": s,
                    **{k: v for k, v in r.items() if k not in ("load_times", "loads", "points")},
                    "runs": t["runs"],
                    "stalled_runs": t["stalled_runs"],
                    "stalled_requests": t["stalled_requests"],
                    "rejected_requests": t["rejected_requests"],
                }
            )

    # ---- other modes ---------------------------------------------------------------------
    def replay(self, system: str, results: list[RunResult]) -> None:
        att = [r.summary()["slo_attainment"] for r in results]
        self.summary.setdefault("replay", {})[system] = {
            "slo_attainment": round(statistics.median(att), 4),
            "slo_attainment_min": min(att),
            "slo_attainment_max": max(att),
            "hit_rate": round(statistics.median(hit_rate(r.records) for r in results), 4),
            "load_cv": round(statistics.median(r.load.cv() for r in results), 4),
        }

    def replay_table(self) -> None:
        """One row per system of the replay at the trace's own timing."""
        print("\nReplay at the trace's own timing (median [min-max] over seeds)")
        print(f"{'system':16s} {'prefill':>7s} {'SLO attainment':>22s} {'hit':>6s} {'CV':>6s}")
        for s, r in self.summary["replay"].items():
            att = f"{r['slo_attainment']:.1%} [{r['slo_attainment_min']:.0%}-"
            att += f"{r['slo_attainment_max']:.0%}]"
            print(
                f"{s:16s} {knob_label(self.knob_of(s)):>7s} {att:>22s} {r['hit_rate']:>6.1%} "
                f"{r['load_cv']:>6.1%}"
            )

    def sweep_point(self, system: str, rate: float, res: RunResult) -> None:
        ttft, tbt = _latency_ms(res)
        s = res.summary()
        self.summary.setdefault("sweep", {}).setdefault(system, []).append(
            {
                "rate": rate,
                "slo_attainment": s["slo_attainment"],
                "input_token_latency_ms": ttft,
                "output_token_latency_ms": tbt,
                "hit_rate": s["hit_rate"],
                "load_cv": s["load_cv"],
            }
        )

    def cache_point(self, system: str, fraction: float, res: RunResult) -> None:
        s = res.summary()
        self.summary.setdefault("cache", {}).setdefault(system, []).append(
            {"fraction": fraction, "hit_rate": s["hit_rate"], "load_cv": s["load_cv"]}
        )

    def finish(self) -> dict:
        self.summary["totals"] = {s: dict(t) for s, t in self.totals.items()}
        self.summary["stalled_requests"] = sum(t["stalled_requests"] for t in self.totals.values())
        if self.summary["stalled_requests"]:
            self.warn(f"{self.summary['stalled_requests']} requests stalled over all runs")
        if self.out:
            (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1))
            from tokenlake.benchmarks.goodput.plots import plot_all

            plot_all(self.out, self.summary)
        return self.summary
