"""Latency of the scheduler's §6.2 DP (C++ core) per iteration.

    python -m tokenlake.benchmarks.micro.scheduler [--quick] [--instances 8 16 64] [--prefill 16 64 256]

Each case is one iteration's decision for ``N`` instances, ``P`` prefill chunks and
``--decode`` decode steps, in elastic mode (prefill DoP 1..N, decode DoP 1), with the latency
model fitted to the roofline cost model of ``--hardware`` / ``--model`` and cache load
``--load``. Prefill chunks are 1..8 segments of 512 tokens (a chunk_len of 4096) behind
random prefixes; SLOs are 10x the batch-size-1 latency (TBT for decode steps; per input token
for prefill chunks, capped by the TBT while decodes run, as the scheduler does).

Timed (median and p90 over ``--repeats`` after one warmup):
- ``dp_ms``: ``tokenlake.scheduler.dp.solve`` -- the C++ DP through its binding, on a ready
  ``DPProblem``;
- ``decide_ms``: ``plan_batches`` -- building the problem from work items (sort, SLOs, the
  coefficient table), the DP, and the batches of ``Chunk`` handed to ``gen_plans``;
- ``ref_ms`` (only when ``--reference`` and at most 64 prefill chunks): the plain-Python
  reference DP, for scale.
When no plan meets every SLO (``slo_met`` false: these uncapped batches of up to 256 x 4096
tokens overload the cluster) the DP runs a second time without SLOs, so those rows time the
worst case. Target: ``dp_ms`` <= 2 ms at N=8 with 64 prefill chunks. Prints a table, then one
JSON line per case.

``--cpu-profile`` also measures latency-model rows on this machine's in-process engine
(``LocalCluster`` + ``SyntheticModel``: deterministic K/V, the C++ attention kernels, real puts
and queries; 2 instances, 4 layers, 8/2 heads of dim 64, segments of 64 tokens) with
``tokenlake.scheduler.profiler``, fits ``T = A + B·Σl + C·Σl²`` per DoP and prints the
coefficients and the fit's relative errors as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import tokenlake as tl
from tokenlake.cluster.profiles import HARDWARE, MODELS
from tokenlake.engines.client.synthetic import SyntheticModel, run_iteration
from tokenlake.engines.clusters.local import LocalCluster
from tokenlake.scheduler import (
    DECODE,
    PREFILL,
    CostModel,
    SchedulerConfig,
    WorkItem,
    default_cases,
    fit_latency_model,
    measure_rows,
    plan_batches,
    solve,
    solve_reference,
)
from tokenlake.scheduler.policy import build_problem

SEGMENT = 512
CHUNK = 4096
TARGET_MS = 2.0
TARGET_CASE = (8, 64)


def make_items(num_prefill: int, num_decode: int, rng: np.random.Generator) -> list[WorkItem]:
    items = []
    # the DP reads lengths only and gen_plans is not called; one read-only int32 buffer long
    # enough for every item (a Chunk checks its end against its tokens), shared without a copy
    dummy = np.zeros(64 * SEGMENT + CHUNK + 200_001, dtype=np.int32)
    dummy.flags.writeable = False
    for i in range(num_prefill):
        prefix = int(rng.integers(0, 64)) * SEGMENT
        end = prefix + int(rng.integers(1, CHUNK // SEGMENT + 1)) * SEGMENT
        items.append(WorkItem(f"p{i}", PREFILL, dummy, prefix, end, i))
    for i in range(num_decode):
        ctx = int(np.exp(rng.uniform(np.log(1000), np.log(200_000))))
        items.append(WorkItem(f"d{i}", DECODE, dummy, ctx, ctx + 1, num_prefill + i))
    return items


def timed(fn, repeats: int) -> tuple[float, float, object]:
    out = fn()  # warmup
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.9 * len(times)))], out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--instances", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--prefill", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--decode", type=int, default=128, help="decode steps per iteration")
    ap.add_argument("--hardware", default="A100-80G", choices=sorted(HARDWARE))
    ap.add_argument("--model", default="LWM-Text-1M", choices=sorted(MODELS))
    ap.add_argument("--load", type=float, default=0.1, help="cache load L")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--budget-s", type=float, default=3.0, help="max seconds of repeats per case")
    ap.add_argument("--reference", action="store_true", help="also time the Python DP")
    ap.add_argument("--quick", action="store_true", help="N=8 with 64 prefill chunks only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-profile", action="store_true", help="also fit a CPU engine profile")
    args = ap.parse_args(argv)
    if args.quick:
        args.instances, args.prefill = [8], [64]
    if args.cpu_profile:
        cpu_profile(args.seed)

    cost = CostModel(HARDWARE[args.hardware], MODELS[args.model])
    latency = cost.fit(dops=(1, 2, 4, 8))
    tbt = 10 * cost.batch_time([1])
    per_token = 10 * cost.batch_time([CHUNK]) / CHUNK
    results = []
    for n in args.instances:
        config = SchedulerConfig(
            n, SEGMENT, chunk_len=CHUNK, tbt_slo=tbt, input_token_slo=per_token
        )
        for p in args.prefill:
            rng = np.random.default_rng([args.seed, n, p])
            items = make_items(p, args.decode, rng)
            decision = plan_batches(items, config, latency, args.load)
            problem, _ = build_problem(items, config, latency, args.load)
            one = timed(lambda pr=problem: solve(pr), 1)[0]
            repeats = max(3, min(args.repeats, int(args.budget_s * 1e3 / max(one, 1e-3))))
            dp_med, dp_p90, result = timed(lambda pr=problem: solve(pr), repeats)
            dec_med, _, _ = timed(
                lambda it=items, cf=config: plan_batches(it, cf, latency, args.load),
                max(3, repeats // 3),
            )
            row = {
                "bench": "scheduler_dp",
                "instances": n,
                "prefill": p,
                "decode": args.decode,
                "hardware": args.hardware,
                "model": args.model,
                "load": args.load,
                "repeats": repeats,
                "dp_ms": round(dp_med, 4),
                "dp_ms_p90": round(dp_p90, 4),
                "decide_ms": round(dec_med, 4),
                "num_batches": len(result.batches),
                "prefill_dops": [d for s, _, d in result.batches if s < problem.num_prefill],
                "slo_met": result.slo_met,
                "same_as_decide": list(decision.dops) == [d for _, _, d in result.batches],
            }
            if args.reference and p <= 64:
                row["ref_ms"] = round(timed(lambda pr=problem: solve_reference(pr), 1)[0], 2)
            if (n, p) == TARGET_CASE:
                row["target_ms"] = TARGET_MS
                row["meets_target"] = dp_med <= TARGET_MS
            results.append(row)

    print(f"DP latency, elastic mode, {args.decode} decode steps, {args.hardware}/{args.model}")
    header = f"{'N':>4} {'prefill':>8} {'dp ms':>9} {'p90 ms':>9} {'decide ms':>10} {'batches':>8}"
    header += f" {'slo met':>8}  target"
    print(header)
    for r in results:
        target = ""
        if "target_ms" in r:
            target = f"<= {TARGET_MS} ms: {'yes' if r['meets_target'] else 'NO'}"
        print(
            f"{r['instances']:>4} {r['prefill']:>8} {r['dp_ms']:>9.3f} {r['dp_ms_p90']:>9.3f} "
            f"{r['decide_ms']:>10.3f} {r['num_batches']:>8} {str(r['slo_met']):>8}  {target}"
        )
    for r in results:
        print(json.dumps(r))


def cpu_profile(seed: int) -> None:
    """Measure rows on the in-process CPU engine, fit, print coefficients and errors."""
    shape = tl.ModelShape(num_layers=4, num_q_heads=8, num_kv_heads=2, head_dim=64)
    pool = tl.Pool(tl.PoolConfig(shape, num_instances=2, num_slots=256, segment_len=64))
    cluster = LocalCluster(pool)
    synth = SyntheticModel(shape, seed=seed)
    cases = default_cases(dops=(1, 2), max_len=1024, num_prefill=16, seed=seed)
    rows = measure_rows(pool, lambda p, c: run_iteration(cluster, p, c, synth), cases, seed=seed)
    model = fit_latency_model(rows)
    errors = [abs(model.predict(r.phase, r.lengths, r.dop) / r.seconds - 1) for r in rows]
    print(
        f"CPU engine profile: {len(rows)} rows, fit relative error median "
        f"{statistics.median(errors):.1%}, max {max(errors):.1%}"
    )
    fits = [(PREFILL, k, c) for k, c in model.prefill.items()] + [(DECODE, 1, model.decode)]
    for phase, dop, c in fits:
        print(
            json.dumps(
                {
                    "bench": "cpu_profile",
                    "phase": phase,
                    "dop": dop,
                    "a_s": c.a,
                    "b_s_per_token": c.b,
                    "c_s_per_token2": c.c,
                }
            )
        )
    print(
        json.dumps(
            {
                "bench": "cpu_profile_fit",
                "rows": len(rows),
                "median_rel_error": statistics.median(errors),
                "max_rel_error": max(errors),
            }
        )
    )


if __name__ == "__main__":
    main()
