"""The ``tokenlake goodput`` command line: its options (workload, systems, rates, bisection,
run limits) and their checks, and the named trace presets (:mod:`tokenlake.benchmarks.goodput.harness` runs
them)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenlake.benchmarks.goodput.sim_options import add_sim_options
from tokenlake.benchmarks.sim.runner import EXTRA_SYSTEMS, SYSTEMS, VARIANT_SYSTEMS
from tokenlake.benchmarks.sim.systems.systems import split_system
from tokenlake.benchmarks.workloads import GENERATORS, SESSION_WORKLOADS
from tokenlake.benchmarks.workloads.traces import CONVERSATION_TRACE, SYNTHETIC_TRACE, TRACES_DIR
from tokenlake.tree.policy import POLICIES

# name: (path, first request, jitter bucket in s, Poisson gaps)
TRACE_PRESETS = {
    "conversation": (CONVERSATION_TRACE, 3000, 3.0, False),
    "synthetic": (SYNTHETIC_TRACE, 0, 0.0, True),
    "ragpulse": (TRACES_DIR / "ragpulse" / "ragpulse_blocks512.jsonl.gz", 0, 1.0, False),
}
DEFAULT_REQUESTS = {"scbench": 40, "agentic": 300}
# the baselines' chunked-prefill sizes swept by default, each reported at its best
BASELINE_PREFILL_TOKENS = [256, 512, 1024, 2048, 4096, 8192]
# sgl-router's imbalance thresholds (balance_abs_threshold, balance_rel_threshold) swept at
# the router's best chunk: its documented range is abs 1-100 and rel (1, 3), defaults 32 and
# 1.0001 (later docs) or 64 and 1.5 (the 0.2-0.3 launcher, the simulator's default)
ROUTER_BALANCE = [(8, 1.0001), (32, 1.0001), (64, 1.5), (100, 3.0)]


def _balance_list(text: str) -> list[tuple[int, float]]:
    out = []
    for item in (x for x in text.split(",") if x):
        try:
            a, r = item.split(":")
            pair = (int(a), float(r))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated ABS:REL pairs, got {text!r}"
            ) from None
        if pair[0] < 0 or not pair[1] >= 1:
            raise argparse.ArgumentTypeError(f"expected ABS >= 0 and REL >= 1, got {item!r}")
        out.append(pair)
    if not out:
        raise argparse.ArgumentTypeError(f"expected at least one ABS:REL pair, got {text!r}")
    return out


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
        choices=("open", "closed", "auto"),
        default="auto",
        help="open: every request at its timestamp; closed: a session's next turn "
        "waits for the previous one (needs a session_id field); auto (default): closed when "
        "the trace has session ids",
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
    w.add_argument(
        "--num-sessions",
        type=int,
        default=0,
        help=f"session generators ({', '.join(SESSION_WORKLOADS)}): this many sessions, each "
        "sending a window of about requests/sessions consecutive turns from a random turn on "
        "(0: whole sessions; few sessions leave the goodput unbounded: a higher rate only "
        "spaces their starts)",
    )
    c = p.add_argument_group("cluster and systems")
    c.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma list of {SYSTEMS} (also {EXTRA_SYSTEMS}: synchronous iterations), "
        "optionally with variants appended in any order: -no-groups (TokenLake without "
        "shared-page groups), -tbt (router/Mooncake instances size each chunk to fit the TBT "
        "SLO beside their running decodes), -min-load (the router's successor gateway rule: "
        "below the cache threshold, the least-loaded worker), -cascade (baselines with vLLM "
        "V1's cascade decode), -no-store (Mooncake without its DRAM store), e.g. "
        f"{', '.join(VARIANT_SYSTEMS)}",
    )
    add_sim_options(c)
    c.add_argument(
        "--page-groups",
        choices=("on", "off"),
        default="on",
        help="TokenLake's shared-page groups in the decode timing (off: every row reads its "
        "own pages, as the baselines without -cascade)",
    )
    c.add_argument("--instances", type=int, default=4)
    c.add_argument("--tp", type=int, default=2, help="GPUs per instance (the paper: 2)")
    c.add_argument("--hardware", default="A100-80G")
    c.add_argument("--hardware-profile", type=Path, default=None, metavar="FILE",
                   help="a measured profile (tokenlake bench calibrate-cpu): its hardware, "
                   "model and calibration replace --hardware, --model and --tp")  # fmt: skip
    c.add_argument("--model", default="LWM-Text-1M")
    c.add_argument("--segment-len", type=int, default=512, help="TokenLake's segment length")
    c.add_argument(
        "--prefill-tokens",
        type=_int_list,
        default=None,
        help="TokenLake's prefill knob swept (its chunk and per-iteration prefill budget; "
        "default 2048,4096,8192); also the baselines' unless --baseline-prefill-tokens",
    )
    c.add_argument(
        "--baseline-prefill-tokens",
        type=_int_list,
        default=None,
        help="the baselines' chunked-prefill sizes swept, each reported at its best "
        f"(default: --prefill-tokens if given, else {','.join(map(str, BASELINE_PREFILL_TOKENS))})",
    )
    c.add_argument(
        "--router-balance",
        type=_balance_list,
        default=None,
        help="router imbalance thresholds ABS:REL (sgl-router's balance_abs_threshold and "
        "balance_rel_threshold) swept with --goodput at the router's best chunk, the best "
        "reported (default "
        + ",".join(f"{a}:{r:g}" for a, r in ROUTER_BALANCE)
        + ", sgl-router's range; one pair: all runs at it)",
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
    r.add_argument(
        "--wall-budget",
        type=float,
        default=300.0,
        help="real seconds per run; a run cut by it is re-run with twice the budget, up to "
        "--wall-retries times, then reported unresolved (never counted as a failure)",
    )
    r.add_argument("--wall-retries", type=int, default=2, help="re-runs of a run cut by time")
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
    if args.num_sessions and args.workload not in SESSION_WORKLOADS:
        p.error(f"--num-sessions: only for {', '.join(SESSION_WORKLOADS)}")
    if args.num_sessions < 0 or args.wall_retries < 0:
        p.error(
            f"--num-sessions, --wall-retries: expected >= 0, got {args.num_sessions}, "
            f"{args.wall_retries}"
        )
    if not args.wall_budget > 0:
        p.error(f"--wall-budget: expected > 0, got {args.wall_budget}")
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
        try:
            split_system(s)
        except ValueError as e:
            p.error(f"--systems: {e}")
    explicit = args.prefill_tokens is not None
    args.prefill_tokens = args.prefill_tokens or [2048, 4096, 8192]
    if args.baseline_prefill_tokens is None:
        args.baseline_prefill_tokens = (
            list(args.prefill_tokens) if explicit else list(BASELINE_PREFILL_TOKENS)
        )
    if args.router_balance is None:
        args.router_balance = list(ROUTER_BALANCE)
    bad = [k for k in args.prefill_tokens if k % args.segment_len]
    if bad:
        p.error(f"--prefill-tokens: {bad} are not multiples of --segment-len {args.segment_len}")
    return args
