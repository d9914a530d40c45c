"""The goodput harness (docs/goodput.md): replay a workload through simulated clusters, sweep the
request rate, and report P90 goodput, hit rate and per-instance load CV per system.

    python -m tokenlake.benchmarks.goodput.harness --workload conversation --goodput          # a table row
    python -m tokenlake.benchmarks.goodput.harness --trace my_trace.jsonl.gz --goodput        # your own trace
    python -m tokenlake.benchmarks.goodput.harness --trace t.jsonl.xz --time-scale 0.5        # one replay, 2x speed
    python -m tokenlake.benchmarks.goodput.harness --workload loogle --rates 0.5,1,2          # latency vs rate

Workloads are named presets (real traces and generators) or any Mooncake-format trace
(``--trace``; see ``benchmarks/workloads/traces.py`` for the schema). TokenLake runs through the real
``tokenlake.Pool`` and ``tokenlake.scheduler``; the baselines (SGLang-Router, Mooncake xPyD,
see ``benchmarks/sim/``) run in the same event loop and step timer. With ``--goodput`` every
system is bisected at each ``--prefill-tokens`` value on seed 0 and reported at its best one,
over ``--seeds`` seeds (median and min-max). Every run prints one JSON line (finished, rejected
and stalled requests included) and a warning if any request stalled; ``--out DIR`` also writes
``runs.jsonl``, ``summary.json`` and PNG plots (with matplotlib).
"""

from __future__ import annotations

import argparse
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from tokenlake.benchmarks.goodput import args as goodput_args
from tokenlake.benchmarks.goodput.args import DEFAULT_REQUESTS, TRACE_PRESETS
from tokenlake.benchmarks.goodput.report import GoodputReport
from tokenlake.benchmarks.goodput.runs import Knob, RunKey, Runs, Setting, knob_setting
from tokenlake.benchmarks.sim.confidence import TARGET, system_goodput
from tokenlake.benchmarks.sim.cpu_profile import load_cpu_profile
from tokenlake.benchmarks.sim.engine import FCFS
from tokenlake.benchmarks.sim.runner import WALL_BUDGET, RunResult
from tokenlake.benchmarks.sim.step_timer import ClusterSpec
from tokenlake.benchmarks.sim.systems.radix_cache import LRU
from tokenlake.benchmarks.sim.systems.router import RouterConfig
from tokenlake.benchmarks.sim.systems.systems import every_split, split_system
from tokenlake.benchmarks.workloads import (
    GENERATORS,
    GeneratorConfig,
    TraceConfig,
    Workload,
    trace_workload,
)


