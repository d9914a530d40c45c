"""Prefix-attention kernels on the CPU: the C++ kernel vs the torch reference vs SDPA.

    python -m tokenlake.benchmarks.micro.attention [--quick] [--prefix-lens 8192 32768] [--repeats 5]
        [--logit-cap 50] [--baseline-core OTHER_BUILD/_C.cpython-*.so]

Cases: decode (1 query row for each of 8 requests) and a prefill chunk (512 query rows, 1
request), each over 8K- and 32K-token prefixes held in a paged pool (page size 16, slots in
shuffled order), in float32 and bfloat16; attention is non-causal, as for a prefix.

Soft cap: ``cpp_softcap_ms`` is the same C++ call with ``logit_cap=--logit-cap`` (Gemma-2's 50
by default), ``softcap_cost`` its extra time over the uncapped call (``cpp_ms``), timed in
alternation with it (``softcap_cost_cpu``: the same in process CPU time, steadier under load).

Before/after: ``--baseline-core`` loads the ``_C`` extension of another build (e.g. main
before a kernel change, built with cmake from that commit's sources) next to this one; each
case then also times both cores called directly on the same arguments, uncapped, in
alternation (``core_ms``, ``baseline_core_ms``, ``core_vs_baseline`` = their ratio; ``*_cpu*``
the same in process CPU time), and checks that they return the same output
(``core_vs_baseline_max_abs_diff``).

Baselines:
- ``torch_ref``: ``partial_attention(..., backend="torch")``, the reference (gathers pages,
  repeats the KV heads for GQA, dense fp32 matmuls; the test oracle, not tuned).
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` on K/V
  already gathered per request into contiguous ``[B, H_kv, L, D]`` tensors of the same dtype.
  The gather is done once outside the timed region, so SDPA is timed on data in its preferred
  layout -- favourable to SDPA, which in serving would have to gather the pages first.

Memory bandwidth: ``cpp_gbps`` = bytes of K+V the kernel must read / its time; ``memcpy_gbps`` =
bytes copied / time for ``torch.Tensor.copy_`` of a buffer of the same size as the case's K+V
(at least ``--flush-mib``, 512 MiB by default, so larger than the LLC; median of 3), measured
just before each case so both see the same machine load (each copied byte is also written, so
memcpy moves twice the bytes it is credited with); ``fraction_of_memcpy_bw`` = cpp_gbps /
memcpy_gbps.

Every timed call starts with a cold last-level cache (``--flush-mib`` of writes first, excluded
from the time): in serving each layer's K/V is read once per step from a pool far larger than
the LLC, and an 8K-token batch (256-512 MiB) could otherwise sit in a large LLC between repeats.
Timings are medians over ``--repeats`` runs after ``--warmup`` runs; the reference, seconds per
call, gets ``--ref-repeats`` runs after ``--ref-warmup`` (default 0: the cases before warm it up,
and its first-call costs are small next to its runtime). Threads: torch uses
``torch.get_num_threads()``; the C++ kernel its own pool of ``--threads`` (default: all hardware
threads). Prints one table, then one JSON line per case.

Boundary cost (``boundary_*`` lines): what the public functions add to the C++ core on a decode
step, in process CPU time (see :mod:`tokenlake.benchmarks.micro.attention_boundary`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from tokenlake import _C
from tokenlake.benchmarks.micro.attention_boundary import boundary_cases, core_call, load_core
from tokenlake.benchmarks.micro.attention_inputs import (
    DTYPES,
    PAGE_LEN,
    Case,
    Inputs,
    Timer,
    build_pool,
    make_inputs,
)
from tokenlake.engines.kernels import cpu, partial_attention


def run_case(
    case: Case, dtype: str, inputs: Inputs, args: argparse.Namespace, timer: Timer, baseline=None
) -> dict:
    kernel_args = inputs.args
    pool = kernel_args[2]
    load_avg = os.getloadavg()[0]  # other work on the machine skews every number below
    kv_bytes = case.num_reqs * case.prefix_len * 2 * pool[0, 0, 0].numel() * pool.element_size()
    bw = timer.memcpy_gbps(kv_bytes, min(3, args.repeats))

    def cpp():
        return partial_attention(*kernel_args, backend="cpu")

    def sdpa():
        return F.scaled_dot_product_attention(
            inputs.sdpa_q, inputs.sdpa_k, inputs.sdpa_v, enable_gqa=True
        )

    timed = {
        "cpp": cpp,
        "cpp_softcap": lambda: partial_attention(
            *kernel_args, backend="cpu", logit_cap=args.logit_cap
        ),
    }
    if baseline is not None:
        timed["core"], core_out = core_call(_C, kernel_args, case.head_dim)
        timed["baseline_core"], baseline_out = core_call(baseline, kernel_args, case.head_dim)
    ms = timer.alternating(timed, args.repeats, args.warmup)  # name -> (wall, cpu)
    cpp_ms = ms["cpp"][0]
    sdpa_ms = timer.median_ms(sdpa, args.repeats, args.warmup)
    ref = lambda: partial_attention(*kernel_args, backend="torch")  # noqa: E731
    ref_ms = timer.median_ms(ref, args.ref_repeats, args.ref_warmup)
    o_cpp, _ = cpp()
    o_sdpa = sdpa().float().transpose(1, 2).reshape(o_cpp.shape)
    cpp_gbps = kv_bytes / cpp_ms / 1e6
    # QK^T and PV: 2 multiply-adds per (row, q head, key, d).
    flops = (
        4 * case.num_reqs * case.rows_per_req * case.num_q_heads * case.prefix_len * case.head_dim
    )
    return {
        "case": case.name,
        "dtype": dtype,
        "prefix_len": case.prefix_len,
        "num_reqs": case.num_reqs,
        "num_rows": case.num_reqs * case.rows_per_req,
        "heads": f"{case.num_q_heads}/{case.num_kv_heads}x{case.head_dim}",
        "cpp_ms": round(cpp_ms, 3),
        "cpp_softcap_ms": round(ms["cpp_softcap"][0], 3),
        "softcap_cost": round(ms["cpp_softcap"][0] / cpp_ms - 1, 4),
        "softcap_cost_cpu": round(ms["cpp_softcap"][1] / ms["cpp"][1] - 1, 4),
        "torch_ref_ms": round(ref_ms, 3),
        "sdpa_ms": round(sdpa_ms, 3),
        "speedup_vs_sdpa": round(sdpa_ms / cpp_ms, 3),
        "speedup_vs_ref": round(ref_ms / cpp_ms, 3),
        "kv_bytes": kv_bytes,
        "cpp_gbps": round(cpp_gbps, 2),
        "memcpy_gbps": round(bw, 2),
        "fraction_of_memcpy_bw": round(cpp_gbps / bw, 3),
        "cpp_gflops": round(flops / cpp_ms / 1e6, 1),
        "sdpa_gflops": round(flops / sdpa_ms / 1e6, 1),
        "max_abs_diff_vs_sdpa": float((o_cpp - o_sdpa).abs().max()),
        **(
            {
                "core_ms": round(ms["core"][0], 3),
                "baseline_core_ms": round(ms["baseline_core"][0], 3),
                "core_vs_baseline": round(ms["core"][0] / ms["baseline_core"][0], 4),
                "core_cpu_ms": round(ms["core"][1], 3),
                "baseline_core_cpu_ms": round(ms["baseline_core"][1], 3),
                "core_vs_baseline_cpu": round(ms["core"][1] / ms["baseline_core"][1], 4),
                "core_vs_baseline_max_abs_diff": float((core_out[0] - baseline_out[0]).abs().max()),
            }
            if baseline is not None
            else {}
        ),
        "load_avg_1m": round(load_avg, 2),
    }


def print_table(rows: list[dict], cols: list[tuple[str, int]] | None = None) -> None:
    cols = cols or [
        ("case", 8), ("dtype", 9), ("prefix_len", 10), ("num_rows", 8), ("heads", 10),
        ("cpp_ms", 9), ("cpp_softcap_ms", 14), ("softcap_cost", 12), ("torch_ref_ms", 12),
        ("sdpa_ms", 9), ("speedup_vs_sdpa", 15), ("cpp_gbps", 8), ("memcpy_gbps", 11),
        ("fraction_of_memcpy_bw", 21),
    ]  # fmt: skip
    if rows and "core_vs_baseline" in rows[0]:
        cols += [("core_ms", 9), ("baseline_core_ms", 16), ("core_vs_baseline", 16),
                 ("core_vs_baseline_cpu", 20)]  # fmt: skip
    print(" ".join(f"{name:>{width}}" for name, width in cols))
    for row in rows:
        print(" ".join(f"{row[name]!s:>{width}}" for name, width in cols))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8K prefix only, 3 repeats")
    parser.add_argument("--prefix-lens", type=int, nargs="*", default=[8192, 32768])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--cases", nargs="+", choices=["decode", "prefill"],
                        default=["decode", "prefill"])  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--ref-repeats", type=int, default=1)
    parser.add_argument("--ref-warmup", type=int, default=0)
    parser.add_argument("--flush-mib", type=int, default=512, help="LLC-evicting writes per run")
    parser.add_argument("--threads", type=int, default=None, help="C++ kernel threads")
    parser.add_argument("--decode-heads", type=int, nargs=3, default=[32, 8, 128],
                        metavar=("H_Q", "H_KV", "D"))  # fmt: skip
    parser.add_argument("--prefill-heads", type=int, nargs=3, default=[8, 2, 128],
                        metavar=("H_Q", "H_KV", "D"))  # fmt: skip
    parser.add_argument("--boundary-prefix-lens", type=int, nargs="*", default=[16, 4096],
                        help="decode prefixes for the boundary-cost lines (none: skip)")  # fmt: skip
    parser.add_argument("--boundary-heads", type=int, nargs=3, default=[8, 2, 64],
                        metavar=("H_Q", "H_KV", "D"))  # fmt: skip
    parser.add_argument("--boundary-calls", type=int, default=200)
    parser.add_argument("--logit-cap", type=float, default=50.0,
                        help="soft cap of the cpp_softcap_ms timing (Gemma-2's is 50)")  # fmt: skip
    parser.add_argument("--baseline-core", metavar="SO", default=None,
                        help="the _C extension of another build to time against this one")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    baseline = load_core(args.baseline_core) if args.baseline_core else None
    if args.quick:
        args.prefix_lens, args.repeats = [8192], 3
    if args.threads is not None:
        cpu.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    print(
        f"threads: torch {torch.get_num_threads()}, cpp {cpu.get_num_threads()}; page size "
        f"{PAGE_LEN}; decode heads H_q/H_kv x D = {'/'.join(map(str, args.decode_heads[:2]))}"
        f"x{args.decode_heads[2]}; prefill heads {'/'.join(map(str, args.prefill_heads[:2]))}"
        f"x{args.prefill_heads[2]} (reduced from the decode config so the 512-row chunk over "
        "32K keys stays affordable for the reference on 2 cores)",
        file=sys.stderr,
    )
    timer = Timer(args.flush_mib)
    results = []
    for prefix_len in args.prefix_lens:
        for name in args.cases:
            hq, hkv, d = args.decode_heads if name == "decode" else args.prefill_heads
            reqs, rows = (8, 1) if name == "decode" else (1, 512)
            case = Case(name, reqs, rows, prefix_len, hq, hkv, d)
            pool, slots = build_pool(case, gen)
            for dtype in args.dtypes:
                inputs = make_inputs(case, pool.to(DTYPES[dtype]), slots, gen)
                results.append(run_case(case, dtype, inputs, args, timer, baseline))
                print(json.dumps(results[-1]), file=sys.stderr)
                del inputs
            del pool
    boundary = []
    for prefix_len in args.boundary_prefix_lens:
        case = Case("decode", 8, 1, prefix_len, *args.boundary_heads)
        pool, slots = build_pool(case, gen)
        for dtype in args.dtypes:
            boundary += boundary_cases(
                case, dtype, pool.to(DTYPES[dtype]), slots, args.boundary_calls, gen
            )
    print_table(results)
    if boundary:
        cols = [("case", 26), ("dtype", 9), ("prefix_len", 10), ("num_pages", 9), ("heads", 8),
                ("public_us", 9), ("core_us", 8), ("overhead_us", 11)]  # fmt: skip
        print_table(boundary, cols)
    for row in results + boundary:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
