"""Data-plane benchmark: the multi-process engines against in-process work on the same data.

* query: per-layer latency of ``engine.query`` through the engine clients and processes vs
  calling the kernel in-process (``BoundPart.attend`` per holder, plus the merge when there
  are several) on the very same shared pool and q rows, at N=1 and N=2 instances, for
  decode with each ``--prefixes`` length, a prefill chunk, and a one-page decode whose
  ``overhead_us`` (engine minus in-process) is the fixed cost per call. Targets: <= 1.2x in-process at N=1; <= 50 us.
  The remote-part cases run at instance 0 on pages held elsewhere: one row whose one page
  is on another instance (``overhead_us``: the fixed cost of one remote part per layer;
  target: <= 30 us at idle), and one row per other instance, a page on each (the parts run
  in parallel, the in-process baseline one after another). ``--signal`` picks the per-layer
  request to a holder: a doorbell in shared memory (default) or a message.
  (At N=1 the only holder is the caller's own instance, whose part runs in the caller; at
  N=2 the other holder's part is a round trip to its query engine.)
* put: bandwidth of ``put`` (every layer of a chunk, timed until landed) vs ``memcpy``
  (``torch.Tensor.copy_``) of the same bytes, one layer's bytes per copy as a put moves them,
  measured in the same run, at ``--put-kib`` bytes per call (per layer); ``overhead_us``: put
  minus memcpy time per call, the fixed cost of a call. Target: >= 50% of memcpy (``ratio``:
  against the better of one thread's and all threads' copy; ``ratio_1thread``: against one
  thread's). Each is timed in blocks of its own (its data as warm as repetition makes it), the
  blocks alternated over ``--put-rounds`` rounds so the machine's load hits all alike.
  ``memcpy_whole_*``/``ratio_whole``: every layer's bytes in one copy (twice the bytes per
  call at 2 layers: the all-threads copy then gives each core a cache-sized half);
  ``*_paired_ms``/``ratio_paired``: put and that one-thread copy interleaved call by call (the
  earlier protocol: each call evicts the other's data). ``*_cpu_ms``/``ratio_cpu``: the calling
  thread's CPU time against the one-thread memcpy, which a busy machine skews far less than
  wall time (a split put's other threads are not in it). A put of at least
  ``--put-parallel-min-kib`` per call and destination is split over the kernels' threads
  (default: never); ``copy_ms`` vs ``copy_1thread_ms`` (``split_speedup``) is the copy alone,
  split over the kernels' threads vs on the calling thread, calls interleaved.

Prints a table and one JSON line per case. Run: ``python -m tokenlake.benchmarks.micro.dataplane``.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

import tokenlake as tl
from tokenlake.benchmarks.micro.dataplane_put import bench_put, paired_median_ms
from tokenlake.engines.clusters.mp import MPCluster
from tokenlake.engines.core import executor
from tokenlake.engines.core.executor import BoundPart
from tokenlake.engines.dataplane_config import DataPlaneConfig


def populate(pool: tl.Pool, cluster: MPCluster, prompts: dict, gen: torch.Generator) -> None:
    """Store every prompt's KV (random values) through the engines, one request per
    iteration, and commit."""
    for rid, ids in prompts.items():
        plans = pool.gen_plans([[tl.Chunk(rid, ids, 0)]])
        for tp in plans.transfer_plans:
            engine = cluster.engine(tp.origin)
            kv_buf = engine.init_transfer(tp)
            kv_buf.copy_(torch.randn(kv_buf.shape, generator=gen).to(kv_buf.dtype))
            for layer in range(kv_buf.shape[0]):
                engine.put(kv_buf, layer)
        cluster.synchronize()
        pool.commit(plans)


def one_per_holder(pool: tl.Pool, chunks: list) -> list:
    """``{instance: chunk}``: a chunk whose prefix (one page) that instance holds."""
    by_holder = {}
    for chunk in chunks:
        plans = pool.gen_plans([[chunk]])
        holders = {p.instance_id for p in plans.query_plans[0].parts}
        pool.abort(plans)
        by_holder.setdefault(min(holders), chunk)
    return by_holder


def bench_query(pool, cluster, chunks, reps, gen, origin: int | None = None) -> dict:
    plans = pool.gen_plans([chunks], instances=None if origin is None else [[origin]])
    qp = plans.query_plans[0]
    engine = cluster.engine(qp.origin)
    q_buf = engine.init_query(qp)
    q_buf.copy_(torch.randn(q_buf.shape, generator=gen).to(q_buf.dtype))
    views = {i: b.views(cluster.layout) for i, b in enumerate(cluster.buffers)}  # same memory
    parts = [BoundPart.from_part(p, "cpu") for p in qp.parts]
    backend = cluster.backend
    num_layers = pool.config.model.num_layers

    def in_process(layer: int):
        if len(parts) == 1:
            return parts[0].attend(q_buf, views[parts[0].instance_id].pool.layer(layer), backend)
        o = torch.zeros(q_buf.shape, dtype=torch.float32)
        lse = torch.full(q_buf.shape[:2], -float("inf"))
        for part in parts:
            pool_layer = views[part.instance_id].pool.layer(layer)
            o_p, lse_p = part.attend(q_buf, pool_layer, backend)
            executor.merge_rows(o, lse, part.rows, o_p, lse_p, backend)
        return o, lse

    o_e, lse_e = engine.query(q_buf, 0)
    o_i, lse_i = in_process(0)
    diff = float((o_e - o_i).abs().max())
    counter = iter(range(10**9))
    engine_ms, inproc_ms = paired_median_ms(
        [
            lambda: engine.query(q_buf, next(counter) % num_layers),
            lambda: in_process(next(counter) % num_layers),
        ],
        reps,
    )
    pool.abort(plans)
    return {
        "engine_ms": engine_ms,
        "inprocess_ms": inproc_ms,
        "ratio": engine_ms / inproc_ms,
        "holders": len(parts),
        "remote_holders": sum(p.instance_id != qp.origin for p in parts),
        "rows": qp.num_rows,
        "max_abs_diff": diff,
    }


def run_instances(
    n: int, args, rng: np.random.Generator, gen: torch.Generator, doorbells: bool = True
) -> list[dict]:
    shape = tl.ModelShape(args.layers, args.q_heads, args.kv_heads, args.head_dim, args.dtype)
    c, reqs, vocab = args.segment_len, args.decode_requests, 50_000
    row_bytes = 2 * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes
    put_rows = [max(1, kib * 1024 // row_bytes) for kib in args.put_kib]
    tokens_needed = sum(p * (reqs + 1) for p in args.prefixes) + args.prefill_rows
    tokens_needed += 2 * sum(put_rows)
    slots = tokens_needed // c + 4 * (reqs + 4) * len(args.prefixes) + 2 * len(put_rows) + 4 * n
    cfg = tl.PoolConfig(shape, n, num_slots=-(-slots // n) + 8, segment_len=c)
    pool = tl.Pool(cfg)
    rows_cap = max([args.prefill_rows, reqs, *args.prefixes, *put_rows]) + 8
    min_bytes = None if args.put_parallel_min_kib is None else args.put_parallel_min_kib << 10
    dp = DataPlaneConfig(
        max_q_rows=rows_cap,
        max_kv_rows=rows_cap,
        timeout_s=120.0,
        put_parallel_min_bytes=min_bytes,
    )
    prompts = {f"doc{p}-{k}": rng.integers(0, vocab, p) for p in args.prefixes for k in range(reqs)}
    longest = max(args.prefixes)
    prompts["long"] = rng.integers(0, vocab, longest)
    prompts["tiny"] = rng.integers(0, vocab, c)  # one page: the kernel costs next to nothing
    for i in range(4 * n):  # one page each; one per holder is picked below (of 4 per holder)
        prompts[f"hop{i}"] = rng.integers(0, vocab, c)
    out = []
    with MPCluster(cfg, dp, backend=args.backend, doorbells=doorbells) as cluster:
        populate(pool, cluster, prompts, gen)
        cases = []
        for p in args.prefixes:
            decode = [
                tl.Chunk(rid, np.append(ids, 1), p)
                for rid, ids in prompts.items()
                if rid.startswith(f"doc{p}-")
            ]
            cases.append((f"decode {reqs}x1 rows, prefix {p}", decode))
        long_ids = np.concatenate([prompts["long"], rng.integers(0, vocab, args.prefill_rows)])
        cases.append(
            (
                f"prefill {args.prefill_rows} rows, prefix {longest}",
                [tl.Chunk("long", long_ids, longest)],
            )
        )
        tiny = [tl.Chunk("tiny", np.append(prompts["tiny"], 1), c)]
        cases.append((f"fixed cost: decode 1x1 row, prefix {c}", tiny))
        # origin 0; the pages on the other instances: every part is remote
        by_holder = one_per_holder(
            pool, [tl.Chunk(r, np.append(ids, 1), c) for r, ids in prompts.items() if "hop" in r]
        )
        remote = [ch for h, ch in sorted(by_holder.items()) if h != 0]
        if remote:
            cases.append(("remote part: decode 1x1 row, its page on another instance", remote[:1]))
        if len(remote) > 1:
            label = f"remote parts: decode {len(remote)}x1 rows, a page on each other instance"
            cases.append((label, remote))
        for label, chunks in cases:
            hops = label.startswith("remote")
            reps = args.reps * (20 if chunks is tiny or hops else 1)
            res = bench_query(pool, cluster, chunks, reps, gen, 0 if hops else None)
            res["overhead_us"] = 1e3 * (res["engine_ms"] - res["inprocess_ms"])
            if hops:  # the in-process baseline runs the parts one after another
                res["per_remote_part_us"] = res["overhead_us"] / res["remote_holders"]
            res["per_layer_signal"] = "doorbell" if doorbells else "message"
            res["load_avg_1m"] = os.getloadavg()[0]
            out.append({"case": "query", "N": n, "workload": label, **res, "target": "<= 1.2"})
        for kib, rows in zip([] if args.query_only else args.put_kib, put_rows, strict=False):
            put_chunk = tl.Chunk(f"fresh{kib}", rng.integers(0, vocab, rows), 0)
            res = bench_put(pool, cluster, put_chunk, args.reps, args.put_rounds, gen)
            res["bytes_per_call"] = res["bytes"] // shape.num_layers
            # beyond moving the bytes: the fixed cost of one put call
            res["overhead_us"] = 1e3 * (res["put_ms"] - res["memcpy_ms"]) / shape.num_layers
            res["overhead_cpu_us"] = (
                1e3 * (res["put_cpu_ms"] - res["memcpy_cpu_ms"]) / shape.num_layers
            )
            res["load_avg_1m"] = os.getloadavg()[0]
            label = f"{kib} KiB per call ({shape.num_layers} layers x {rows} rows)"
            out.append({"case": "put", "N": n, "workload": label, **res, "target": ">= 0.5"})
    return out


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """The model shape and segment length options (shared with bench_cross_node)."""
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--q-heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--segment-len", type=int, default=256)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", type=int, nargs="+", default=[1, 2])
    add_shape_arguments(p)
    p.add_argument(
        "--prefixes", type=int, nargs="+", default=[1024, 4096], help="decode prefix lengths"
    )
    p.add_argument("--decode-requests", type=int, default=4)
    p.add_argument("--prefill-rows", type=int, default=128)
    p.add_argument("--put-kib", type=int, nargs="+", default=[256, 8192], help="put KiB per call")
    p.add_argument(
        "--put-parallel-min-kib",
        type=int,
        default=None,
        help="split a put over the kernels' threads from this many KiB per call and "
        "destination (default: never, the engines' default; 1024: from 1 MiB)",
    )
    p.add_argument(
        "--put-rounds", type=int, default=5, help="alternations of the put and memcpy blocks"
    )
    p.add_argument("--backend", default="cpu", choices=["cpu", "torch"])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small shapes, few repetitions")
    p.add_argument("--query-only", action="store_true", help="skip the put cases")
    p.add_argument(
        "--signal",
        default="doorbell",
        choices=["doorbell", "message", "both"],
        help="per-layer request to a holder on this host: a doorbell in shared memory, a "
        "message (the earlier protocol), or both in turn",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.prefixes, args.prefill_rows, args.put_kib, args.reps = [1024], 64, [256, 2048], 5
    # like the engines: one torch thread (the kernels have their own pool), so the in-process
    # baseline is not slowed by oversubscribed OpenMP workers on a small machine
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    signals = {"doorbell": [True], "message": [False], "both": [False, True]}[args.signal]
    rows = [
        r
        for n in args.instances
        for bells in signals
        for r in run_instances(n, args, rng, gen, bells)
    ]
    print(
        f"{'case':6} {'N':>2}  {'workload':42} {'engines':>10} {'baseline':>10} {'ratio':>6}  target"
    )
    for r in rows:
        if r["case"] == "query":
            a, b = f"{r['engine_ms']:.2f} ms", f"{r['inprocess_ms']:.2f} ms"
        else:
            a, b = f"{r['put_GBps']:.2f} GB/s", f"{r['memcpy_GBps']:.2f} GB/s"
        print(
            f"{r['case']:6} {r['N']:>2}  {r['workload']:42} {a:>10} {b:>10} {r['ratio']:6.2f}  {r['target']}"
        )
    for r in rows:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))


if __name__ == "__main__":
    main()
