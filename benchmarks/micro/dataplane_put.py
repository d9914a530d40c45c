"""The put case of bench_dataplane (see its docstring) and the timing helpers it shares with
the query case: medians of calls interleaved or in blocks of their own, wall and CPU time."""

from __future__ import annotations

import os
import statistics
import time

import torch

from tokenlake.engines.core import puts

ONE_THREAD = 1 << 50  # put_parallel_min_bytes that keeps every put on the calling thread


def paired_median_ms(fns, reps: int, warmup: int = 2) -> list[float]:
    """Median wall time of each function, calls interleaved so that load from other
    processes on the machine hits every variant alike."""
    return [wall for wall, _ in paired_medians(fns, reps, warmup)]


def paired_medians(fns, reps: int, warmup: int = 2) -> list[tuple[float, float]]:
    """``(wall ms, calling thread's CPU ms)`` medians of each function, calls interleaved.
    The CPU time leaves out the time the thread waited for a core: on a busy machine the
    steadier measure of work done in the calling thread (a put inside one host is)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [([], []) for _ in fns]
    for _ in range(reps):
        for fn, (wall, cpu) in zip(fns, times, strict=True):
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
    return [(1e3 * statistics.median(w), 1e3 * statistics.median(c)) for w, c in times]


def block_medians(fns, reps: int, warmup: int = 2, raw: bool = False) -> list:
    """Each function called ``reps`` times in a block of its own (after ``warmup`` calls):
    ``(wall ms, calling thread's CPU ms)`` medians, or with ``raw`` the lists of seconds."""
    out = []
    for fn in fns:
        for _ in range(warmup):
            fn()
        wall, cpu = [], []
        for _ in range(reps):
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
        out.append(
            (wall, cpu) if raw else (1e3 * statistics.median(wall), 1e3 * statistics.median(cpu))
        )
    return out


def bench_put(pool, cluster, chunk, reps, rounds, gen) -> dict:
    plans = pool.gen_plans([[chunk]])
    tp = plans.transfer_plans[0]
    engine = cluster.engine(tp.origin)
    views = {i: b.views(cluster.layout) for i, b in enumerate(cluster.buffers)}  # same memory
    dsts = tp.dst_ids.tolist()
    min_parallel_bytes = cluster.config.put_parallel_min_bytes
    if min_parallel_bytes is None:
        min_parallel_bytes = puts.PUT_PARALLEL_MIN_BYTES
    kv_buf = engine.init_transfer(tp)
    kv_buf.copy_(torch.randn(kv_buf.shape, generator=gen).to(kv_buf.dtype))
    nbytes = kv_buf.numel() * kv_buf.element_size()

    def put_all():
        for layer in range(kv_buf.shape[0]):
            engine.put(kv_buf, layer)
        cluster.synchronize()

    num_layers = kv_buf.shape[0]
    src = torch.randn(nbytes // 4, generator=gen)
    dst = torch.empty_like(src)
    # per call: one layer's bytes per copy, as a put moves them
    pairs = list(
        zip(dst.view(num_layers, -1).unbind(0), src.view(num_layers, -1).unbind(0), strict=True)
    )

    def memcpy_per_call():
        for d, s in pairs:
            d.copy_(s)

    def memcpy_whole():
        dst.copy_(src)

    # small puts take microseconds: repeat them more, so preemption on a shared machine
    # does not decide the median
    reps = reps * max(1, (8 << 20) // nbytes)
    per_block = max(1, reps // rounds)

    def all_threads(fns):
        # between calls its OpenMP workers spin: on a busy machine they would take the other
        # core from every call timed next to them, so it only runs in blocks of its own
        torch.set_num_threads(os.cpu_count() or 1)
        try:
            return block_medians(fns, per_block, raw=True)
        finally:
            torch.set_num_threads(1)

    # each copy in blocks of its own (its data as warm as it gets when repeated), the blocks
    # alternated over `rounds`, so that the machine's load changes hit all of them alike
    blocks = [([], []) for _ in range(5)]
    for _ in range(rounds):
        timed = block_medians([put_all, memcpy_per_call, memcpy_whole], per_block, raw=True)
        timed += all_threads([memcpy_per_call, memcpy_whole])
        for (wall, cpu), (w, c) in zip(blocks, timed, strict=True):
            wall.extend(w)
            cpu.extend(c)
    medians = [(1e3 * statistics.median(w), 1e3 * statistics.median(c)) for w, c in blocks]
    (put_ms, put_cpu_ms), (memcpy1_ms, memcpy_cpu_ms), (whole1_ms, _) = medians[:3]
    (memcpy_n_ms, _), (whole_n_ms, _) = medians[3:]
    memcpy_ms = min(memcpy1_ms, memcpy_n_ms)  # compare against the better memcpy
    # the previous protocol: put and the one-thread memcpy interleaved call by call
    (put_paired_ms, _), (memcpy_paired_ms, _) = paired_medians([put_all, memcpy_whole], reps)
    # the copy alone, split over the kernels' threads vs on the calling thread, interleaved
    targets = [(views[h].pool, puts.put_runs(tp, k).as_array()) for k, h in enumerate(dsts)]
    host = puts.host_rows(kv_buf)

    def copy_all(min_bytes: int):
        for layer in range(num_layers):
            for kv_pool, runs in targets:
                puts.write_runs(kv_pool, runs, host[layer], layer, min_bytes)

    (copy_ms, _), (copy1_ms, _) = paired_medians(
        [lambda: copy_all(0), lambda: copy_all(ONE_THREAD)], reps
    )
    pool.abort(plans)
    put_gbps, memcpy_gbps = nbytes / put_ms / 1e6, nbytes / memcpy_ms / 1e6
    return {
        "bytes": nbytes,
        "destinations": len(tp.dst_ids),
        "put_ms": put_ms,
        "memcpy_ms": memcpy_ms,
        "put_GBps": put_gbps,
        "memcpy_GBps": memcpy_gbps,
        "ratio": put_gbps / memcpy_gbps,
        "memcpy_1thread_ms": memcpy1_ms,
        "memcpy_all_threads_ms": memcpy_n_ms,
        "ratio_1thread": memcpy1_ms / put_ms,
        "put_cpu_ms": put_cpu_ms,
        "memcpy_cpu_ms": memcpy_cpu_ms,
        "ratio_cpu": memcpy_cpu_ms / put_cpu_ms,
        "memcpy_whole_1thread_ms": whole1_ms,
        "memcpy_whole_all_threads_ms": whole_n_ms,
        "ratio_whole": min(whole1_ms, whole_n_ms) / put_ms,
        "put_paired_ms": put_paired_ms,
        "memcpy_paired_ms": memcpy_paired_ms,
        "ratio_paired": memcpy_paired_ms / put_paired_ms,
        "copy_ms": copy_ms,
        "copy_1thread_ms": copy1_ms,
        "split_speedup": copy1_ms / copy_ms,
        "put_parallel_min_bytes": None if min_parallel_bytes >= ONE_THREAD else min_parallel_bytes,
    }