def build_parser() -> argparse.ArgumentParser:
    """The ``tokenlake goodput`` parser (:mod:`tokenlake.benchmarks.goodput.args`), this module's
    docstring heading its ``--help``."""
    return goodput_args.build_parser(__doc__)


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check ``tokenlake goodput`` options (:func:`goodput_args.parse_args`)."""
    return goodput_args.parse_args(argv, __doc__)


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
    think_scale = 1.0 if args.think_scale is None else args.think_scale
    cfg = GeneratorConfig(
        n,
        rate or 1.0,
        args.system_prompt,
        seed=seed,
        think_scale=think_scale,
        num_sessions=getattr(args, "num_sessions", 0),
    )
    return GENERATORS[args.workload](cfg)


class UnresolvedRun(Exception):
    """A run still cut by the wall budget after its re-runs: its verdict is unknown."""


def knobs_of(args: argparse.Namespace, system: str) -> list[Knob]:
    """The knob values a system's goodput is swept over first: TokenLake's
    ``--prefill-tokens``, the baselines' ``--baseline-prefill-tokens`` (the router's at one
    ``--router-balance`` pair when only one is given; ``mooncake`` at its first split)."""
    base, _ = split_system(system)
    if base.startswith("tokenlake"):
        return list(args.prefill_tokens)
    balance = args.router_balance[0] if base == "router" and len(args.router_balance) == 1 else None
    split = _splits(args)[0] if base == "mooncake" else None
    return [Setting(k, balance, split) for k in args.baseline_prefill_tokens]


def _splits(args: argparse.Namespace) -> list[tuple[int, int]]:
    """``mooncake``'s splits swept: ``--mooncake-splits``, else every split of the cluster,
    the even one first."""
    if args.mooncake_splits:
        return list(args.mooncake_splits)
    n = args.instances
    splits = every_split(n)
    return sorted(splits, key=lambda s: (abs(s[0] - n / 2), s[0]))


def more_knobs_of(args: argparse.Namespace, system: str) -> list:
    """The baselines' further settings, each swept at the best setting so far: the router's
    imbalance thresholds; ``mooncake``'s other splits; SGLang's schedule policies
    (``--baseline-schedule-policies``) and radix eviction policies
    (``--baseline-evictions``). None for TokenLake."""
    base, _ = split_system(system)
    if base.startswith("tokenlake"):
        return []
    stages = []
    if base == "router" and len(args.router_balance) > 1:
        default = (RouterConfig.balance_abs_threshold, RouterConfig.balance_rel_threshold)
        pairs = [p for p in args.router_balance if p != default]
        stages.append(lambda best: [knob_setting(best)._replace(balance=p) for p in pairs])
    if base == "mooncake":
        others = _splits(args)[1:]
        stages.append(lambda best: [knob_setting(best)._replace(split=p) for p in others])
    policies = [p for p in args.baseline_schedule_policies if p != FCFS]
    stages.append(lambda best: [knob_setting(best)._replace(schedule=p) for p in policies])
    evictions = [e for e in args.baseline_evictions if e != LRU]
    stages.append(lambda best: [knob_setting(best)._replace(eviction=e) for e in evictions])
    return stages


def run(args: argparse.Namespace) -> dict:
    """Run the harness with parsed options (:func:`parse_args`); returns the summary."""
    spec = ClusterSpec(args.hardware, args.model, args.instances, args.tp)
    if args.hardware_profile is not None:
        spec = load_cpu_profile(args.hardware_profile).spec(args.instances)
    report = GoodputReport(args, spec, lambda s: knobs_of(args, s))
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
            def attainments(rates: list[float], seed: int, knob: int, then=None) -> list[float]:
                def key(rate: float) -> RunKey:
                    return RunKey(s, rate, seed, knob, spec, stop)

                def ahead(known: dict[int, RunResult]) -> list[RunKey]:
                    attained = {
                        rates[i]: res.summary()["slo_attainment"] for i, res in known.items()
                    }
                    return [key(r) for r in then(attained)]

                results = runs.many([key(r) for r in rates], ahead if then else None)
                for r, res in zip(rates, results, strict=True):
                    if res.stop_reason == WALL_BUDGET:  # never a failure: no verdict at all
                        raise UnresolvedRun(f"{s} at {r:.4g} req/s, seed {seed}")
                return [res.summary()["slo_attainment"] for res in results]

            try:
                return system_goodput(
                    lambda rate, seed, knob: attainments([rate], seed, knob)[0],
                    knobs_of(args, s),
                    seeds,
                    args.lo,
                    args.hi,
                    args.rel_tol,
                    args.max_evals,
                    width,
                    attainments if args.jobs > 1 else None,
                    ahead=args.jobs > 1,
                    more_knobs=more_knobs_of(args, s),
                )
            except UnresolvedRun as e:
                return str(e)

        if args.jobs > 1 and len(args.systems) > 1:
            threads = ThreadPoolExecutor(len(args.systems))
            try:
                found = list(threads.map(bisect, args.systems))
            finally:  # stopped (SIGTERM): do not wait for the bisections, runs.close() ends them
                threads.shutdown(wait=False, cancel_futures=True)
        else:
            found = [bisect(s) for s in args.systems]
        for s, g in zip(args.systems, found, strict=True):
            if isinstance(g, str):
                report.unresolved(s, g)
                continue
            report.goodput(s, g)
            # hit rate and load CV at the system's own goodput, seed by seed: those runs
            # passed in its bisection and are kept (a goodput of 0: the lowest rate tried)
            rates = [x or min(r for _, _, r, _ in g.points) for x in g.goodputs]
            keys = [
                RunKey(s, rate, seed, g.knob, spec) for rate, seed in zip(rates, seeds, strict=True)
            ]
            report.at_own_goodput(s, runs.many(keys), rates)
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
                sp = replace(spec, cache_tokens=max(1024, int(spec.capacity_tokens * f)))
                report.cache_point(s, f, run_one(s, rate, seeds[0], report.knob_of(s), sp))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)

    def stop(signum, frame):  # SIGTERM: unwind, so that run() ends its worker processes
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        summary = run(args)
    except (ValueError, FileNotFoundError) as e:  # a bad trace or option: say what, no trace
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if summary is not None else 1


if __name__ == "__main__":
    sys.exit(main())
