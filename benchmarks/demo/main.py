"""The end-to-end demo (``make demo``): serve the seeded ``tiny-random`` Llama on 4 TokenLake
instances with ``python -m tokenlake.serve``, replay multi-turn sessions of the Mooncake
conversation trace through its OpenAI-compatible HTTP API, and check a sample of the
responses token for token against ``transformers``.

    python -m tokenlake.benchmarks.demo.main [--sessions 16] [--scale 16] [--max-output 24]

Sessions are chains of trace requests whose prompts extend an earlier request's prompt (the
next turn of a conversation); each session's turns are sent in order, a turn when the
previous answer arrived and the trace's arrival time has come (time compressed by
``--speedup``). Lengths are divided by ``--scale`` (a 512-token trace block becomes a
32-token segment) and outputs capped; the run prints what it scaled. Uses the shared trace
in ``../shared/traces`` or, on a clone without it, the bundled excerpt of its first 1,000
requests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tokenlake.benchmarks.demo.client import (
    MODEL_NAME,
    Turn,
    free_port,
    quiet_http_client_logs,
    replay,
    scrape,
    start_server,
    wait_healthy,
)
from tokenlake.benchmarks.workloads.traces import (
    TokenSynth,
    TraceRequest,
    conversation_trace,
    load_trace,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tokenlake.benchmarks.demo.main",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", default=None, help="Mooncake-format JSONL(.gz) trace")
    p.add_argument("--window", type=int, default=1000, help="first N trace requests to search")
    p.add_argument("--sessions", type=int, default=16, help="multi-turn sessions to replay")
    p.add_argument("--scale", type=int, default=16, help="divide every length by this")
    p.add_argument("--max-output", type=int, default=24, help="cap on output tokens per turn")
    p.add_argument("--speedup", type=float, default=40.0, help="trace time compression")
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--slots", type=int, default=256, help="segment slots per instance")
    p.add_argument("--verify", type=int, default=6, help="responses checked against transformers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=180.0)
    return p.parse_args(argv)


def find_sessions(trace: list[TraceRequest], num: int) -> list[list[int]]:
    """Chains of requests, each extending an earlier request's prompt (all but its last,
    partial, block), in order of first appearance; the first ``num`` with two turns or more."""
    session_of: dict[int, int] = {}
    members: dict[int, list[int]] = {}
    for i, r in enumerate(trace):
        root = i
        for j in range(i - 1, -1, -1):
            h = trace[j].hash_ids
            n = len(h) - 1
            if n > 1 and r.hash_ids[:n] == h[:n]:
                root = session_of[j]
                break
        session_of[i] = root
        members.setdefault(root, []).append(i)
    multi = [m for root, m in sorted(members.items()) if len(m) >= 2]
    return multi[:num]


def verify(model_dir: Path, turns: list[Turn]) -> tuple[int, int]:
    """How many of ``turns`` transformers' own greedy generation reproduces exactly."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    same = 0
    with torch.no_grad():
        for t in turns:
            n = len(t.output)
            ids = torch.tensor([t.prompt])
            # an explicit mask: generate() would mask every prompt token equal to pad_token_id
            ref = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, eos_token_id=None,
            )  # fmt: skip
            same += ref[0, len(t.prompt) :].tolist() == t.output
    return same, len(turns)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def main(argv=None) -> int:
    args = parse_args(argv)
    import httpx

    quiet_http_client_logs()

    from tokenlake.engines.model.tiny import write_tiny_random

    t_start = time.perf_counter()
    trace_path = args.trace or str(conversation_trace(args.window))
    trace = load_trace(trace_path, args.window)
    chains = find_sessions(trace, args.sessions)
    tmp = tempfile.TemporaryDirectory(prefix="tokenlake-demo-")
    model_dir = write_tiny_random(Path(tmp.name) / MODEL_NAME, seed=args.seed)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    synth = TokenSynth(block_size=512, scale=args.scale, vocab_size=vocab)
    t0 = min(trace[c[0]].arrival_ms for c in chains)
    sessions = [
        [
            Turn(
                i,
                (trace[i].arrival_ms - t0) / 1e3,
                synth.prompt(trace[i]).tolist(),
                min(synth.output_len(trace[i]), args.max_output),
            )  # fmt: skip
            for i in chain
        ]
        for chain in chains
    ]
    turns = [t for s in sessions for t in s]
    print(
        f"TokenLake demo: {len(sessions)} multi-turn sessions ({len(turns)} turns) of "
        f"{Path(trace_path).name}; lengths / {args.scale} (512-token blocks -> "
        f"{synth.block_len}-token segments), outputs capped at {args.max_output}, trace time / "
        f"{args.speedup:g}\n  model {MODEL_NAME} (seeded Llama, 4 layers, hidden 128, GQA 4/2) "
        f"served by `python -m tokenlake.serve` on {args.instances} instances x {args.slots} slots"
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(model_dir, args, port)
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            wait_healthy(client, proc, args.startup_timeout)
            t_ready = time.perf_counter()
            wall = replay(url, sessions, args.speedup)
            m = scrape(client)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    rng = np.random.default_rng(args.seed)
    sample = [turns[i] for i in rng.choice(len(turns), min(args.verify, len(turns)), replace=False)]
    same, checked = verify(model_dir, sample)
    tmp.cleanup()
    ttft = [t.ttft_s for t in turns]
    tbt = [x for t in turns for x in t.tbt_s]
    out_tokens = sum(len(t.output) for t in turns)
    in_tokens = sum(len(t.prompt) for t in turns)
    summary = {
        "sessions": len(sessions),
        "turns": len(turns),
        "instances": args.instances,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "hit_rate": round(m.get("pool_hit_rate", float("nan")), 4),
        "cached_prompt_tokens": sum(t.cached for t in turns),
        "load_cv": round(m.get("pool_load_cv", float("nan")), 4),
        "output_tokens_per_s": round(out_tokens / wall, 1),
        "prompt_tokens_per_s": round(in_tokens / wall, 1),
        "ttft_ms_p50": round(pct(ttft, 50), 1),
        "ttft_ms_p90": round(pct(ttft, 90), 1),
        "ttft_ms_p99": round(pct(ttft, 99), 1),
        "tbt_ms_p50": round(pct(tbt, 50), 1),
        "tbt_ms_p90": round(pct(tbt, 90), 1),
        "tbt_ms_p99": round(pct(tbt, 99), 1),
        "verified_identical": same,
        "verified": checked,
        "startup_s": round(t_ready - t_start, 1),
        "replay_s": round(wall, 1),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    s = summary
    print(
        f"hit rate {s['hit_rate']:.1%} ({s['cached_prompt_tokens']:,} of {in_tokens:,} prompt "
        f"tokens from the pool) | per-instance load CV {s['load_cv']:.1%}\n"
        f"throughput {s['output_tokens_per_s']} output tokens/s, {s['prompt_tokens_per_s']} "
        f"prompt tokens/s | TTFT p50/p90/p99 {s['ttft_ms_p50']}/{s['ttft_ms_p90']}/"
        f"{s['ttft_ms_p99']} ms | TBT p50/p90/p99 {s['tbt_ms_p50']}/{s['tbt_ms_p90']}/"
        f"{s['tbt_ms_p99']} ms\n"
        f"transformers check: {same}/{checked} sampled responses token-for-token identical "
        f"to transformers' greedy generate | start-up {s['startup_s']} s, replay "
        f"{s['replay_s']} s, total {s['wall_s']} s"
    )
    print(json.dumps(summary))
    if same != checked:
        print("FAILED: responses differ from transformers", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
