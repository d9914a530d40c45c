"""The host tier on a real CPU server: one command serves the same long-document workload
(documents shared by many requests, Zipf popularity; with the defaults their KV is about 3x
the pool's) twice,
with ``tokenlake serve --host-tier-gb 0`` and with a tier, and reports each run's hit rate
(the server's counters over the run), hits by tier, and TTFT (P50/P90, the client's clock).

    python -m tokenlake.benchmarks.wallclock.host_tier [--model bench-model] [--rate 1.0] ...

Prints a table, then one JSON line per case. Numbers depend on the machine: compare the two
rows of one run, not runs on different machines.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

BENCH = "host-tier"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tokenlake.benchmarks.wallclock.host_tier",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--model", choices=("tiny-random", "bench-model"), default="bench-model")
    p.add_argument("--num-instances", type=int, default=2)
    p.add_argument("--segment-len", type=int, default=32)
    p.add_argument("--num-slots", type=int, default=24, help="per instance (default: %(default)s)")
    p.add_argument("--chunk-len", type=int, default=256)
    p.add_argument("--data-plane", choices=("local", "mp"), default="local")
    p.add_argument("--host-tier-gb", type=float, default=1.0,
                   help="the tier of the second run (default: %(default)s)")  # fmt: skip
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--rate", type=float, default=1.0, help="requests per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument("--json-out", type=Path, default=None, help="also append the JSON lines here")
    return p.parse_args(argv)


def serve_argv(args, model_dir: Path, port: int, host_tier_gb: float) -> list[str]:
    return [sys.executable, "-m", "tokenlake.serve", "--model", str(model_dir),
            "--served-model-name", args.model, "--num-instances", str(args.num_instances),
            "--segment-len", str(args.segment_len), "--num-slots", str(args.num_slots),
            "--chunk-len", str(args.chunk_len), "--data-plane", args.data_plane,
            "--torch-threads", str(args.torch_threads), "--seed", str(args.seed),
            "--host-tier-gb", f"{host_tier_gb:g}", "--host", "127.0.0.1", "--port", str(port),
            "--no-profile", "--log-level", "warning"]  # fmt: skip


def tier_hits(url: str) -> dict[str, float]:
    """The server's hits by tier so far (``tokenlake:tier_hit_tokens_total``)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {"pool": 0.0, "host": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == "tokenlake:tier_hit_tokens_total":
                out[s.labels["tier"]] = s.value
    return out


def run_case(args, fleet, model_dir: Path, reqs, host_tier_gb: float) -> dict:
    from tokenlake.benchmarks.wallclock.client import drive
    from tokenlake.benchmarks.wallclock.measure import delta, hit_rate, p90, scrape
    from tokenlake.benchmarks.wallclock.processes import free_port

    port = free_port()
    proc = fleet.spawn(serve_argv(args, model_dir, port, host_tier_gb))
    (url,) = fleet.started([(proc, f"http://127.0.0.1:{port}", f"tokenlake serve ({port})")])
    try:
        before = scrape([url])
        records = drive(url, args.model, reqs, args.rate, salt=args.seed + 1, limit_s=3600.0)
        after = scrape([url])
        by_tier = tier_hits(url)
    finally:
        fleet.stop([proc])
    ttft = [r.ttft_s for r in records if r.finished]
    prompt = sum(r.prompt_len for r in records)
    return {
        "bench": BENCH, "model": args.model, "host_tier_gb": host_tier_gb,
        "num_instances": args.num_instances, "num_slots": args.num_slots,
        "segment_len": args.segment_len, "pool_tokens": args.num_instances * args.num_slots
        * args.segment_len, "working_set_tokens": working_set(reqs), "rate": args.rate,
        "num_requests": len(records), "num_finished": len(ttft),
        "hit_rate": round(hit_rate([delta(before[0], after[0])]), 4),
        "host_tier_hit_share": round(by_tier["host"] / prompt, 4) if prompt else 0.0,
        "p50_ttft_ms": round(float(np.median(ttft)) * 1e3, 1) if ttft else None,
        "p90_ttft_ms": round(p90(ttft) * 1e3, 1),
        "data_plane": args.data_plane, "seed": args.seed,
    }  # fmt: skip


def working_set(reqs) -> int:
    """Tokens of the distinct documents the run's requests read (what a cache large enough
    for every document would keep)."""
    from tokenlake.benchmarks.real.systems import RealClusterConfig

    doc_len = RealClusterConfig().doc_len
    return doc_len * len({r.prompt_ids[:doc_len] for r in reqs})


def table(lines: list[dict]) -> str:
    head = f"{'host tier':>10} {'hit rate':>9} {'from tier':>10} {'P50 TTFT':>10} {'P90 TTFT':>10}"
    rows = [
        f"{line['host_tier_gb']:>8g}GB {line['hit_rate']:>9.3f} {line['host_tier_hit_share']:>10.3f}"
        f" {line['p50_ttft_ms']:>8.1f}ms {line['p90_ttft_ms']:>8.1f}ms"
        for line in lines
    ]
    return "\n".join([head, *rows])


def main(argv=None) -> int:
    args = parse_args(argv)
    from tokenlake.benchmarks.demo.client import quiet_http_client_logs
    from tokenlake.benchmarks.wallclock.client import ALPHABET
    from tokenlake.benchmarks.wallclock.processes import Fleet
    from tokenlake.benchmarks.wallclock.serving_compare import prepare_model
    from tokenlake.benchmarks.wallclock.workloads import build_workload

    quiet_http_client_logs()
    reqs = build_workload("long-document", seed=args.seed, num_requests=args.requests,
                          vocab_size=len(ALPHABET))  # fmt: skip
    lines = []
    with tempfile.TemporaryDirectory(prefix="tokenlake-host-tier-") as tmp, Fleet() as fleet:
        model_dir = prepare_model(args.model, Path(tmp) / args.model, 0)
        for gb in (0.0, args.host_tier_gb):
            line = run_case(args, fleet, model_dir, reqs, gb)
            lines.append(line)
            print(json.dumps(line), flush=True)
            if args.json_out is not None:
                with open(args.json_out, "a", encoding="utf-8") as f:
                    f.write(json.dumps(line) + "\n")
    print(table(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
