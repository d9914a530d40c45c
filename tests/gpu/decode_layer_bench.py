"""Decode-layer microbenchmark for the device check (tests/gpu/device_check.sh): one layer of
TokenLake's decode path against FlashInfer's own paged decode over the same pages and batch,
no remote parts. Prints one JSON line per case (context, batch, holders): both times, their
ratio, kernels per layer of each, and the largest difference of their outputs.

Both sides do the same work besides the prefix split: the same KV write (the new token's put,
one gather and one scatter), FlashInfer's kernels with the same tensor-core rule
(:func:`~tokenlake.engines.kernels.flashinfer_backend.uses_tensor_cores`) and the same FA2
backend. TokenLake's layer splits each request's pages among ``holders`` parts, runs each
(:meth:`FlashInferPart.run_native`, writing FlashInfer's form straight into the merge's
stack) and merges them with the new token by one FlashInfer merge
(:class:`~tokenlake.engines.kernels.flashinfer_merge.DecodeMerge`); FlashInfer's layer decodes
the prefix and the new token at once.

Kernels per layer: on CUDA counted by ``torch.profiler`` (FlashInfer's included). With
``--flashinfer-standin`` (CPU) the same code runs on a FlashInfer stand-in that records its
launches (tests/gpu/flashinfer_standin.py): kernels = aten ops that launch one on a GPU plus
those launches; its times mean nothing. Without FlashInfer or a stand-in it runs TokenLake's
CPU path (C++ kernel, torch merges) and says so.

NOT RUN ON A GPU in this repository's history until a device session runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from tokenlake.engines.client.prefix_attention import PrefixAttention
from tokenlake.engines.core.puts import scatter_indices, scatter_rows
from tokenlake.engines.core.state_merge import StateMerge
from tokenlake.engines.kernels.cpu import CpuPart
from tokenlake.engines.kernels.flashinfer_backend import FlashInferPlanner, uses_tensor_cores
from tokenlake.engines.kernels.inputs import PagedCSR
from tokenlake.engines.kernels.op_count import CudaKernelCounter, OpCounter


def _flashinfer(standin: bool):
    if standin:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from flashinfer_standin import FlashInferStandIn

        return FlashInferStandIn()
    try:
        import flashinfer

        return flashinfer
    except ImportError:
        return None


class Case:
    """One case's tensors: a pool of ``batch`` requests of ``context`` prefix keys each (the
    new token lands in the last prefix page, as in decode), its pages split among ``holders``
    parts, and the new token's q, K, V and put."""

    def __init__(self, batch: int, context: int, holders: int, args, device, dtype) -> None:
        h_q, h_kv, d, page = args.num_q_heads, args.num_kv_heads, args.head_dim, args.page_len
        self.shape, self.batch, self.dtype, self.device = (h_q, h_kv, d, page), batch, dtype, device
        self.context = context - (context % page == 0)
        pages_per = -(-self.context // page)
        if holders > pages_per:
            raise SystemExit(f"--holders {holders}: more than the {pages_per} pages of a request")
        gen = torch.Generator(device).manual_seed(0)  # drawn where they live (1 GB at 2k x 64)
        num_slots = batch * pages_per + 1
        like = dict(generator=gen, device=device, dtype=dtype)
        self.pool = torch.randn((num_slots, 2, page, h_kv, d), **like)
        self.q = torch.randn((batch, h_q, d), **like)
        self.kv = torch.randn((batch, 2, h_kv, d), **like)
        pages = np.arange(batch * pages_per, dtype=np.int32).reshape(batch, pages_per)
        last_len = self.context - (pages_per - 1) * page  # prefix keys in the last page
        # the new token's put: row b into its request's last page, at offset last_len
        runs = np.stack(
            [np.arange(batch), np.ones(batch), pages[:, -1], np.full(batch, last_len)], axis=1
        ).astype(np.int32)
        self.src, self.dst = (torch.from_numpy(a).to(device) for a in scatter_indices(runs, page))
        # holder s reads a contiguous share of every request's pages; the last, the last page
        bounds = np.linspace(0, pages_per, holders + 1).astype(int)
        self.parts = []
        for s in range(holders):
            share = pages[:, bounds[s] : bounds[s + 1]]
            last = last_len if s == holders - 1 else page
            self.parts.append(self.csr(share, np.full(batch, last)))
        self.full = self.csr(pages, np.full(batch, last_len + 1))  # with the new token

    def csr(self, pages: np.ndarray, last_len: np.ndarray) -> PagedCSR:
        i32 = dict(dtype=torch.int32, device=self.device)
        per = pages.shape[1]
        return PagedCSR(
            torch.arange(self.batch + 1, **i32),
            torch.arange(self.batch + 1, **i32) * per,
            torch.tensor(pages.reshape(-1), **i32),
            torch.tensor(last_len, **i32),
        )

    def put(self) -> None:
        scatter_rows(self.pool, self.kv, self.src, self.dst)


def tokenlake_layer(case: Case, fi):
    """TokenLake's decode layer as a callable: FlashInfer's parts and merge when ``fi`` is
    given, else the CPU kernel and torch merges."""
    h_q, h_kv, d, _ = case.shape
    k, v = case.kv[:, 0], case.kv[:, 1]
    offsets = np.arange(case.batch + 1)
    if fi is not None:
        planner = FlashInferPlanner(fi, case.device, case.shape, case.dtype)
        parts = [planner.plan(csr) for csr in case.parts]
        attention = PrefixAttention.bind(
            offsets, (case.batch, h_q, d), h_kv, case.dtype, device=case.device, flashinfer=fi,
            num_prefix_states=len(parts),
        )  # fmt: skip
        o_states, lse_states = attention.prefix_states

        def layer():
            case.put()
            for s, part in enumerate(parts):
                part.run_native(case.q, case.pool, out=o_states[s], lse=lse_states[s])
            return attention(case.q, k, v)[0]

        return layer
    parts = [CpuPart(csr) for csr in case.parts]
    merge = StateMerge.build(np.tile(np.arange(case.batch), len(parts)), case.batch, case.device)
    attention = PrefixAttention.bind(offsets, (case.batch, h_q, d), h_kv, case.dtype)

    def cpu_layer():
        case.put()
        states = [part.run(case.q, case.pool) for part in parts]
        o_p, lse_p = (
            states[0] if len(states) == 1 else merge.run(*map(torch.cat, zip(*states, strict=True)))
        )
        return attention(case.q, k, v, o_p, lse_p)[0]

    return cpu_layer


def flashinfer_layer(case: Case, fi):
    """FlashInfer's own decode layer: the same put, then one paged decode over the prefix and
    the new token, with the same tensor-core rule and backend as TokenLake's parts."""
    h_q, h_kv, d, page = case.shape
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=case.device)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=uses_tensor_cores(h_q, h_kv), backend="fa2"
    )
    _, kv_indptr, kv_indices, last_len = case.full
    wrapper.plan(
        kv_indptr, kv_indices, last_len, h_q, h_kv, d, page, sm_scale=d**-0.5,
        logits_soft_cap=0.0, q_data_type=case.dtype, kv_data_type=case.dtype,
    )  # fmt: skip

    def layer():
        case.put()
        return wrapper.run(case.q, case.pool)

    return layer


