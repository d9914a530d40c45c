"""Cross-node data plane vs same-node, and the Ray launch's start-up time.

* query: per-layer latency of ``engine.query`` (decode, 4 requests x 1 row) over a 1K and a
  4K-token prefix spread on two instances, with the instances on one host (shared memory)
  and as two hosts (q rows and ``(o, lse)`` over ``torch.distributed`` point-to-point, gloo):
  two clusters over identical pools, calls interleaved, the ratio from one run.
* put: bandwidth of ``put`` (all layers of a 1K / 4K-token chunk, until landed) on both.
* launch: seconds from ``Launch.start()`` to a serving API for 4 instances on 2 nodes of a
  Ray cluster started here on 127.0.0.1 (``ray.cluster_utils.Cluster``), and to shut down.

On one machine "two hosts" is gloo over loopback TCP (``DataPlaneConfig.separate_hosts``, the
same code path as two nodes); a real network adds its own latency and bandwidth limits.
Helpers come from :mod:`tokenlake.benchmarks.micro.dataplane`. Prints a table and one JSON line per case.
Run: ``python -m tokenlake.benchmarks.micro.cross_node [--quick] [--no-launch]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

import tokenlake as tl
from tokenlake.benchmarks.micro.dataplane import add_shape_arguments, populate
from tokenlake.benchmarks.micro.dataplane_put import paired_median_ms
from tokenlake.engines.clusters.mp import MPCluster
from tokenlake.engines.dataplane_config import DataPlaneConfig

VOCAB = 50_000


def _pools(args, shape) -> tuple[tl.Pool, tl.Pool]:
    c = args.segment_len
    tokens = sum(p * (args.decode_requests + 2) for p in args.prefixes)
    cfg = tl.PoolConfig(shape, 2, num_slots=tokens // c // 2 + 64, segment_len=c)
    return tl.Pool(cfg), tl.Pool(cfg)


def _query(pools, clusters, chunks, reps, gen) -> dict:
    """Interleaved per-layer query latency of the same plan on both clusters."""
    calls, num_layers, holders = [], pools[0].config.model.num_layers, set()
    q = None
    for pool, cluster in zip(pools, clusters, strict=True):
        plans = pool.gen_plans([chunks], instances=[[0]])
        qp = plans.query_plans[0]
        holders.add(tuple(qp.holder_ids.tolist()))
        engine = cluster.engine(qp.origin)
        q_buf = engine.init_query(qp)
        if q is None:
            q = torch.randn(q_buf.shape, generator=gen).to(q_buf.dtype)
        q_buf.copy_(q)
        counter = iter(range(10**9))
        calls.append((pool, plans, engine, q_buf, counter))
    outs = [c[2].query(c[3], 0) for c in calls]
    diff = float((outs[0][0] - outs[1][0]).abs().max())
    same_ms, cross_ms = paired_median_ms(
        [lambda c=c: c[2].query(c[3], next(c[4]) % num_layers) for c in calls], reps
    )
    for pool, plans, *_ in calls:
        pool.abort(plans)
    (holder_ids,) = holders  # identical placement on both pools
    return {"same_node_ms": same_ms, "cross_node_ms": cross_ms, "latency_ratio": cross_ms / same_ms,
            "holders": list(holder_ids), "max_abs_diff": diff}  # fmt: skip


def _put(pools, clusters, chunk, reps, gen) -> dict:
    calls, kv = [], None
    for pool, cluster in zip(pools, clusters, strict=True):
        plans = pool.gen_plans([[chunk]], instances=[[0]])
        tp = plans.transfer_plans[0]
        engine = cluster.engine(tp.origin)
        kv_buf = engine.init_transfer(tp)
        if kv is None:
            kv = torch.randn(kv_buf.shape, generator=gen).to(kv_buf.dtype)
        kv_buf.copy_(kv)

        def put_all(engine=engine, kv_buf=kv_buf, cluster=cluster):
            for layer in range(kv_buf.shape[0]):
                engine.put(kv_buf, layer)
            cluster.synchronize()

        calls.append((pool, plans, put_all, tp))
    nbytes = kv.numel() * kv.element_size()
    same_ms, cross_ms = paired_median_ms([c[2] for c in calls], reps)
    for pool, plans, *_ in calls:
        pool.abort(plans)
    return {"bytes": nbytes, "destinations": calls[0][3].dst_ids.tolist(),
            "same_node_GBps": nbytes / same_ms / 1e6, "cross_node_GBps": nbytes / cross_ms / 1e6,
            "same_node_ms": same_ms, "cross_node_ms": cross_ms,
            "bandwidth_ratio": same_ms / cross_ms}  # fmt: skip


def run_dataplane(args) -> list[dict]:
    shape = tl.ModelShape(args.layers, args.q_heads, args.kv_heads, args.head_dim, args.dtype)
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    pools = _pools(args, shape)
    rows = max(*args.prefixes, args.decode_requests) + 8
    prompts = {
        f"doc{p}-{k}": rng.integers(0, VOCAB, p)
        for p in args.prefixes
        for k in range(args.decode_requests)
    }
    out = []
    configs = [
        DataPlaneConfig(max_q_rows=rows, max_kv_rows=rows, timeout_s=120.0, separate_hosts=sep)
        for sep in (False, True)
    ]
    with (
        MPCluster(pools[0], configs[0], backend=args.backend) as same,
        MPCluster(pools[1], configs[1], backend=args.backend) as cross,
    ):
        clusters = (same, cross)
        for pool, cluster in zip(pools, clusters, strict=True):
            populate(pool, cluster, prompts, torch.Generator().manual_seed(args.seed))
        for p in args.prefixes:
            decode = [
                tl.Chunk(rid, np.append(ids, 1), p)
                for rid, ids in prompts.items()
                if rid.startswith(f"doc{p}-")
            ]
            res = _query(pools, clusters, decode, args.reps, gen)
            label = f"decode {args.decode_requests}x1 rows, prefix {p}"
            out.append({"case": "query", "workload": label, **res})
        for p in args.prefixes:
            chunk = tl.Chunk(f"fresh{p}", rng.integers(0, VOCAB, p), 0)
            res = _put(pools, clusters, chunk, args.reps, gen)
            label = f"put chunk {p} tokens ({shape.num_layers} layers)"
            out.append({"case": "put", "workload": label, **res})
    return out


def run_launch(args) -> dict:
    """Start a 2-node Ray cluster on 127.0.0.1, time a 4-instance launch on it."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray: keep loopback
    import logging
    import shutil
    import tempfile

    import ray
    from ray.cluster_utils import Cluster

    from tokenlake.serve.config import ServeConfig
    from tokenlake.serve.ray.config import LaunchLayout
    from tokenlake.serve.ray.launch import Launch, LaunchOptions

    temp_dir = tempfile.mkdtemp(prefix="tlray")
    common = {"node_ip_address": "127.0.0.1", "num_cpus": 2, "object_store_memory": 100 << 20}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**common, "resources": {"node0": 8}, "include_dashboard": False,
                        "temp_dir": temp_dir},
    )  # fmt: skip
    try:
        cluster.add_node(**common, resources={"node1": 8})
        ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
        serve = ServeConfig(num_instances=4, segment_len=32, num_slots=128, chunk_len=128,
                            profile=False, port=0, scheduler_mode="colocated")  # fmt: skip
        layout = LaunchLayout(4, cpus_per_instance=0.5, node_resources=("node0", "node1"))
        options = LaunchOptions(serve, layout, address=cluster.address, name="bench",
                                startup_timeout_s=600.0, host="127.0.0.1")  # fmt: skip
        launch = Launch(options)
        t0 = time.perf_counter()
        launch.start()
        start_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        launch.shutdown()
        stop_s = time.perf_counter() - t0
        return {"case": "launch", "workload": "4 instances on 2 nodes (tiny-random)",
                "placement_s": launch.timings["placement_s"], "start_s": start_s,
                "shutdown_s": stop_s}  # fmt: skip
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(p)
    p.add_argument("--prefixes", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--decode-requests", type=int, default=4)
    p.add_argument("--backend", default="cpu", choices=["cpu", "torch"])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-launch", action="store_true", help="skip the Ray launch timing")
    p.add_argument("--quick", action="store_true", help="few repetitions")
    args = p.parse_args(argv)
    if args.quick:
        args.reps = 5
    torch.set_num_threads(1)  # like the engines (see bench_dataplane)
    rows = run_dataplane(args)
    if not args.no_launch:
        rows.append(run_launch(args))
    print(f"{'case':6}  {'workload':38} {'same node':>12} {'cross node':>12} {'cross/same':>10}")
    for r in rows:
        if r["case"] == "query":
            a, b = f"{r['same_node_ms']:.2f} ms", f"{r['cross_node_ms']:.2f} ms"
            print(f"{r['case']:6}  {r['workload']:38} {a:>12} {b:>12} {r['latency_ratio']:10.2f}")
        elif r["case"] == "put":
            a, b = f"{r['same_node_GBps']:.2f} GB/s", f"{r['cross_node_GBps']:.2f} GB/s"
            print(f"{r['case']:6}  {r['workload']:38} {a:>12} {b:>12} {r['bandwidth_ratio']:10.2f}")
        else:
            print(f"{r['case']:6}  {r['workload']:38} start {r['start_s']:.1f} s "
                  f"(placement {r['placement_s']:.1f} s), shutdown {r['shutdown_s']:.1f} s")  # fmt: skip
    for r in rows:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))


if __name__ == "__main__":
    main()
