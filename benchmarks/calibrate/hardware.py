"""Calibrate a CPU hardware profile for the simulator from the engines' own profiler.

The real model engine (``ModelEngine`` over an in-process ``LocalCluster``, the data plane
``tokenlake serve`` runs by default) is timed on this machine for one of
:data:`tokenlake.benchmarks.real.cluster.MODELS`: prefill batches (new tokens, batch size,
cached prefix), decode steps (batch size, context length) and the fixed cost of a remote
prefix part (:func:`tokenlake.scheduler.profiler.measure_hop_seconds`: round trip, merge,
per-layer signal). Every case is the fastest of ``--repeats`` runs in *process CPU time*:
what the work costs this process, whatever else shares the machine's cores (the wall clock
of a shared 2-core machine mostly measures waiting). How busy instances share the cores is
the simulator's job (the profile's ``host_cores``).

The rows are fitted into the form the simulator consumes (:mod:`tokenlake.benchmarks.sim.
cpu_profile`): effective FLOP/s and memory bandwidth of the roofline, fixed costs per step
and per row, and the hop, written as one JSON file that ``tokenlake goodput
--hardware-profile FILE`` and ``tokenlake bench sim-vs-real`` read.

    tokenlake bench calibrate-cpu --model tiny-random --out results/cpu_profile_tiny.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tokenlake.benchmarks.sim.cpu_profile import (
    DECODE,
    PREFILL,
    CpuProfile,
    MeasuredRow,
    fit_cpu_profile,
    model_profile_of,
)

SEGMENT_LEN = 32  # tokenlake serve's default
# (new tokens per request, batch size, cached prefix per request)
PREFILL_CASES = (
    (16, 1, 0), (64, 1, 0), (256, 1, 0), (512, 1, 0), (64, 4, 0), (128, 4, 0),
    (32, 1, 512), (32, 1, 2048), (128, 2, 1024),
)  # fmt: skip
# (batch size, context per request)
DECODE_CASES = (
    (1, 32), (1, 512), (1, 2048), (4, 128), (4, 1024), (16, 64), (16, 512), (32, 256),
)  # fmt: skip
QUICK_PREFILL = ((16, 1, 0), (256, 1, 0), (64, 4, 0), (32, 1, 512))
QUICK_DECODE = ((1, 32), (1, 1024), (8, 256))


class _Bench:
    """A 1-instance pool and the model engine over it: prefixes stored once, then timed
    chunks planned on them and aborted, so every repeat sees the same state."""

    def __init__(self, model, num_slots: int, clock: Callable[[], float], seed: int) -> None:
        import tokenlake as tl
        from tokenlake.engines.clusters.local import LocalCluster
        from tokenlake.engines.model.engine import ModelEngine

        self.pool = tl.Pool(tl.PoolConfig(model.shape, 1, num_slots, SEGMENT_LEN))
        self.engine = ModelEngine(model, LocalCluster(self.pool))
        self.vocab, self.clock = model.config.vocab_size, clock
        self.rng = np.random.default_rng(seed)
        self.num = 0

    def _tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(2, self.vocab, n).astype(np.int32)

    def _store(self, prefix_len: int) -> np.ndarray:
        """A fresh request whose first ``prefix_len`` tokens are in the pool (running)."""
        from tokenlake.plans import Chunk

        self.num += 1
        tokens = self._tokens(prefix_len)
        chunk = Chunk(f"cal-{self.num}", tokens, 0)
        plans = self.pool.gen_plans([[chunk]])
        self.engine.run(plans, {chunk.request_id: chunk})
        self.pool.commit(plans)
        self.engine.retire(plans)
        return tokens

    def time_batch(self, new_len: int, batch: int, prefix_len: int, repeats: int) -> float:
        """Fastest of ``repeats`` runs of one iteration: ``batch`` requests computing
        ``new_len`` tokens each after ``prefix_len`` stored ones."""
        from tokenlake.plans import Chunk

        chunks = []
        for _ in range(batch):
            if prefix_len:
                prefix = self._store(prefix_len)
                rid = f"cal-{self.num}"
                tokens = np.concatenate([prefix, self._tokens(new_len)])
                chunks.append(Chunk(rid, tokens, prefix_len))
            else:
                self.num += 1
                chunks.append(Chunk(f"cal-{self.num}", self._tokens(new_len), 0))
        by_id = {c.request_id: c for c in chunks}
        best = float("inf")
        try:
            for _ in range(repeats):
                plans = self.pool.gen_plans([chunks])
                t0 = self.clock()
                self.engine.run(plans, by_id)
                best = min(best, self.clock() - t0)
                self.pool.abort(plans)
                self.engine.retire(plans)
        finally:
            if prefix_len:
                for c in chunks:
                    self.pool.finish(c.request_id)
        return best


def measure(
    model,
    repeats: int = 3,
    quick: bool = False,
    clock: Callable[[], float] = time.process_time,
    seed: int = 0,
) -> tuple[list[MeasuredRow], float]:
    """(measured rows, hop seconds) of ``model`` on this machine, timed on ``clock``."""
    import tokenlake as tl
    from tokenlake.engines.clusters.local import LocalCluster
    from tokenlake.engines.model.engine import ModelEngine
    from tokenlake.scheduler.profiler import measure_hop_seconds

    prefill = QUICK_PREFILL if quick else PREFILL_CASES
    decode = QUICK_DECODE if quick else DECODE_CASES
    need = max(max(b * (n + p) for n, b, p in prefill), max(b * (c + 1) for b, c in decode))
    bench = _Bench(model, need // SEGMENT_LEN + 64, clock, seed)
    bench.time_batch(16, 1, 0, 2)  # warm-up: first calls allocate
    rows = [
        MeasuredRow(PREFILL, b, n, p, bench.time_batch(n, b, p, repeats)) for n, b, p in prefill
    ]
    rows += [MeasuredRow(DECODE, b, 1, c, bench.time_batch(1, b, c, repeats)) for b, c in decode]
    pool = tl.Pool(tl.PoolConfig(model.shape, 2, 64, SEGMENT_LEN))
    engine = ModelEngine(model, LocalCluster(pool))

    def execute(plans, chunks):
        engine.run(plans, chunks)
        engine.retire(plans)

    hop = measure_hop_seconds(
        pool, execute, repeats=max(repeats, 5), vocab=model.config.vocab_size, clock=clock
    )
    return rows, hop


def measure_thread_speedup(model, threads: int, repeats: int = 5, seed: int = 0) -> float:
    """How much faster one step runs on ``threads`` torch and kernel threads than on one
    (what ``tokenlake serve`` uses by default: every core), in *wall* time, the fastest of
    ``repeats`` runs each: the geometric mean over a prefill and a decode case, at least 1."""
    import torch

    from tokenlake.engines.kernels import cpu

    if threads <= 1:
        return 1.0
    bench = _Bench(model, 4096 // SEGMENT_LEN + 64, time.perf_counter, seed)
    ratios = []
    for new_len, batch, prefix in ((256, 1, 0), (1, 16, 256)):
        times = []
        for n in (1, threads):
            torch.set_num_threads(n)
            cpu.set_num_threads(n)
            times.append(bench.time_batch(new_len, batch, prefix, repeats))
        ratios.append(times[0] / times[1])
    torch.set_num_threads(1)
    cpu.set_num_threads(1)
    return max(1.0, float(np.exp(np.mean(np.log(ratios)))))


def calibrate(
    model_name: str, repeats: int, quick: bool, seed: int = 0, serving: bool = True
) -> CpuProfile:
    """Measure ``model_name`` (one of the real cluster's models, the checkpoint the
    wall-clock bench serves) and fit its profile; ``serving``: also the serving path's cost
    on a real ``tokenlake serve`` (:mod:`.sim_calibrate_serving`)."""
    import tempfile

    import torch

    from tokenlake.benchmarks.wallclock.serving_compare import prepare_model
    from tokenlake.engines.kernels import cpu
    from tokenlake.engines.model.llama import LlamaModel

    torch.set_num_threads(1)  # one core per instance, as the processes of a real run
    cpu.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="tokenlake-calibrate-") as tmp:
        model = LlamaModel.from_dir(prepare_model(model_name, Path(tmp), seed))
    rows, hop = measure(model, repeats=repeats, quick=quick, seed=seed)
    cores = os.cpu_count() or 1
    speedup = measure_thread_speedup(model, cores, repeats=1 if quick else 5, seed=seed)
    profile = fit_cpu_profile(
        model_name, model_profile_of(model_name, model.config), rows, hop, cores
    )
    profile = dataclasses.replace(profile, thread_speedup=round(speedup, 3))
    if serving:
        from tokenlake.benchmarks.calibrate.serving import measure_serving

        # the wall-clock bench's two server shapes: a router's one-instance workers on one
        # torch thread, the pool's server of four instances on every core
        shapes = ((1, 1), (4, cores))
        costs = [measure_serving(model_name, profile, n, t, seed=seed) for n, t in shapes]
        for c in costs:
            print(f"serving path, measured: {c.detail}", file=sys.stderr)
        profile = dataclasses.replace(profile, serving=tuple(c.cost for c in costs))
    return profile


def main(argv: list[str] | None = None) -> int:
    from tokenlake.benchmarks.real.cluster import MODELS

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", choices=MODELS, default="tiny-random")
    p.add_argument("--out", type=Path, required=True, help="the profile's JSON file")
    p.add_argument("--repeats", type=int, default=3, help="runs per case; the fastest counts")
    p.add_argument("--quick", action="store_true", help="fewer cases (a smoke run)")
    p.add_argument(
        "--no-serving", action="store_true",
        help="skip the serving path's cost (it starts a tokenlake serve for about a minute)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats: expected >= 1, got {args.repeats}")
    profile = calibrate(args.model, args.repeats, args.quick, serving=not args.no_serving)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    print(f"CPU profile of {args.model} (process CPU time, {profile.host_cores} cores)")
    print(f"{'phase':8s} {'batch':>5s} {'new':>5s} {'prefix':>6s} {'measured':>9s} {'fitted':>9s}")
    for r in profile.rows:
        fitted = profile.predict(r)
        print(
            f"{r.phase:8s} {r.batch:>5d} {r.new_len:>5d} {r.prefix_len:>6d} "
            f"{r.seconds * 1e3:>7.2f}ms {fitted * 1e3:>7.2f}ms"
        )
    print(f"hop (one remote holder per step, all layers): {profile.hop_s * 1e3:.3f} ms")
    print(f"{profile.host_cores} threads vs 1, wall time: {profile.thread_speedup:.2f}x")
    for c in profile.serving:
        print(
            f"serving path, {c.num_instances} instance(s) on {c.torch_threads} thread(s): "
            f"{c.request_s * 1e3:.2f} ms per request, {c.token_s * 1e6:.0f} us per streamed "
            f"token, {c.iteration_s * 1e6:.0f} us per serving-loop iteration"
        )
    print(json.dumps({"bench": "calibrate-cpu", "model": args.model, **profile.summary()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