def count_kernels(fn, fi) -> tuple[int, int]:
    """(kernels, host reads) of one call: the profiler on CUDA; on CPU the aten ops that launch
    a kernel on a GPU plus the stand-in's launches."""
    if torch.cuda.is_available() and fi is not None and not hasattr(fi, "launches"):
        with CudaKernelCounter() as counter:
            fn()
        return counter.num_kernels, 0  # host reads: counted on CPU (OpCounter)
    before = getattr(fi, "num_launches", 0)
    with OpCounter() as ops:
        fn()
    return ops.num_kernels + getattr(fi, "num_launches", 0) - before, ops.num_host_reads


def bench_one(batch: int, context: int, holders: int, args, device: torch.device, fi) -> dict:
    standin = fi is not None and hasattr(fi, "launches")
    on_flashinfer = fi is not None and (device.type == "cuda" or standin)
    backend = "flashinfer-standin" if standin else "flashinfer" if on_flashinfer else "cpu"
    dtype = torch.bfloat16 if on_flashinfer else torch.float32
    case = Case(batch, context, holders, args, device, dtype)
    result = {"batch": batch, "context": case.context, "holders": holders,
              "device": str(device), "backend": backend}  # fmt: skip
    if device.type == "cuda" and not on_flashinfer:
        return {**result, "note": "CUDA without FlashInfer: no planned kernel to time"}
    ours = tokenlake_layer(case, fi if on_flashinfer else None)
    out = ours()
    kernels, host_reads = count_kernels(ours, fi)
    result["tokenlake_kernels_per_layer"] = kernels
    result["tokenlake_host_reads_per_layer"] = host_reads
    result["counted_by"] = "torch.profiler" if backend == "flashinfer" else "aten ops + launches"
    result["tokenlake_us"] = _time(ours, device, args.iters)
    if not on_flashinfer:
        result["note"] = "no FlashInfer here: TokenLake's path only, on the cpu kernel"
        return result
    theirs = flashinfer_layer(case, fi)
    reference = theirs()
    result["flashinfer_kernels_per_layer"] = count_kernels(theirs, fi)[0]
    result["max_abs_diff"] = float((out.float() - reference.float()).abs().max())
    if standin:
        result["note"] = "FlashInfer stand-in on CPU: kernel counts only, times mean nothing"
        return result
    result["flashinfer_us"] = _time(theirs, device, args.iters)
    result["ratio"] = result["tokenlake_us"] / result["flashinfer_us"]
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
    p.add_argument("--holders", type=int, nargs="+", default=[1])
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-len", type=int, default=16)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--flashinfer-standin", action="store_true",
                   help="CPU: run the CUDA path on a FlashInfer stand-in, to count its kernels")  # fmt: skip
    args = p.parse_args(argv)
    device = torch.device(args.device)
    fi = (
        _flashinfer(args.flashinfer_standin)
        if device.type == "cuda" or args.flashinfer_standin
        else None
    )
    for context in args.context:
        for holders in args.holders:
            for batch in args.batch:
                line = bench_one(batch, context, holders, args, device, fi)
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
