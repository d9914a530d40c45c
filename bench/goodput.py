"""The goodput harness (DESIGN §5): replay a workload through simulated clusters, sweep the
request rate, and report P90 goodput, hit rate and per-instance load CV per system.

    python -m tokenlake.bench.goodput --workload conversation --goodput          # a table row
    python -m tokenlake.bench.goodput --trace my_trace.jsonl.gz --goodput        # your own trace
    python -m tokenlake.bench.goodput --trace t.jsonl.xz --time-scale 0.5        # one replay, 2x speed
    python -m tokenlake.bench.goodput --workload loogle --rates 0.5,1,2          # latency vs rate
    python -m tokenlake.bench.goodput --real [--quick]   # the real CPU mini-cluster (bench/real_cluster.py)

Workloads are named presets (real traces and generators) or any Mooncake-format trace
(``--trace``; see ``bench/traces.py`` for the schema). TokenLake runs through the real
``tokenlake.Pool`` and ``tokenlake.scheduler``; the baselines (SGLang-Router, Mooncake xPyD,
see ``bench/sim/``) run in the same event loop and step timer. With ``--goodput`` every
system is bisected at each ``--prefill-tokens`` value on seed 0 and reported at its best one,
over ``--seeds`` seeds (median and min-max). Every run prints one JSON line (finished, rejected
and stalled requests included) and a warning if any request stalled; ``--out DIR`` also writes
``runs.jsonl``, ``summary.json`` and PNG plots (with matplotlib).
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor

from tokenlake.bench.goodput_report import GoodputReport
from tokenlake.bench.goodput_runs import RunKey, Runs
from tokenlake.bench.sim.confidence import TARGET, system_goodput
from tokenlake.bench.sim.runner import EXTRA_SYSTEMS, SYSTEMS, RunResult
from tokenlake.bench.sim.step_timer import ClusterSpec
from tokenlake.bench.traces import CONVERSATION_TRACE, SYNTHETIC_TRACE, TRACES_DIR
from tokenlake.bench.workloads import (
    GENERATORS,
    GeneratorConfig,
    TraceConfig,
    Workload,
    trace_workload,
)
from tokenlake.eviction import POLICIES

# name: (path, first request, jitter bucket in s, Poisson gaps)
TRACE_PRESETS = {
    "conversation": (CONVERSATION_TRACE, 3000, 3.0, False),
    "synthetic": (SYNTHETIC_TRACE, 0, 0.0, True),
    "ragpulse": (TRACES_DIR / "ragpulse" / "ragpulse_blocks512.jsonl.gz", 0, 1.0, False),
}
DEFAULT_REQUESTS = {"scbench": 40, "agentic": 300}


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    w = p.add_argument_group("workload")
    src = w.add_mutually_exclusive_group()
    src.add_argument("--workload", choices=sorted(TRACE_PRESETS) + sorted(GENERATORS))
    src.add_argument("--trace", help="Mooncake-format JSONL trace (plain, .gz or .xz)")
    w.add_argument(
        "--max-requests",
        "--requests",
        dest="requests",
        type=int,
        default=0,
        help="requests per run (0: all of --trace, or the preset's default)",
    )
    w.add_argument("--offset", type=int, default=None, help="first trace request (file order)")
    w.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per hash_ids block (default: the trace's field, or inferred)",
    )
    w.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="one replay at the trace's own timing times this (0.5: twice as fast)",
    )
    w.add_argument(
        "--sessions",
        choices=("open", "closed"),
        default="open",
        help="open: every request at its timestamp; closed: a session's next turn "
        "waits for the previous one (needs a session_id field)",
    )
    w.add_argument(
        "--session-ids",
        choices=("global", "scoped"),
        default="global",
        help="scoped: hash_ids are unique only within a session",
    )
    w.add_argument(
        "--jitter",
        type=float,
        default=None,
        help="trace timestamps are bucketed every S seconds: jitter inside (s)",
    )
    w.add_argument("--poisson", action="store_true", help="redraw trace gaps as Poisson")
    w.add_argument("--system-prompt", type=int, default=4096, help="generators' shared prompt")
    c = p.add_argument_group("cluster and systems")
    c.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma list of {SYSTEMS} (also {EXTRA_SYSTEMS}: synchronous iterations)",
    )
    c.add_argument("--instances", type=int, default=4)
    c.add_argument("--tp", type=int, default=2, help="GPUs per instance (the paper: 2)")
    c.add_argument("--hardware", default="A100-80G")
    c.add_argument("--model", default="LWM-Text-1M")
    c.add_argument("--segment-len", type=int, default=512, help="TokenLake's segment length")
    c.add_argument(
        "--prefill-tokens",
        type=_int_list,
        default=[2048, 4096, 8192],
        help="the prefill knob swept per system (chunked prefill size; TokenLake's "
        "chunk and per-iteration prefill budget); one value: all at that setting",
    )
    c.add_argument(
        "--eviction",
        choices=POLICIES,
        default=None,
        help="TokenLake's eviction policy (default: the pool's; see tokenlake/eviction.py)",
    )
    c.add_argument(
        "--no-mixed-chunk",
        action="store_true",
        help="router instances without SGLang's mixed chunked prefill",
    )
    r = p.add_argument_group("runs")
    r.add_argument("--goodput", action="store_true", help="P90 goodput by bisection on the rate")
    r.add_argument("--lo", type=float, default=0.25, help="bisection start (req/s)")
    r.add_argument("--hi", type=float, default=1.0, help="bisection upper start (req/s)")
    r.add_argument("--rel-tol", type=float, default=0.15)
    r.add_argument("--max-evals", type=int, default=8, help="runs per bisection")
    r.add_argument(
        "--full-runs",
        action="store_true",
        help="bisection runs go to the end even once the SLO attainment can no longer "
        "reach 90%% (default: they stop there, stop 'slo_missed'; same verdict)",
    )
    r.add_argument("--seeds", type=int, default=3, help="workload/arrival seeds per figure")
    r.add_argument("--rates", type=_float_list, default=None, help="comma list: rate sweep")
    r.add_argument("--rate", type=float, default=0.0, help="rate for --cache-fractions")
    r.add_argument(
        "--cache-fractions",
        type=_float_list,
        default=None,
        help="comma list of KV capacity fractions (hit rate vs cache size)",
    )
    r.add_argument("--window", type=float, default=5.0, help="load timeline window (s)")
    r.add_argument("--wall-budget", type=float, default=300.0, help="real seconds per run")
    r.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at once in worker processes (one per core); the systems are bisected side "
        "by side and each bisection probes jobs/systems rates per round (1: one run at a "
        "time, every rate in sequence)",
    )
    r.add_argument(
        "--horizon",
        type=float,
        default=None,
        metavar="SECONDS",
        help="simulated seconds after the last arrival before a run stops "
        "(default: 2x the arrival span + 600)",
    )
    r.add_argument("--seed", type=int, default=0, help="first seed")
    r.add_argument("--out", default="", help="directory for runs.jsonl, summary.json, plots")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.workload is None and args.trace is None:
        args.workload = "conversation"
    if args.time_scale is not None and args.trace is None and args.workload not in TRACE_PRESETS:
        p.error("--time-scale: only for traces")
    if args.time_scale is not None and (args.goodput or args.rates):
        p.error("--time-scale replays the trace's own timing; drop --goodput/--rates")
    if args.time_scale is not None and not args.time_scale > 0:
        p.error(f"--time-scale: expected > 0, got {args.time_scale}")
    if args.horizon is not None and not args.horizon > 0:
        p.error(f"--horizon: expected > 0, got {args.horizon}")
    names = ("requests", "offset", "block_size", "instances", "tp", "segment_len", "seeds", "jobs")
    for name in names:
        value = getattr(args, name)
        low = 0 if name in ("requests", "offset") else 1
        if value is not None and value < low:
            p.error(f"--{name.replace('_', '-')}: expected >= {low}, got {value}")
    args.systems = [s for s in args.systems.split(",") if s]
    for s in args.systems:
        if s not in SYSTEMS + EXTRA_SYSTEMS:
            p.error(
                f"--systems: unknown {s!r}; expected some of {', '.join(SYSTEMS + EXTRA_SYSTEMS)}"
            )
    bad = [k for k in args.prefill_tokens if k % args.segment_len]
    if bad:
        p.error(f"--prefill-tokens: {bad} are not multiples of --segment-len {args.segment_len}")
    return args


def make_workload(args: argparse.Namespace, rate: float | None, seed: int) -> Workload:
    """The workload of one run: ``rate`` None replays a trace at its own timing."""
    if args.trace is not None or args.workload in TRACE_PRESETS:
        path, offset, jitter, poisson = TRACE_PRESETS.get(
            args.workload, (args.trace, 0, 0.0, False)
        )
        cfg = TraceConfig(
            path,
            limit=args.requests
            or (DEFAULT_REQUESTS.get(args.workload, 200) if args.workload else None),
            offset=args.offset if args.offset is not None else offset,
            rate=rate,
            time_scale=args.time_scale or 1.0,
            jitter_s=args.jitter if args.jitter is not None else jitter,
            poisson=args.poisson or poisson,
            block_size=args.block_size,
            per_session_ids=args.session_ids == "scoped",
            sessions=args.sessions,
            seed=seed,
        )
        return trace_workload(cfg)
    n = args.requests or DEFAULT_REQUESTS.get(args.workload, 200)
    return GENERATORS[args.workload](GeneratorConfig(n, rate or 1.0, args.system_prompt, seed=seed))


def run(args: argparse.Namespace) -> dict:
    """Run the harness with parsed options (:func:`parse_args`); returns the summary."""
    spec = ClusterSpec(args.hardware, args.model, args.instances, args.tp)
    report = GoodputReport(args, spec)
    seeds = list(range(args.seed, args.seed + args.seeds))
    # what the runs replay: the trace's own timing (a replay) or a rate (the header's note)
    probe = make_workload(args, None if args.time_scale is not None else 1.0, seeds[0])
    if len(seeds) > 1 and not report.seeds_vary(probe, make_workload(args, 1.0, seeds[1])):
        report.warn(
            "the seeds give identical workloads (a trace without --jitter or "
            "--poisson): running one seed"
        )
        seeds = seeds[:1]
    report.header(probe, seeds)

    def report_run(res: RunResult, key: RunKey) -> None:
        report.run(res, key.rate, key.seed, key.knob, key.spec)

    runs = Runs(args, make_workload, report_run, args.jobs)
    try:
        _run_phases(args, spec, report, runs, seeds)
    finally:
        runs.close()
    return report.finish()


def _run_phases(
    args: argparse.Namespace,
    spec: ClusterSpec,
    report: GoodputReport,
    runs: Runs,
    seeds: list[int],
) -> None:
    def run_one(system: str, rate: float | None, seed: int, knob: int, sp=spec) -> RunResult:
        return runs.one(RunKey(system, rate, seed, knob, sp))

    if args.goodput:
        stop = 0.0 if args.full_runs else TARGET
        # with jobs, the systems' bisections run side by side, each probing jobs/systems rates
        width = max(1, args.jobs // len(args.systems))

        def bisect(s: str):
            def attainments(rates: list[float], seed: int, knob: int) -> list[float]:
                keys = [RunKey(s, r, seed, knob, spec, stop) for r in rates]
                return [res.summary()["slo_attainment"] for res in runs.many(keys)]

            return system_goodput(
                lambda rate, seed, knob: attainments([rate], seed, knob)[0],
                args.prefill_tokens,
                seeds,
                args.lo,
                args.hi,
                args.rel_tol,
                args.max_evals,
                width,
                attainments if width > 1 else None,
            )

        if args.jobs > 1 and len(args.systems) > 1:
            with ThreadPoolExecutor(len(args.systems)) as threads:
                found = list(threads.map(bisect, args.systems))
        else:
            found = [bisect(s) for s in args.systems]
        for s, g in zip(args.systems, found, strict=True):
            report.goodput(s, g)
        ref = report.reference_rate()
        keys = [
            RunKey(s, ref, seed, report.knob_of(s), spec) for s in args.systems for seed in seeds
        ]
        results = iter(runs.many(keys))
        for s in args.systems:
            report.at_reference(s, [next(results) for _ in seeds])
        report.goodput_table()
    if args.time_scale is not None:
        for s in args.systems:
            report.replay(s, [run_one(s, None, seed, report.knob_of(s)) for seed in seeds])
        report.replay_table()
    if args.rates:
        for s in args.systems:
            for rate in args.rates:
                report.sweep_point(s, rate, run_one(s, rate, seeds[0], report.knob_of(s)))
    if args.cache_fractions:
        rate = args.rate or args.lo
        for s in args.systems:
            for f in args.cache_fractions:
                sp = ClusterSpec(
                    spec.hardware,
                    spec.model,
                    spec.num_instances,
                    spec.tp,
                    cache_tokens=max(1024, int(spec.capacity_tokens * f)),
                )
                report.cache_point(s, f, run_one(s, rate, seeds[0], report.knob_of(s), sp))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--real"]:  # real model forwards instead of the simulator (its own options)
        from tokenlake.bench.real_cluster import main as real_main

        return real_main(argv[1:])
    args = parse_args(argv)
    try:
        summary = run(args)
    except (ValueError, FileNotFoundError) as e:  # a bad trace or option: say what, no trace
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if summary is not None else 1


if __name__ == "__main__":
    sys.exit(main())
