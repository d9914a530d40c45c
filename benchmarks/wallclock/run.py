"""``tokenlake bench wallclock``: TokenLake against the real SGLang router, in wall-clock time.

    tokenlake bench wallclock --quick
    tokenlake bench wallclock --seeds 0 1 2 --requests 40 --json-out results.jsonl

One ``tokenlake serve --num-instances N`` server (one pool over N instances) against N
``tokenlake serve --num-instances 1`` servers behind ``python -m sglang_router.launch_router
--policy cache_aware``, every process on 127.0.0.1, the same requests sent by the same
streaming client (httpx). For each model, workload and seed both systems' P90 goodput (the
highest rate at which >= 90% of requests meet the SLO) is found by bisection, each point a
real run, the two systems' runs alternating. The SLO is the simulator's rule: 10x the
batch-size-1 TTFT and TPOT of the workload's median prompt on an idle 1-instance server,
measured once (``--calibrate``, or at first use) and kept in ``--slo-file``, or given by
``--ttft-slo-ms`` / ``--tpot-slo-ms``; every invocation prints it (:mod:`.slo_file`).
Progress goes to stderr; a table and the JSON lines of :mod:`tokenlake.benchmarks.wallclock`
to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from tokenlake.benchmarks.wallclock.workloads import WORKLOADS

MODELS = ("tiny-random", "bench-model")
SYSTEMS = ("tokenlake", "router")
BENCH = "wallclock-router"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tokenlake bench wallclock", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--num-instances", type=int, default=4)
    p.add_argument("--requests", type=int, default=40, help="requests per rate point")
    p.add_argument("--lo", type=float, default=0.0,
                   help="first rate (req/s); 0: half one idle instance's serial rate, 0.5 / solo E2E")  # fmt: skip
    p.add_argument("--min-rate", type=float, default=0.0,
                   help="rates below this are not run (they count as misses): bounds a search "
                   "whose system misses at every rate, where each halving doubles a run's time")  # fmt: skip
    p.add_argument("--rel-tol", type=float, default=0.3, help="bisection stops at hi/lo <= 1+tol")
    p.add_argument("--max-evals", type=int, default=6, help="most runs per search")
    p.add_argument("--drain-s", type=float, default=30.0,
                   help="a run's cap: its last arrival plus this; later tokens miss")  # fmt: skip
    p.add_argument("--num-slots", type=int, default=96, help="segment slots per instance")
    p.add_argument("--segment-len", type=int, default=32)
    p.add_argument("--chunk-len", type=int, default=256)
    p.add_argument(
        "--data-plane",
        choices=("local", "mp"),
        default="local",
        help="every server's data plane (default: %(default)s)",
    )
    p.add_argument("--slo-aware", action="store_true",
                   help="start every server (both systems) with --tbt-slo-ms at the measured "
                        "token-gap SLO, so each schedules its prefill chunks for it")  # fmt: skip
    p.add_argument("--slo-file", type=Path, default=None,
                   help="the fixed SLO per model and workload (default: "
                   "results/wallclock_slo.json); a missing entry is measured and written")  # fmt: skip
    p.add_argument("--calibrate", action="store_true",
                   help="measure the SLO of every model and workload again, write it to "
                   "--slo-file and stop")  # fmt: skip
    p.add_argument("--ttft-slo-ms", type=float, default=0.0,
                   help="with --tpot-slo-ms: this SLO for every model and workload instead")  # fmt: skip
    p.add_argument("--tpot-slo-ms", type=float, default=0.0)
    p.add_argument("--tokenlake-data-plane", choices=("local", "mp", "compute", "workers"),
                   default=None,
                   help="TokenLake's server only (default: --data-plane); compute: a compute "
                        "process per instance, so its instances compute in parallel as the "
                        "router's servers do")  # fmt: skip
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="one more sglang_router.launch_router argument (repeatable)")  # fmt: skip
    p.add_argument("--json-out", type=Path, default=None, help="also append the JSON lines here")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--quick", action="store_true",
                   help="tiny-random, long-document, seed 0, 16 requests, the first rate only")  # fmt: skip
    args = p.parse_args(argv)
    for name in ("num_instances", "requests", "max_evals", "num_slots", "segment_len",
                 "chunk_len"):  # fmt: skip
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    for name in ("rel_tol", "drain_s", "start_timeout_s"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')}: expected > 0, got {getattr(args, name)}")
    if args.lo < 0 or args.min_rate < 0 or any(s < 0 for s in args.seeds):
        p.error(
            f"--lo, --min-rate, --seeds: expected >= 0, got {args.lo}, {args.min_rate}, "
            f"{args.seeds}"
        )
    if (args.ttft_slo_ms > 0) != (args.tpot_slo_ms > 0) or min(
        args.ttft_slo_ms, args.tpot_slo_ms
    ) < 0:
        p.error("--ttft-slo-ms, --tpot-slo-ms: give both, in positive milliseconds")
    if args.slo_file is None:
        from tokenlake.benchmarks.wallclock.slo_file import DEFAULT_PATH

        args.slo_file = DEFAULT_PATH
    if args.quick:
        args.models, args.workloads, args.seeds = ["tiny-random"], ["long-document"], [0]
        args.requests = 16
    return args


def log(msg: str) -> None:
    print(f"[wallclock {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _stop(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: every process is stopped on the way


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in background
    from tokenlake.benchmarks.wallclock.processes import Fleet, ProcessError, require_router
    from tokenlake.benchmarks.wallclock.report import format_table

    try:
        require_router()
    except ProcessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from tokenlake.benchmarks.demo.client import quiet_http_client_logs

    quiet_http_client_logs()
    lines: list[dict] = []
    salts = itertools.count(1)
    with tempfile.TemporaryDirectory(prefix="tokenlake-wallclock-") as tmp, Fleet() as fleet:
        fleet.start_timeout_s = args.start_timeout_s
        for model in args.models:
            log(f"{model}: each run starts its system afresh")
            lines += run_model(args, fleet, model, Path(tmp), salts, emit)
    print(format_table(lines))
    return 0


def emit(line: dict, json_out: Path | None) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    if json_out is not None:
        with open(json_out, "a", encoding="utf-8") as f:
            f.write(text + "\n")


def run_model(args, fleet, model: str, tmp: Path, salts, emit_line) -> list[dict]:
    from tokenlake.benchmarks.wallclock import slo_file
    from tokenlake.benchmarks.wallclock.client import ALPHABET
    from tokenlake.benchmarks.wallclock.point import Launch, measure_solo
    from tokenlake.benchmarks.wallclock.processes import ServerSettings
    from tokenlake.benchmarks.wallclock.serving_compare import prepare_model
    from tokenlake.benchmarks.wallclock.workloads import build_workload

    n = args.num_instances
    settings = ServerSettings(prepare_model(model, tmp / model, 0), model, args.segment_len,
                              args.num_slots, args.chunk_len, args.data_plane)  # fmt: skip
    base = Launch(fleet, settings, n, tuple(args.router_arg),
                    tokenlake_data_plane=args.tokenlake_data_plane)  # fmt: skip
    out: list[dict] = []
    for workload in args.workloads:
        per_seed = {s: build_workload(workload, seed=s, num_requests=args.requests,
                                      vocab_size=len(ALPHABET)) for s in args.seeds}  # fmt: skip
        slo, solo_e2e, source = slo_file.resolve(
            args, model, workload, lambda r=per_seed[args.seeds[0]]: measure_solo(base, r, salts)
        )
        print(f"SLO {model} {workload}: TTFT <= {slo.ttft_s * 1e3:.1f} ms, every token gap "
              f"<= {slo.tpot_s * 1e3:.1f} ms ({source})", flush=True)  # fmt: skip
        if args.calibrate:
            continue
        lo = args.lo or round(0.5 / solo_e2e, 2)
        launch = base
        if args.slo_aware:  # every server (both systems) schedules for the token-gap SLO
            aware = dataclasses.replace(settings, tbt_slo_ms=round(slo.tpot_s * 1e3, 3))
            launch = dataclasses.replace(base, settings=aware)
        for seed, reqs in per_seed.items():
            key = {"bench": BENCH, "model": model, "workload": workload, "seed": seed,
                   "num_instances": n,
                   "tokenlake_data_plane": args.tokenlake_data_plane or args.data_plane,
                   "tbt_slo_ms": launch.settings.tbt_slo_ms, "slo_source": source}  # fmt: skip
            out += search_seed(args, launch, key, reqs, slo, lo, salts, emit_line)
    return out


def search_seed(args, launch, key, reqs, slo, lo, salts, emit_line) -> list[dict]:
    """Both systems' goodput searches on one seed's requests; their JSON lines."""
    from tokenlake.benchmarks.wallclock.point import run_point
    from tokenlake.benchmarks.wallclock.sweep import first_rate_only, search_all

    out: list[dict] = []
    where = f"{key['model']} {key['workload']} seed {key['seed']}"

    def attainment_at(name: str, rate: float) -> float:
        if rate < args.min_rate:
            log(f"  {where} {name:<9} {rate:7.2f} req/s: not run (below --min-rate)")
            return 0.0
        line = run_point(launch, name, reqs, rate, next(salts), slo, args.drain_s)
        line = {**key, "kind": "point", "system": name, **line}
        log(f"  {where} {name:<9} {rate:7.2f} req/s: attainment {line['attainment']:.0%}, "
            f"hit rate {line['hit_rate']:.1%}, load CV {line['load_cv']:.1%}")  # fmt: skip
        emit_line(line, args.json_out)
        out.append(line)
        return line["attainment"]

    if args.quick:
        results = first_rate_only(SYSTEMS, attainment_at, lo)
    else:
        results = search_all(SYSTEMS, attainment_at, lo=lo, hi=2 * lo, rel_tol=args.rel_tol,
                             max_evals=args.max_evals, wait_s=3600.0)  # fmt: skip
    for name in SYSTEMS:
        r = results[name]
        line = {**key, "kind": "goodput", "system": name, "p90_goodput": round(r.goodput, 4),
                "slo_missed_in_sweep": any(a < 0.9 for _, a in r.points),
                "points": [(round(x, 4), round(a, 4)) for x, a in r.points if x >= args.min_rate],
                "slo": slo.as_dict(), "load_avg": round(os.getloadavg()[0], 2)}  # fmt: skip
        emit_line(line, args.json_out)
        out.append(line)
    log(f"{where}: P90 goodput " + ", ".join(
        f"{name} {results[name].goodput:.2f} req/s" for name in SYSTEMS))  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
