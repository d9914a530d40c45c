"""Decode-layer microbenchmark for the device check (tests/gpu/device_check.sh): one layer of
TokenLake's per-layer path (the put scatter, the planned prefix part, the merge with the
new token) against FlashInfer's own paged decode over the same pages and batch, no remote
parts. Prints one JSON line per batch size: both times, their ratio, kernels per layer.

NOT RUN ON A GPU in this repository's history until a device session runs it. On CPU (or
without FlashInfer) it runs TokenLake's path on the available backend and says so.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from tokenlake.engines.client.prefix_attention import PrefixAttention
from tokenlake.engines.core.puts import scatter_indices, scatter_rows
from tokenlake.engines.kernels.cpu import CpuPart
from tokenlake.engines.kernels.inputs import PagedCSR
from tokenlake.engines.kernels.op_count import OpCounter


def _flashinfer():
    try:
        import flashinfer

        return flashinfer
    except ImportError:
        return None


def bench_one(batch: int, ctx: int, args, device: torch.device, fi) -> dict:
    h_q, h_kv, d, page = args.num_q_heads, args.num_kv_heads, args.head_dim, args.page_len
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ctx -= ctx % page == 0  # the new token then lands in the last prefix page, as in decode
    pages_per = -(-ctx // page)
    num_slots = batch * pages_per + 1
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn((num_slots, 2, page, h_kv, d), generator=gen).to(device, dtype)
    kv_indptr = np.arange(batch + 1, dtype=np.int32) * pages_per
    kv_indices = np.arange(batch * pages_per, dtype=np.int32)
    last_len = np.full(batch, ctx - (pages_per - 1) * page, dtype=np.int32)  # prefix keys
    i32 = dict(dtype=torch.int32, device=device)
    csr = (
        torch.arange(batch + 1, **i32),
        torch.tensor(kv_indptr, **i32),
        torch.tensor(kv_indices, **i32),
        torch.tensor(last_len, **i32),
    )
    q = torch.randn((batch, h_q, d), generator=gen).to(device, dtype)
    kv = torch.randn((batch, 2, h_kv, d), generator=gen).to(device, dtype)
    # the new token's put: row b into its request's last page, at offset last_len[b]
    runs = np.stack(
        [np.arange(batch), np.ones(batch), kv_indices[kv_indptr[1:] - 1], last_len], axis=1
    ).astype(np.int32)
    src, dst = (torch.from_numpy(a).to(device) for a in scatter_indices(runs, page))
    backend = "flashinfer" if fi is not None and device.type == "cuda" else "cpu"
    if backend == "flashinfer":
        from tokenlake.engines.kernels.flashinfer_backend import FlashInferPlanner

        planner = FlashInferPlanner(fi, device, (h_q, h_kv, d, page), dtype)
        part = planner.plan(PagedCSR(*csr))
    else:
        part = CpuPart(PagedCSR(*csr)) if device.type == "cpu" else None
    attention = PrefixAttention.bind(
        np.arange(batch + 1), (batch, h_q, d), h_kv, dtype, device=device,
        backend=None if part is not None else "torch",
    )  # fmt: skip

    def tokenlake_layer():
        scatter_rows(pool, kv, src, dst)
        o_p, lse_p = part.run(q, pool)
        return attention(q, kv[:, 0], kv[:, 1], o_p, lse_p)

    result = {"batch": batch, "context": ctx, "device": str(device), "backend": backend}
    if part is None:
        return {**result, "note": "CUDA without FlashInfer: no planned kernel to time"}
    tokenlake_layer()
    with OpCounter() as counter:
        tokenlake_layer()
    result["tokenlake_kernels_per_layer"] = counter.num_kernels
    result["tokenlake_host_reads_per_layer"] = counter.num_host_reads
    result["tokenlake_us"] = _time(tokenlake_layer, device, args.iters)
    if backend == "flashinfer":
        # FlashInfer's own paged decode over the same pages (the new token already written)
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device=device), "NHD"
        )
        full_last = torch.tensor(last_len + 1, **i32)
        wrapper.plan(csr[1], csr[2], full_last, h_q, h_kv, d, page, q_data_type=dtype)
        result["flashinfer_us"] = _time(lambda: wrapper.run(q, pool), device, args.iters)
        with OpCounter() as counter:
            wrapper.run(q, pool)
        result["flashinfer_kernels_per_layer"] = counter.num_kernels
        result["ratio"] = result["tokenlake_us"] / result["flashinfer_us"]
    else:
        result["note"] = "no FlashInfer here: TokenLake's path only, on the " + backend + " kernel"
    return result


def _time(fn, device: torch.device, iters: int) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[64])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-len", type=int, default=16)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    fi = _flashinfer() if device.type == "cuda" else None
    for context in args.context:
        for batch in args.batch:
            print(json.dumps(bench_one(batch, context, args, device, fi)), flush=True)


if __name__ == "__main__":
    main()
