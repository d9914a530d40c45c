"""Control-plane benchmark: ``gen_plans`` latency, and trace replays for load balance and hit
rate against a perfect global LRU of the same capacity.

    python -m tokenlake.benchmarks.micro.plans [--quick] [--skip-latency] [--skip-replay]
        [--baseline DIR]

Latency: N instances × R running requests whose prompts are the first R requests of the
Mooncake conversation trace (real lengths and sharing, 512-token segments); one decode step
for all R in N batches is planned, timed, and aborted, many times. ``p50_ms`` is wall time,
``p50_cpu_ms`` the thread's CPU time (steadier on a shared machine). Every ``interval``-th
call also decides replication (the heavy-hitter search): it shows in ``p99_ms``.
``--baseline DIR`` times the same cases side by side on another revision's control plane
(DIR holds its ``tokenlake/``, e.g. ``git archive main tokenlake | tar -x -C DIR``), rounds
alternating between the two, and reports the ratios. Replay: each trace is
replayed through the real control plane at 8 instances (one prefill iteration per request,
8 requests per iteration, then ``finish``), with and without replication. Prints a table and
one JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import site
import subprocess
import sys
import time
from collections import OrderedDict

import numpy as np

import tokenlake as tl
from tokenlake.benchmarks.progress import Progress
from tokenlake.benchmarks.workloads.traces import (
    CONVERSATION_TRACE,
    SYNTHETIC_TRACE,
    TokenSynth,
    conversation_trace,
    load_trace,
)
from tokenlake.cluster.balancer import BalancerConfig

SHAPE = tl.ModelShape(num_layers=32, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def build_running(num_instances: int, num_requests: int, trace, synth) -> tuple[tl.Pool, list]:
    """A pool with ``num_requests`` admitted and prefilled requests from the trace."""
    prompts = [synth.prompt(r) for r in trace[:num_requests]]
    seg = synth.block_len
    slots = sum(len(p) // seg + 2 for p in prompts) // num_instances + 64
    pool = tl.Pool(tl.PoolConfig(SHAPE, num_instances, slots, seg))
    for i in range(0, len(prompts), num_instances):
        batches = []
        for rid in range(i, min(i + num_instances, len(prompts))):
            ids = prompts[rid]
            hit = min(pool.get_prefix_tree().match(ids).num_tokens, len(ids) - 1)
            batches.append([tl.Chunk(rid, ids, hit)])
        pool.commit(pool.gen_plans(batches))
    return pool, prompts


def bench_latency(num_instances: int, num_requests: int, repeats: int, trace, synth) -> dict:
    pool, prompts = build_running(num_instances, num_requests, trace, synth)
    decode = [tl.Chunk(rid, np.append(p, 1), len(p)) for rid, p in enumerate(prompts)]
    per_batch = -(-len(decode) // num_instances)
    batches = [decode[i : i + per_batch] for i in range(0, len(decode), per_batch)]
    times, cpu_times = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        plans = pool.gen_plans(batches)
        cpu_times.append(time.thread_time() - c0)
        times.append(time.perf_counter() - t0)
        pool.abort(plans)
    pool.check_invariants()
    pages = sum(len(p) // synth.block_len for p in prompts)
    return {
        "case": "gen_plans",
        "num_instances": num_instances,
        "num_requests": num_requests,
        "num_prefix_segments": pages,
        "p50_ms": 1e3 * float(np.percentile(times, 50)),
        "p99_ms": 1e3 * float(np.percentile(times, 99)),
        "p50_cpu_ms": 1e3 * float(np.percentile(cpu_times, 50)),
    }


# Runs this file's latency cases in a child interpreter whose ``tokenlake`` is another
# revision's source tree: ``-S`` skips the editable install's import hook, the compiled
# ``_C`` of this build is preloaded, and ``tokenlake.benchmarks`` is this directory.
_BASELINE_CHILD = """
import importlib.util, json, sys
base, site_dirs, c_path, bench_dir, cases = json.loads(sys.argv[1])
sys.path[:0] = [base]
sys.path += site_dirs
def load(name, path, search=None):
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=search)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
load("tokenlake._C", c_path)
import tokenlake
assert tokenlake.__file__.startswith(base), tokenlake.__file__
load("tokenlake.benchmarks", bench_dir + "/__init__.py", [bench_dir])
from tokenlake.benchmarks.micro import plans as bench_plans
print(json.dumps(bench_plans.latency_cases(cases)), flush=True)
"""


def latency_cases(cases: list[list[int]]) -> list[dict]:
    """``bench_latency`` for each ``[num_instances, num_requests, repeats]``."""
    synth = TokenSynth(block_size=512)
    num_requests = max(r for _, r, _ in cases)  # --quick fits the excerpt bundled for clones
    trace = load_trace(conversation_trace(num_requests), num_requests)
    return [bench_latency(n, r, k, trace, synth) for n, r, k in cases]


def baseline_cases(base: str, cases: list[list[int]]) -> list[dict]:
    """:func:`latency_cases` on the control plane in ``base`` (see the module docstring)."""
    from pathlib import Path

    from tokenlake import _C

    base_dir = Path(base).resolve()
    if not (base_dir / "tokenlake" / "__init__.py").is_file():
        raise SystemExit(f"--baseline: expected a directory holding tokenlake/, got {base}")
    bench_dir = str(Path(__file__).resolve().parents[1])  # benchmarks/, the package
    arg = json.dumps([str(base_dir), site.getsitepackages(), _C.__file__, bench_dir, cases])
    out = subprocess.run(
        [sys.executable, "-S", "-c", _BASELINE_CHILD, arg],
        capture_output=True, text=True, check=False, timeout=3600,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"--baseline: the child failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def perfect_lru_hit_rate(trace, capacity_blocks: int, block_len: int) -> float:
    """A block-level global LRU of ``capacity_blocks``, served strictly in order, with the
    pool's hit rule (the cached prefix, at most prompt length − 1 tokens)."""
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for r in trace:
        n = 0
        while n < len(r.hash_ids) and r.hash_ids[n] in lru:
            n += 1
        input_len = -(-r.input_len * block_len // 512)
        hit += min(n * block_len, input_len - 1, input_len)
        total += input_len
        for h in r.hash_ids:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hit / total


def replay(trace, synth, num_instances: int, slots: int, replicate: bool, label: str) -> dict:
    pool = tl.Pool(
        tl.PoolConfig(SHAPE, num_instances, slots, synth.block_len),
        balancer=BalancerConfig(replicate=replicate),
    )
    progress = Progress(len(trace), f"{label} replicate={replicate}")
    t0 = time.perf_counter()
    for i in range(0, len(trace), num_instances):
        batches = []
        for rid in range(i, min(i + num_instances, len(trace))):
            ids = synth.prompt(trace[rid])
            hit = min(pool.get_prefix_tree().match(ids).num_tokens, len(ids) - 1)
            batches.append([tl.Chunk(rid, ids, hit)])
        pool.commit(pool.gen_plans(batches))
        for b in batches:
            pool.finish(b[0].request_id)
        progress.update(min(i + num_instances, len(trace)))
    progress.close()
    pool.check_invariants()
    stats = pool.get_stats()
    return {
        "hit_rate": stats["hit_rate"],
        "mean_load_cv": stats["mean_load_cv"],
        "num_replicas": stats["num_replicas"] - stats["num_segments"],
        "replication_bytes": stats["replication_bytes"],
        "wall_s": time.perf_counter() - t0,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="fewer repeats and shorter replays")
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument("--skip-replay", action="store_true")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument(
        "--baseline",
        metavar="DIR",
        help="another revision's source tree (DIR/tokenlake) to time side by side",
    )
    p.add_argument(
        "--rounds", type=int, default=2, help="alternating rounds with --baseline (default 2)"
    )
    p.add_argument(
        "--capacity-fraction",
        type=float,
        default=0.25,
        help="replay pool capacity as a fraction of the trace's distinct blocks",
    )
    args = p.parse_args(argv)
    synth = TokenSynth(block_size=512)
    rows = []
    if not args.skip_latency:
        sizes = (64, 256) if args.quick else (64, 256, 2048)
        cases = [
            [n, r, max(5, args.repeats // (4 if r > 256 else 1))]
            for n in (8, 16, 64)
            for r in sizes
        ]
        rounds = [latency_cases(cases)]
        base_rounds = []
        for _ in range(args.rounds if args.baseline else 0):  # alternate: base, this, ...
            base_rounds.append(baseline_cases(args.baseline, cases))
            rounds.append(latency_cases(cases))
        for c, (n, r, _) in enumerate(cases):
            res = dict(rounds[-1][c])
            for key in ("p50_ms", "p99_ms", "p50_cpu_ms"):  # median over rounds
                res[key] = float(np.median([rnd[c][key] for rnd in rounds]))
            if base_rounds:
                for key in ("p50_ms", "p50_cpu_ms"):
                    base = float(np.median([rnd[c][key] for rnd in base_rounds]))
                    res[f"baseline_{key}"] = base
                    res[f"speedup_{key[:-3]}"] = base / res[key]
            target = {(8, 256): 1.0, (64, 2048): 20.0}.get((n, r))
            res["target_p50_ms"] = target
            res["meets_target"] = None if target is None else res["p50_ms"] <= target
            rows.append(res)
            print(json.dumps(res), flush=True)
    if not args.skip_replay:
        for path in (CONVERSATION_TRACE, SYNTHETIC_TRACE):
            trace = load_trace(path, 2000 if args.quick else None)
            distinct = len({h for r in trace for h in r.hash_ids})
            capacity = int(distinct * args.capacity_fraction)
            n = 8
            ref = perfect_lru_hit_rate(trace, capacity, synth.block_len)
            for replicate in (False, True):
                out = replay(trace, synth, n, capacity // n, replicate, path.name.split("_")[2])
                res = {
                    "case": "replay",
                    "trace": path.name,
                    "num_requests": len(trace),
                    "num_instances": n,
                    "capacity_segments": capacity // n * n,
                    "replicate": replicate,
                    **out,
                    "perfect_lru_hit_rate": ref,
                    "hit_rate_vs_perfect_lru": out["hit_rate"] / ref if ref else None,
                }
                rows.append(res)
                print(json.dumps(res), flush=True)
    print(
        "\n"
        + "\n".join(
            " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())
            for r in rows
        )
    )


if __name__ == "__main__":
    main()
