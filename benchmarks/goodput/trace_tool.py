"""``tokenlake trace``: what a Mooncake-format trace holds, and a converted copy of it.

    tokenlake trace my_trace.jsonl.gz                       # counts, lengths, hit rate
    tokenlake trace my_trace.jsonl --max-requests 500 --out head500.jsonl.xz --time-scale 0.5

Prints the number of requests and sessions, the time span and mean rate, percentiles of the
input and output lengths, the distinct blocks, and the infinite-cache hit rate (the share of
prompt tokens in whole blocks an earlier request already had: what a cache that never evicts
would serve), then one JSON line. ``--out`` writes the selected requests (``--offset``,
``--max-requests``, timestamps times ``--time-scale``) as Mooncake JSONL with a ``block_size``
field, compressed by the name's suffix (``.gz``, ``.xz``, else plain). The schema and its
checks are :mod:`tokenlake.benchmarks.workloads.traces`'; a malformed line is reported with its line number
and field.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import lzma
import sys
from pathlib import Path

import numpy as np

from tokenlake.benchmarks.goodput.report import infinite_hit_rate
from tokenlake.benchmarks.workloads import TraceConfig, Workload, trace_workload
from tokenlake.benchmarks.workloads.traces import TraceError, TraceRequest, read_trace

log = logging.getLogger(__name__)
PERCENTILES = (50, 90, 99)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("path", help="Mooncake-format JSONL trace (plain, .gz or .xz)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per hash_ids block")
    p.add_argument("--offset", type=int, default=0, help="first request (file order)")
    p.add_argument("--max-requests", type=int, default=0, help="requests to read (0: all)")
    p.add_argument("--out", default="", help="write the selected requests here (.gz/.xz/plain)")
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="--out: multiply timestamps by this"
    )
    return p


def _lengths(values: list[int]) -> dict:
    a = np.asarray(values, dtype=np.float64)
    out = {"mean": round(float(a.mean()), 1)}
    for q in PERCENTILES:
        out[f"p{q}"] = round(float(np.percentile(a, q)), 1)
    out["max"] = int(a.max())
    return out


def summarize(w: Workload) -> dict:
    """Counts, span, length percentiles and the infinite-cache hit rate of a workload."""
    reqs = w.requests
    span = max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs)
    return {
        "requests": len(reqs),
        "sessions": len({r.session for r in reqs if r.session >= 0}),
        "block_size": w.block_size,
        "span_s": round(span, 3),
        "rate_req_s": round(len(reqs) / span, 4) if span > 0 else None,
        "input_len": _lengths([r.input_len for r in reqs]),
        "output_len": _lengths([r.output_len for r in reqs]),
        "prompt_tokens": sum(r.input_len for r in reqs),
        "distinct_blocks": len({b for r in reqs for b in r.block_ids}),
        "infinite_cache_hit_rate": round(infinite_hit_rate(w), 4),
    }


def print_summary(name: str, s: dict) -> None:
    rate = f"{s['rate_req_s']:g} req/s" if s["rate_req_s"] else "all at once"
    print(
        f"{name}: {s['requests']} requests, {s['sessions']} sessions, block size "
        f"{s['block_size']}, span {s['span_s']:g} s ({rate})"
    )
    head = " ".join(f"{k:>9}" for k in ("mean", *(f"p{q}" for q in PERCENTILES), "max"))
    print(f"{'tokens':<14}{head}")
    for key in ("input_len", "output_len"):
        row = s[key]
        print(f"{key:<14}" + " ".join(f"{row[k]:>9g}" for k in row))
    print(
        f"{s['prompt_tokens']:,} prompt tokens in {s['distinct_blocks']:,} distinct blocks; "
        f"infinite-cache hit rate {100 * s['infinite_cache_hit_rate']:.1f}%"
    )


def write_trace(
    rows: list[TraceRequest], block_size: int, out: Path, time_scale: float = 1.0
) -> None:
    """``rows`` as Mooncake JSONL at ``out`` (gzip for ``.gz``, xz for ``.xz``)."""
    opener = {".gz": gzip.open, ".xz": lzma.open}.get(out.suffix, open)
    with opener(out, "wt", encoding="utf-8") as f:
        for r in rows:
            line = {
                "timestamp": round(r.arrival_ms * time_scale, 3),
                "input_length": r.input_len,
                "output_length": r.output_len,
                "hash_ids": list(r.hash_ids),
                "block_size": block_size,
            }
            if r.session_id is not None:
                line["session_id"] = r.session_id
            f.write(json.dumps(line) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("offset", "max_requests"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')}: expected >= 0, got {getattr(args, name)}")
    if args.block_size is not None and args.block_size < 1:
        p.error(f"--block-size: expected >= 1, got {args.block_size}")
    if not args.time_scale > 0:
        p.error(f"--time-scale: expected > 0, got {args.time_scale}")
    limit = args.max_requests or None
    name = Path(args.path).name
    try:
        log.info("reading %s", args.path)
        w = trace_workload(TraceConfig(args.path, limit, args.offset, block_size=args.block_size))
        summary = summarize(w)
        if args.out:
            end = None if limit is None else args.offset + limit
            rows, block_size = read_trace(args.path, end, args.block_size)
            write_trace(rows[args.offset :], block_size, Path(args.out), args.time_scale)
            log.info("wrote %d requests to %s", len(rows) - args.offset, args.out)
    except (TraceError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_summary(name, summary)
    print(json.dumps({"trace": name, **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
