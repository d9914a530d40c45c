"""The goodput harness (DESIGN §5): replay a workload through simulated clusters, sweep the
request rate, and report P90 goodput, hit rate and per-instance load CV per system.

    python -m benchmarks.goodput --workload conversation --goodput            # the table row
    python -m benchmarks.goodput --workload loogle --rates 0.1,0.2,0.4        # latency vs rate
    python -m benchmarks.goodput --workload loogle --cache-fractions 0.25,0.5,1 --rate 0.2

TokenLake runs through the real ``tokenlake.Pool`` and ``tokenlake.scheduler``; the baselines
(SGLang-Router, Mooncake xPyD) run in the same event loop and step timer. Request counts are
scaled down from the paper's runs so a sweep fits 2 CPU cores; the output says how many.
Prints one JSON line per simulation and a table; ``--out DIR`` also writes ``runs.jsonl``,
``summary.json`` and, with matplotlib installed, PNG plots.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.progress import Progress
from benchmarks.sim.metrics import bisect_goodput
from benchmarks.sim.runner import SYSTEMS, RunConfig, RunResult, simulate
from benchmarks.sim.step_timer import ClusterSpec, make_timer
from benchmarks.traces import CONVERSATION_TRACE, SYNTHETIC_TRACE, TRACES_DIR
from benchmarks.workloads import GENERATORS, GeneratorConfig, TraceConfig, Workload, trace_workload

TRACES = {
    # name: (path, default first request, jitter bucket in s)
    "conversation": (CONVERSATION_TRACE, 3000, 3.0),
    "synthetic": (SYNTHETIC_TRACE, 0, 0.0),
    "ragpulse": (TRACES_DIR / "ragpulse" / "ragpulse_blocks512.jsonl.gz", 0, 1.0),
}
DEFAULT_REQUESTS = {"scbench": 40, "agentic": 300}


def make_workload(args, rate: float) -> Workload:
    n = args.requests or DEFAULT_REQUESTS.get(args.workload, 200)
    if args.workload in TRACES:
        path, offset, jitter = TRACES[args.workload]
        offset = args.offset if args.offset is not None else offset
        cfg = TraceConfig(path, n, offset, rate, jitter, seed=args.seed)
        return trace_workload(cfg)
    cfg = GeneratorConfig(n, rate, args.system_prompt, seed=args.seed)
    return GENERATORS[args.workload](cfg)


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


def run_one(args, spec, timer, system: str, rate: float, log) -> RunResult:
    w = make_workload(args, rate)
    cfg = RunConfig(
        system,
        chunk_len=args.chunk,
        wall_budget_s=args.wall_budget,
        window_s=args.window,
        max_prefill_tokens=args.tl_max_prefill,
    )
    res = simulate(w, spec, timer, cfg)
    line = {"workload": args.workload, "rate": round(rate, 4), **res.summary()}
    log(line)
    return res


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--workload", default="conversation", choices=sorted(TRACES) + sorted(GENERATORS)
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {SYSTEMS}")
    p.add_argument(
        "--requests", type=int, default=0, help="requests per run (0: per-workload default)"
    )
    p.add_argument("--offset", type=int, default=None, help="first trace request")
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--tp", type=int, default=2, help="GPUs per instance (the paper: 2)")
    p.add_argument("--hardware", default="A100-80G")
    p.add_argument("--model", default="LWM-Text-1M")
    p.add_argument("--chunk", type=int, default=8192, help="chunked prefill size, every system")
    p.add_argument(
        "--tl-max-prefill",
        type=int,
        default=2048,
        help="TokenLake scheduler: prefill tokens per iteration (0: chunk x N)",
    )
    p.add_argument("--system-prompt", type=int, default=4096, help="generators' shared prompt")
    p.add_argument("--goodput", action="store_true", help="P90 goodput by bisection on the rate")
    p.add_argument("--lo", type=float, default=0.25, help="bisection start (req/s)")
    p.add_argument("--hi", type=float, default=1.0, help="bisection upper start (req/s)")
    p.add_argument("--rel-tol", type=float, default=0.15)
    p.add_argument("--rates", default="", help="comma list: SLO/latency sweep")
    p.add_argument("--rate", type=float, default=0.0, help="rate for --cache-fractions / load")
    p.add_argument("--cache-fractions", default="", help="comma list of KV capacity fractions")
    p.add_argument("--window", type=float, default=5.0, help="load timeline window (s)")
    p.add_argument("--wall-budget", type=float, default=300.0, help="real seconds per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="directory for runs.jsonl, summary.json, plots")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"--systems: unknown {s!r}; expected {SYSTEMS}")
    spec = ClusterSpec(args.hardware, args.model, args.instances, args.tp)
    timer = make_timer(spec)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    runs = open(out / "runs.jsonl", "a") if out else None  # noqa: SIM115

    def log(line: dict) -> None:
        print(json.dumps(line), flush=True)
        if runs:
            runs.write(json.dumps(line) + "\n")
            runs.flush()

    probe = make_workload(args, 1.0)
    print(
        f"goodput harness: {args.workload} ({probe.note}), {probe.num_requests} requests per run "
        f"(scaled down from the paper's runs); {args.instances} instances x TP{args.tp} "
        f"{args.hardware}, {args.model}, {spec.capacity_tokens:,} KV tokens per instance; "
        f"chunked prefill {args.chunk}; infinite-cache prefix hit rate of this workload "
        f"{infinite_hit_rate(probe):.1%}",
        flush=True,
    )
    summary: dict = {"workload": args.workload, "requests": probe.num_requests, "systems": {}}
    if args.goodput:
        summary["systems"] = goodput_table(args, spec, timer, systems, log)
    if args.rates:
        rates = [float(x) for x in args.rates.split(",")]
        summary["sweep"] = sweep(args, spec, timer, systems, rates, log, out)
    if args.cache_fractions:
        fracs = [float(x) for x in args.cache_fractions.split(",")]
        summary["cache"] = cache_sweep(args, spec, systems, fracs, log)
    if out:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        from benchmarks.goodput_plots import plot_all

        plot_all(out, summary)
    return 0


def goodput_table(args, spec, timer, systems, log) -> dict:
    rows, results = {}, {}
    progress = Progress(len(systems), "systems")
    for i, s in enumerate(systems):
        last: dict = {}

        def attainment(rate: float, s=s, last=last) -> float:
            res = run_one(args, spec, timer, s, rate, log)
            a = res.summary()["slo_attainment"]
            if a >= 0.9 and rate >= last.get("rate", 0):
                last.update(rate=rate, result=res)
            return a

        g = bisect_goodput(attainment, args.lo, args.hi, 0.9, args.rel_tol)
        results[s] = last.get("result")
        rows[s] = {"p90_goodput": round(g.goodput, 4), "points": g.points}
        progress.update(i + 1, f"{s}: {g.goodput:.3g} req/s", force=True)
    progress.close()
    # Hit rate and load CV at one common rate, as the paper's Fig. 10: near TokenLake's goodput.
    ref = rows.get("tokenlake", {}).get("p90_goodput") or max(
        [r["p90_goodput"] for r in rows.values()] + [args.lo]
    )
    ref = ref or args.lo
    print(f"hit rate and load CV at {ref:.3g} req/s (TokenLake's P90 goodput)")
    for s in systems:
        res = run_one(args, spec, timer, s, ref, log)
        t, loads = res.load.matrix()
        rows[s].update(
            hit_rate=res.summary()["hit_rate"],
            load_cv=res.summary()["load_cv"],
            ref_rate=round(ref, 4),
            load_times=t.tolist(),
            loads=loads.tolist(),
        )
    print(f"\n{'system':16s} {'P90 goodput':>12s} {'hit rate':>9s} {'load CV':>8s}")
    for s in systems:
        r = rows[s]
        print(f"{s:16s} {r['p90_goodput']:>9.3g} r/s {r['hit_rate']:>9.1%} {r['load_cv']:>8.1%}")
    for s in systems:
        r = rows[s]
        log(
            {
                "workload": args.workload,
                "system": s,
                "p90_goodput": r["p90_goodput"],
                "hit_rate": r["hit_rate"],
                "load_cv": r["load_cv"],
                "ref_rate": r["ref_rate"],
            }
        )
    return rows


def sweep(args, spec, timer, systems, rates, log, out) -> dict:
    table = {}
    for s in systems:
        pts = []
        for rate in rates:
            res = run_one(args, spec, timer, s, rate, log)
            done = [r for r in res.records if r.finished]
            pts.append(
                {
                    "rate": rate,
                    "slo_attainment": res.summary()["slo_attainment"],
                    "input_token_latency_ms": 1e3
                    * float(np.mean([r.input_token_latency for r in done]))
                    if done
                    else None,
                    "output_token_latency_ms": 1e3
                    * float(
                        np.mean(
                            [
                                (r.finish_s - r.first_token_s) / max(r.output_len - 1, 1)
                                for r in done
                            ]
                        )
                    )
                    if done
                    else None,
                    "hit_rate": res.summary()["hit_rate"],
                    "load_cv": res.summary()["load_cv"],
                }
            )
        table[s] = pts
    return table


def cache_sweep(args, spec, systems, fracs, log) -> dict:
    rate = args.rate or args.lo
    table = {}
    for s in systems:
        pts = []
        for f in fracs:
            sp = ClusterSpec(
                spec.hardware,
                spec.model,
                spec.num_instances,
                spec.tp,
                cache_tokens=max(1024, int(spec.capacity_tokens * f)),
            )
            res = run_one(args, sp, make_timer(sp), s, rate, log)
            pts.append(
                {
                    "fraction": f,
                    "cache_tokens": sp.capacity_tokens,
                    "hit_rate": res.summary()["hit_rate"],
                    "load_cv": res.summary()["load_cv"],
                }
            )
        table[s] = pts
    return table


if __name__ == "__main__":
    sys.exit(main())
