"""Shared-page groups on the CPU kernel: a holder's decode part whose requests share a prefix
(a system prompt), run as it is (every request reads its copy of the shared pages) and with
shared-page groups (each shared page read once), side by side on the same pool and q rows.

For each case (``--requests`` x ``--shared-tokens``; every request also has
``--private-tokens`` of its own): per-layer milliseconds of ``BoundPart.attend`` both ways,
medians over ``--rounds`` rounds that alternate the two so the machine's load hits both
alike, their ratio (``speedup``), and the KV tokens each reads. The results agree to float
rounding (``max_abs_diff``). The default heads are Llama-3-8B's (32 query, 8 KV, D 128), whose
shared prefix outgrows the CPU caches; with fewer KV heads it may not. Prints a table and one
JSON line per case.
Run: ``python -m tokenlake.benchmarks.micro.page_groups``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from tokenlake.engines.core.executor import BoundPart
from tokenlake.engines.core.page_groups import group_shared_pages, read_tokens
from tokenlake.plans import HolderPart


def decode_part(
    num_requests: int, shared_pages: int, private_pages: int, page_len: int
) -> HolderPart:
    """One row per request; request ``e`` reads the shared pages then its own, the last
    one half full."""
    shared = list(range(shared_pages))
    pages, next_slot = [], shared_pages
    for _ in range(num_requests):
        pages.append(shared + list(range(next_slot, next_slot + private_pages)))
        next_slot += private_pages
    kv_indptr = np.concatenate([[0], np.cumsum([len(p) for p in pages])])
    return HolderPart(
        0,
        np.arange(num_requests, dtype=np.int32),
        np.arange(num_requests + 1, dtype=np.int32),
        kv_indptr.astype(np.int32),
        np.array([s for p in pages for s in p], dtype=np.int32),
        np.full(num_requests, page_len // 2, dtype=np.int32),
    )


def bench_case(args, num_requests: int, shared_tokens: int, gen: torch.Generator) -> dict:
    c = args.page_len
    shared_pages, private_pages = shared_tokens // c, max(1, args.private_tokens // c)
    part = decode_part(num_requests, shared_pages, private_pages, c)
    num_slots = shared_pages + num_requests * private_pages
    pool = torch.randn((num_slots, 2, c, args.kv_heads, args.head_dim), generator=gen)
    q = torch.randn((num_requests, args.q_heads, args.head_dim), generator=gen)
    grouped = BoundPart.from_part(part, "cpu", page_len=c)
    plain = BoundPart.from_part(part, "cpu")
    times: dict[str, list[float]] = {"plain": [], "grouped": []}
    for _ in range(args.rounds):
        for name, bound in (("plain", plain), ("grouped", grouped)):
            t0 = time.perf_counter()
            for _ in range(args.reps):
                bound.attend(q, pool, "cpu")
            times[name].append((time.perf_counter() - t0) / args.reps * 1e3)
    o_plain, lse_plain = plain.attend(q, pool, "cpu")
    o_grouped, lse_grouped = grouped.attend(q, pool, "cpu")
    groups = group_shared_pages(part.q_indptr, part.kv_indptr, part.kv_indices, part.last_len, c)
    plain_ms, grouped_ms = (float(np.median(times[k])) for k in ("plain", "grouped"))
    return {
        "bench": "page_groups",
        "requests": num_requests,
        "shared_tokens": shared_pages * c,
        "private_tokens": private_pages * c,
        "plain_ms": round(plain_ms, 4),
        "grouped_ms": round(grouped_ms, 4),
        "speedup": round(plain_ms / grouped_ms, 3),
        "plain_read_tokens": read_tokens(part.kv_indptr, part.last_len, c),
        "grouped_read_tokens": read_tokens(groups.kv_indptr, groups.last_len, c),
        "max_abs_diff": float((o_plain - o_grouped).abs().max()),
        "max_lse_diff": float((lse_plain - lse_grouped).abs().max()),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, nargs="+", default=[16, 64])
    p.add_argument("--shared-tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--private-tokens", type=int, default=256)
    p.add_argument("--page-len", type=int, default=256)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small shapes, few repetitions")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.shared_tokens, args.rounds, args.reps = [8], [256], 2, 1
        args.head_dim, args.page_len, args.q_heads, args.kv_heads = 32, 32, 16, 4
    gen = torch.Generator().manual_seed(args.seed)
    rows = [bench_case(args, b, s, gen) for b in args.requests for s in args.shared_tokens]
    print(f"{'requests':>8} {'shared':>7} {'plain ms':>9} {'grouped ms':>10} {'speedup':>8} "
          f"{'read plain':>10} {'read grouped':>12}")  # fmt: skip
    for r in rows:
        print(
            f"{r['requests']:>8} {r['shared_tokens']:>7} {r['plain_ms']:>9.3f} "
            f"{r['grouped_ms']:>10.3f} {r['speedup']:>7.2f}x {r['plain_read_tokens']:>10} "
            f"{r['grouped_read_tokens']:>12}"
        )
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
