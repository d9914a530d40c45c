"""The ``tokenlake goodput`` command line: its options (workload, systems, rates, bisection,
run limits) and their checks, and the named trace presets (:mod:`tokenlake.benchmarks.goodput.harness` runs
them)."""

from __future__ import annotations

import argparse

from tokenlake.benchmarks.goodput.options import (
    BASELINE_PREFILL_TOKENS,
    OPTION_CLASSES,
    ROUTER_BALANCE,
)
from tokenlake.benchmarks.sim.systems.systems import split_system
from tokenlake.benchmarks.workloads import SESSION_WORKLOADS
from tokenlake.benchmarks.workloads.traces import CONVERSATION_TRACE, SYNTHETIC_TRACE, TRACES_DIR
from tokenlake.serve.cli_flags import add_config_flags

# name: (path, first request, jitter bucket in s, Poisson gaps)
TRACE_PRESETS = {
    "conversation": (CONVERSATION_TRACE, 3000, 3.0, False),
    "synthetic": (SYNTHETIC_TRACE, 0, 0.0, True),
    "ragpulse": (TRACES_DIR / "ragpulse" / "ragpulse_blocks512.jsonl.gz", 0, 1.0, False),
}
DEFAULT_REQUESTS = {"scbench": 40, "agentic": 300}
__all__ = ["BASELINE_PREFILL_TOKENS", "DEFAULT_REQUESTS", "ROUTER_BALANCE", "TRACE_PRESETS"]


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The ``tokenlake goodput`` parser, one flag per field of the option dataclasses
    (:mod:`tokenlake.benchmarks.goodput.options`); ``description`` heads its ``--help``."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for cls in OPTION_CLASSES:
        add_config_flags(p, cls)
    return p


def parse_args(argv=None, description: str = "") -> argparse.Namespace:
    """Parse and check ``tokenlake goodput`` options (bad ones exit with a usage error)."""
    p = build_parser(description)
    args = p.parse_args(argv)
    if args.workload is not None and args.trace is not None:
        p.error(f"--workload {args.workload} and --trace {args.trace}: give one of them")
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
    bad = [f"{p}p{d}d" for p, d in args.mooncake_splits or () if p + d != args.instances]
    if bad:
        p.error(f"--mooncake-splits: {bad} do not add up to --instances {args.instances}")
    bad = [k for k in args.prefill_tokens if k % args.segment_len]
    if bad:
        p.error(f"--prefill-tokens: {bad} are not multiples of --segment-len {args.segment_len}")
    return args
