"""The ``tokenlake goodput`` options as frozen dataclasses, one field a flag: ``--field-name``,
typed, grouped and explained by the field's metadata (:mod:`tokenlake.serve.cli_flags` makes
the flags, as for ``tokenlake serve``). Adding an option is adding a field here; its checks
across fields live in :func:`tokenlake.benchmarks.goodput.args.parse_args`."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path

from tokenlake.benchmarks.sim.control_plane_cost import CONTROL_PLANES
from tokenlake.benchmarks.sim.engine import SCHEDULE_POLICIES
from tokenlake.benchmarks.sim.runner import EXTRA_SYSTEMS, SYSTEMS, VARIANT_SYSTEMS
from tokenlake.benchmarks.sim.systems.layered import PRICINGS, PricingConfig
from tokenlake.benchmarks.sim.systems.mooncake_store import MooncakeStoreConfig
from tokenlake.benchmarks.sim.systems.radix_cache import EVICTIONS
from tokenlake.benchmarks.workloads import GENERATORS, SESSION_WORKLOADS
from tokenlake.tree.policy import POLICIES

DEFAULT_PRICING = PricingConfig()
DEFAULT_STORE = MooncakeStoreConfig()
DEFAULT_RPC_US = round(DEFAULT_PRICING.rpc_s * 1e6, 6)
# the simulated cluster's workload presets: name -> (path, first request, jitter bucket in s,
# Poisson gaps); filled in by args.py, which knows the trace files
PRESET_NAMES = ("conversation", "ragpulse", "synthetic")
# the baselines' chunked-prefill sizes swept by default, each reported at its best
BASELINE_PREFILL_TOKENS = [256, 512, 1024, 2048, 4096, 8192]
# sgl-router's imbalance thresholds (balance_abs_threshold, balance_rel_threshold) swept at
# the router's best chunk: its documented range is abs 1-100 and rel (1, 3), defaults 32 and
# 1.0001 (later docs) or 64 and 1.5 (the 0.2-0.3 launcher, the simulator's default)
ROUTER_BALANCE = [(8, 1.0001), (32, 1.0001), (64, 1.5), (100, 3.0)]


def _comma_list(text: str, convert, what: str, ok) -> list:
    try:
        values = [convert(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
    if not values or not all(ok(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return values


def int_list(text: str) -> list[int]:
    return _comma_list(text, int, "positive ints", lambda v: v >= 1)


def float_list(text: str) -> list[float]:
    return _comma_list(text, float, "positive numbers", lambda v: v > 0)


def _pair(item: str) -> tuple[int, float]:
    a, r = item.split(":")
    return int(a), float(r)


def balance_list(text: str) -> list[tuple[int, float]]:
    return _comma_list(text, _pair, "ABS:REL pairs, ABS >= 0 and REL >= 1",
                       lambda p: p[0] >= 0 and p[1] >= 1)  # fmt: skip


def names_of(allowed: tuple[str, ...]):
    """A parser of comma-separated names among ``allowed``, as a tuple."""

    def parse(text: str) -> tuple[str, ...]:
        return tuple(_comma_list(text, str, f"names among {allowed}", lambda v: v in allowed))

    return parse


def _split(item: str) -> tuple[int, int]:
    p, d = item.lower().rstrip("d").split("p")
    return int(p), int(d)


def split_list(text: str) -> tuple[tuple[int, int], ...]:
    return tuple(_comma_list(text, _split, "PpDd splits such as 1p3d, P and D >= 1",
                             lambda s: min(s) >= 1))  # fmt: skip


def non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _opt(default, group: str, help: str, **meta):
    return field(default=default, metadata={"group": group, "help": help, **meta})


def _workload(default, help: str, **meta):
    return _opt(default, "workload", help, **meta)


def _cluster(default, help: str, **meta):
    return _opt(default, "cluster and systems", help, **meta)


def _runs(default, help: str, **meta):
    return _opt(default, "runs", help, **meta)


_SESSIONS = ", ".join(SESSION_WORKLOADS)


@dataclass(frozen=True)
class WorkloadOptions:
    workload: str | None = _workload(
        None, "a named workload: a trace preset or a generator (default: conversation)",
        choices=sorted(PRESET_NAMES) + sorted(GENERATORS),
    )  # fmt: skip
    trace: str | None = _workload(None, "Mooncake-format JSONL trace (plain, .gz or .xz)")
    requests: int = _workload(
        0, "requests per run (0: all of --trace, or the preset's default)",
        aliases=("--max-requests",),
    )  # fmt: skip
    offset: int | None = _workload(None, "first trace request (file order)")
    block_size: int | None = _workload(
        None, "tokens per hash_ids block (default: the trace's field, or inferred)"
    )
    time_scale: float | None = _workload(
        None, "one replay at the trace's own timing times this (0.5: twice as fast)"
    )
    sessions: str = _workload(
        "auto", "open: every request at its timestamp; closed: a session's next turn waits "
        "for the previous one (needs a session_id field); auto (default): closed when the "
        "trace has session ids", choices=("open", "closed", "auto"),
    )  # fmt: skip
    session_ids: str = _workload(
        "global", "scoped: hash_ids are unique only within a session", choices=("global", "scoped")
    )
    jitter: float | None = _workload(
        None, "trace timestamps are bucketed every S seconds: jitter inside (s)"
    )
    poisson: bool = _workload(False, "redraw trace gaps as Poisson")
    system_prompt: int = _workload(4096, "generators' shared prompt")
    think_scale: float | None = _workload(
        None, f"session generators ({_SESSIONS}): the think time between a session's turns "
        "times this (default 1; 0: a turn is sent as soon as the previous answer is complete, "
        "as SCBench's evaluation script runs them)",
    )  # fmt: skip
    num_sessions: int = _workload(
        0, f"session generators ({_SESSIONS}): this many sessions, each sending a window of "
        "about requests/sessions consecutive turns from a random turn on (0: whole sessions; "
        "few sessions leave the goodput unbounded: a higher rate only spaces their starts)",
    )  # fmt: skip


@dataclass(frozen=True)
class ClusterOptions:
    systems: str = _cluster(
        ",".join(SYSTEMS),
        f"comma list of {SYSTEMS} (also {EXTRA_SYSTEMS}: synchronous iterations; mooncake: "
        "its best split, every split swept; a split such as mooncake-2p2d fixes it), optionally "
        "with variants appended in any order: -no-groups (TokenLake without shared-page "
        "groups), -tbt (router/Mooncake instances size each chunk to fit the TBT SLO beside "
        "their running decodes), -min-load (the router's successor gateway rule: below the "
        "cache threshold, the least-loaded worker), -cascade (baselines with vLLM V1's "
        "cascade decode), -no-store (Mooncake without its DRAM store), e.g. "
        f"{', '.join(VARIANT_SYSTEMS)}",
    )  # fmt: skip
    dist_attn_pricing: str = _cluster(
        DEFAULT_PRICING.dist_attn, "TokenLake's distributed attention: layered (default: per "
        "layer q out, holders' parts at their share of a busy GPU, (o, lse) back with link "
        "latency, merge; launches and merge costed, links shared, NVLink at its per-direction "
        "figure) or overlap (the older pricing: each GPU's work and the bytes on the wire "
        "overlap, links unshared)", choices=PRICINGS,
    )  # fmt: skip
    rpc_latency_us: float = _cluster(
        DEFAULT_RPC_US, "TokenLake's dispatch of each iteration to its instances, charged "
        f"before it starts (default {DEFAULT_RPC_US:g} us)", parse=non_negative,
    )  # fmt: skip
    control_plane_scale: float = _cluster(
        DEFAULT_PRICING.control_plane_scale, "TokenLake's control plane (the scheduler's step "
        "with gen_plans, and its commit) costs its --control-plane time times this in "
        "simulated time (default 1; 0: free)", parse=non_negative,
    )  # fmt: skip
    control_plane: str = _cluster(
        DEFAULT_PRICING.control_plane, "what TokenLake's control plane costs: model (default: "
        "the calibrated cost model of the --hardware-profile, else benchmarks/data/"
        "control_plane_cost.json, measured by tokenlake bench calibrate-control-plane; the "
        "same results on any machine) or live (each call's measured thread CPU time, which "
        "depends on the machine's load)", choices=CONTROL_PLANES,
    )  # fmt: skip
    holder_priority: bool = _cluster(
        DEFAULT_PRICING.holder_priority, "ablation: TokenLake's holders run other instances' "
        "query parts ahead of their own work (a high-priority stream; not in the data plane "
        "today): the origin's per-layer wait on a busy holder is the part at full speed",
    )  # fmt: skip
    overlap_scheduling: bool = _cluster(
        DEFAULT_PRICING.overlap_scheduling, "ablation: TokenLake's control plane plans an "
        "instance's next iteration while its current one runs (SGLang's overlap scheduler; "
        "not in tokenlake serve today): only its backlog beyond the GPU work delays it",
    )  # fmt: skip
    price_hops: bool = _cluster(
        DEFAULT_PRICING.price_hops, "ablation: TokenLake's scheduler and placement price a "
        "remote holder's fixed per-step cost, as tokenlake serve prices the hop it measures: "
        "batches stay where their pages are, small decodes read replicas on their home, "
        "segments they read remotely are replicated beside them",
    )  # fmt: skip
    mooncake_store_gb: float = _cluster(
        DEFAULT_STORE.gb_per_node, "Mooncake Store's host DRAM per 8-GPU node in GiB, pooled "
        f"across nodes, for the Mooncake rows (default {DEFAULT_STORE.gb_per_node:g}, the "
        "Mooncake paper's 1 TB per node; 0: no store, as the -no-store variant)",
        parse=non_negative,
    )  # fmt: skip
    page_groups: str = _cluster(
        "on", "TokenLake's shared-page groups in the decode timing (off: every row reads its "
        "own pages, as the baselines without -cascade)", choices=("on", "off"),
    )  # fmt: skip
    instances: int = _cluster(4, "instances of the simulated cluster")
    tp: int = _cluster(2, "GPUs per instance (the paper: 2)")
    hardware: str = _cluster("A100-80G", "the hardware profile's name")
    hardware_profile: Path | None = _cluster(
        None, "a measured profile (tokenlake bench calibrate-cpu): its hardware, model and "
        "calibration replace --hardware, --model and --tp", parse=Path, metavar="FILE",
    )  # fmt: skip
    model: str = _cluster("LWM-Text-1M", "the model profile's name")
    segment_len: int = _cluster(
        512, "TokenLake's segment length in the simulator (the traces' block size)"
    )
    prefill_tokens: list[int] | None = _cluster(
        None, "TokenLake's prefill knob swept (its chunk and per-iteration prefill budget; "
        "default 2048,4096,8192); also the baselines' unless --baseline-prefill-tokens",
        parse=int_list,
    )  # fmt: skip
    baseline_prefill_tokens: list[int] | None = _cluster(
        None, "the baselines' chunked-prefill sizes swept, each reported at its best "
        f"(default: --prefill-tokens if given, else {','.join(map(str, BASELINE_PREFILL_TOKENS))})",
        parse=int_list,
    )  # fmt: skip
    router_balance: list[tuple[int, float]] | None = _cluster(
        None, "router imbalance thresholds ABS:REL (sgl-router's balance_abs_threshold and "
        "balance_rel_threshold) swept with --goodput at the router's best chunk, the best "
        "reported (default " + ",".join(f"{a}:{r:g}" for a, r in ROUTER_BALANCE)
        + ", sgl-router's range; one pair: all runs at it)", parse=balance_list,
    )  # fmt: skip
    eviction: str | None = _cluster(
        None, "TokenLake's eviction policy (default: the pool's; see tokenlake/tree/policy.py)",
        choices=POLICIES,
    )  # fmt: skip
    baseline_schedule_policies: tuple[str, ...] = _cluster(
        SCHEDULE_POLICIES, "SGLang's --schedule-policy values the baselines are swept over "
        "with --goodput, each at the best setting so far (the first, fcfs, is SGLang's default)",
        parse=names_of(SCHEDULE_POLICIES),
    )  # fmt: skip
    baseline_evictions: tuple[str, ...] = _cluster(
        EVICTIONS, "SGLang's --radix-eviction-policy values the baselines are swept over with "
        "--goodput, after the schedule policies (the first, lru, is SGLang's default)",
        parse=names_of(EVICTIONS),
    )  # fmt: skip
    mooncake_splits: tuple[tuple[int, int], ...] | None = _cluster(
        None, "the prefill:decode splits the mooncake system is swept over with --goodput, "
        "e.g. 1p3d,2p2d (P + D = --instances; default: every split, the even one first)",
        parse=split_list,
    )  # fmt: skip
    mixed_chunk: bool = _cluster(True, "router instances with SGLang's mixed chunked prefill")


@dataclass(frozen=True)
class RunOptions:
    goodput: bool = _runs(False, "P90 goodput by bisection on the rate")
    lo: float = _runs(0.25, "bisection start (req/s)")
    hi: float = _runs(1.0, "bisection upper start (req/s)")
    rel_tol: float = _runs(0.15, "bisection's relative tolerance")
    max_evals: int = _runs(8, "runs per bisection")
    full_runs: bool = _runs(
        False, "bisection runs go to the end even once the SLO attainment can no longer reach "
        "90%% (default: they stop there, stop 'slo_missed'; same verdict)",
    )  # fmt: skip
    seeds: int = _runs(3, "workload/arrival seeds per figure")
    rates: list[float] | None = _runs(None, "comma list: rate sweep", parse=float_list)
    rate: float = _runs(0.0, "rate for --cache-fractions")
    cache_fractions: list[float] | None = _runs(
        None, "comma list of KV capacity fractions (hit rate vs cache size)", parse=float_list
    )
    window: float = _runs(5.0, "load timeline window (s)")
    wall_budget: float = _runs(
        300.0, "real seconds per run; a run cut by it is re-run with twice the budget, up to "
        "--wall-retries times, then reported unresolved (never counted as a failure)",
    )  # fmt: skip
    wall_retries: int = _runs(2, "re-runs of a run cut by time")
    jobs: int = _runs(
        1, "runs at once in worker processes (one per core); the systems are bisected side by "
        "side and each bisection probes jobs/systems rates per round (1: one run at a time, "
        "every rate in sequence)",
    )  # fmt: skip
    horizon: float | None = _runs(
        None, "simulated seconds after the last arrival before a run stops (default: 2x the "
        "arrival span + 600)", metavar="SECONDS",
    )  # fmt: skip
    seed: int = _runs(0, "first seed")
    out: str = _runs("", "directory for runs.jsonl, summary.json, plots")


OPTION_CLASSES = (WorkloadOptions, ClusterOptions, RunOptions)
