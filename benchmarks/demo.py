"""The embedded CPU demo: replay the start of the Mooncake conversation trace through a
4-instance in-process TokenLake cluster and check results against monolithic attention.

    python -m benchmarks.demo [--requests 300] [--scale 16] [--backend cpu]

Lengths are divided by ``--scale`` (a 512-token trace block becomes one 32-token segment)
and outputs are capped so the run fits 2 CPU cores; the run prints exactly what it scaled.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

import tokenlake as tl
from benchmarks.progress import Progress
from benchmarks.traces import TokenSynth, conversation_trace, load_trace
from tokenlake.engines.local_cluster import LocalCluster
from tokenlake.engines.synthetic import SyntheticModel, run_iteration

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


@dataclass(eq=False)
class Req:
    rid: int
    tokens: np.ndarray
    prompt_len: int
    num_outputs: int
    stored: int = 0
    generated: int = 0
    rng: np.random.Generator = field(default_factory=np.random.default_rng)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--trace",
        default=None,
        help="Mooncake-schema JSONL(.gz) trace (default: the shared conversation trace, or "
        "the bundled excerpt of its first 1,000 requests)",
    )
    p.add_argument("--requests", type=int, default=300, help="first N requests of the trace")
    p.add_argument("--scale", type=int, default=16, help="divide every length by this")
    p.add_argument("--max-outputs", type=int, default=4, help="cap on output tokens per request")
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--slots", type=int, default=1536, help="segment slots per instance")
    p.add_argument("--chunk-segments", type=int, default=8, help="prefill chunk, in segments")
    p.add_argument("--max-decode-batch", type=int, default=32)
    p.add_argument("--verify-fraction", type=float, default=0.05)
    p.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32")
    p.add_argument("--backend", choices=["cpu", "torch"], default="cpu")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    synth = TokenSynth(block_size=512, scale=args.scale)
    args.trace = args.trace or str(conversation_trace(args.requests))
    trace = load_trace(args.trace, args.requests)
    seg = synth.block_len
    shape = tl.ModelShape(
        num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=args.dtype
    )
    config = tl.PoolConfig(shape, args.instances, args.slots, segment_len=seg, namespace="demo")
    pool = tl.Pool(config)
    cluster = LocalCluster(pool, backend=args.backend)
    model = SyntheticModel(shape, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    raw_in = sum(r.input_len for r in trace)
    print(
        f"TokenLake demo: {len(trace)} requests of {args.trace.split('/')[-1]}, "
        f"{args.instances} instances x {args.slots} slots x {seg} tokens "
        f"({config.capacity_tokens:,} tokens, {config.capacity_tokens * shape.kv_bytes_per_token / 2**20:.0f} MiB)\n"
        f"  scaled: lengths / {args.scale} (512-token blocks -> {seg}-token segments; "
        f"{raw_in:,} -> {sum(synth.input_len(r) for r in trace):,} input tokens); outputs capped "
        f"at {args.max_outputs} tokens; model {shape.num_layers} layers, H_q={shape.num_q_heads}, "
        f"H_kv={shape.num_kv_heads}, D={shape.head_dim}, {args.dtype}; kernel backend {args.backend}"
    )
    waiting = deque(
        Req(i, synth.prompt(r), synth.input_len(r), min(synth.output_len(r), args.max_outputs))
        for i, r in enumerate(trace)
    )
    prefilling: list[Req] = []
    decoding: list[Req] = []
    chunk_len = args.chunk_segments * seg
    tol, max_err, verified_rows, finished = TOLERANCE[args.dtype], 0.0, 0, 0
    progress = Progress(len(trace), "requests finished")
    while waiting or prefilling or decoding:
        batches: list[list[tl.Chunk]] = []
        tree = pool.get_prefix_tree()
        if decoding:
            batches.append(
                [tl.Chunk(r.rid, r.tokens, r.stored) for r in decoding[: args.max_decode_batch]]
            )
        while waiting and len(prefilling) < args.instances:
            r = waiting.popleft()
            r.stored = min(tree.match(r.tokens).num_tokens, r.prompt_len - 1)
            prefilling.append(r)
        for r in prefilling[: args.instances - len(batches)]:
            end = min(r.prompt_len, (r.stored // seg) * seg + chunk_len)
            batches.append([tl.Chunk(r.rid, r.tokens, r.stored, end)])
        plans = pool.gen_plans(batches, tree=tree)
        chunks = {c.request_id: c for b in batches for c in b}
        results = run_iteration(cluster, plans, chunks, model)
        for res in results:
            if rng.random() < args.verify_fraction:
                c = chunks[res.request_id]
                o, lse = model.reference(c.token_ids, res.first, res.end, res.layer)
                err = max(float((o - res.o).abs().max()), float((lse - res.lse).abs().max()))
                max_err = max(max_err, err)
                verified_rows += res.end - res.first
        pool.commit(plans)
        for c in chunks.values():
            r = next(x for x in prefilling + decoding if x.rid == c.request_id)
            r.stored = c.end
            if r in prefilling and c.end == r.prompt_len:
                prefilling.remove(r)
                r.generated = 1
                r.tokens = np.append(r.tokens, r.rng.integers(0, 32_000)).astype(np.int32)
                decoding.append(r)
            elif r in decoding:
                r.generated += 1
                r.tokens = np.append(r.tokens, r.rng.integers(0, 32_000)).astype(np.int32)
        for r in [r for r in decoding if r.generated >= r.num_outputs]:
            decoding.remove(r)
            pool.finish(r.rid)
            finished += 1
        progress.update(finished, f"hit {pool.get_stats()['hit_rate']:.1%}")
    progress.close(f"hit {pool.get_stats()['hit_rate']:.1%}")
    pool.check_invariants()
    wall = time.perf_counter() - t0
    stats = pool.get_stats()
    summary = {
        "requests": len(trace),
        "iterations": stats["num_iterations"],
        "hit_rate": round(stats["hit_rate"], 4),
        "load_cv": round(stats["load_cv"], 4),
        "instance_load_tokens": [int(x) for x in stats["instance_load"]],
        "segments_stored": stats["num_segments"],
        "evictions": stats["num_evictions"],
        "bytes_stored": stats["bytes_stored"],
        "bytes_saved_by_dedup": stats["bytes_saved_by_dedup"],
        "dedup_segments": stats["num_dedup_segments"],
        "verified_rows": verified_rows,
        "max_abs_err": max_err,
        "wall_s": round(wall, 1),
    }
    print(
        f"hit rate {stats['hit_rate']:.1%} | per-instance access-load CV {stats['load_cv']:.1%} | "
        f"segments stored {stats['num_segments']:,} ({stats['bytes_stored'] / 2**20:.1f} MiB) | "
        f"saved by dedup {stats['bytes_saved_by_dedup'] / 2**20:.1f} MiB "
        f"({stats['num_dedup_segments']} segments) | evictions {stats['num_evictions']:,}\n"
        f"verified {verified_rows:,} query rows against monolithic attention: max abs error "
        f"{max_err:.2e} (tolerance {tol:g}) | wall time {wall:.1f} s"
    )
    print(json.dumps(summary))
    if max_err > tol:
        print("FAILED: query results differ from monolithic attention", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
