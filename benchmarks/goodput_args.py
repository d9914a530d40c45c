"""The ``tokenlake goodput`` command line: its options (workload, systems, rates, bisection,
run limits) and their checks, and the named trace presets (:mod:`tokenlake.benchmarks.goodput` runs
them)."""

from __future__ import annotations

import argparse

from tokenlake.benchmarks.sim.runner import EXTRA_SYSTEMS, SYSTEMS
from tokenlake.benchmarks.traces import CONVERSATION_TRACE, SYNTHETIC_TRACE, TRACES_DIR
from tokenlake.benchmarks.workloads import GENERATORS, SESSION_WORKLOADS
from tokenlake.tree.policy import POLICIES

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


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The ``tokenlake goodput`` parser; ``description`` heads its ``--help``."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
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
    w.add_argument(
        "--think-scale",
        type=float,
        default=None,
        help=f"session generators ({', '.join(SESSION_WORKLOADS)}): the think time between "
        "a session's turns times this (default 1; 0: a turn is sent as soon as the previous "
        "answer is complete, as SCBench's evaluation script runs them)",
    )
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
        help="TokenLake's eviction policy (default: the pool's; see tokenlake/tree/policy.py)",
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


def parse_args(argv=None, description: str = "") -> argparse.Namespace:
    """Parse and check ``tokenlake goodput`` options (bad ones exit with a usage error)."""
    p = build_parser(description)
    args = p.parse_args(argv)
    if args.workload is None and args.trace is None:
        args.workload = "conversation"
    if args.time_scale is not None and args.trace is None and args.workload not in TRACE_PRESETS:
        p.error("--time-scale: only for traces")
    if args.time_scale is not None and (args.goodput or args.rates):
        p.error("--time-scale replays the trace's own timing; drop --goodput/--rates")
    if args.time_scale is not None and not args.time_scale > 0:
        p.error(f"--time-scale: expected > 0, got {args.time_scale}")
    if args.think_scale is not None and args.workload not in SESSION_WORKLOADS:
        p.error(f"--think-scale: only for {', '.join(SESSION_WORKLOADS)}")
    if args.think_scale is not None and not 0 <= args.think_scale < float("inf"):
        p.error(f"--think-scale: expected a number >= 0, got {args.think_scale}")
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
