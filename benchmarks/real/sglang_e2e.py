"""SGLang end to end on a GPU: ``--attention-backend tokenlake`` against ``flashinfer``.

NOT RUN: written against SGLang 0.5.23's ``launch_server`` and HTTP ``/generate`` API, but
this project's machines have no GPU, so no result of it exists yet.

For each backend it launches ``python -m sglang.launch_server`` with a small model on
127.0.0.1, waits for ``/health``, sends one batch of greedy requests that share a long prefix
(a system prompt, then a distinct question each), and stops the server. It prints a table and
one JSON line per backend (wall time, output tokens per second), then whether every greedy
output is identical across backends (the backends' kernels differ, so a rare divergence late
in a long bf16 generation is possible; the report counts identical outputs and the first
differing position).

    python -m tokenlake.benchmarks.real.sglang_e2e --model Qwen/Qwen2.5-0.5B-Instruct --num-prompts 64
    python -m tokenlake.benchmarks.real.sglang_e2e --dry-run      # print the commands only
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

SYSTEM_PROMPT = (
    "You are a meticulous assistant for a logistics company. Answer briefly and precisely. "
    "Here is the company handbook, which every answer must follow:\n"
    + "\n".join(
        f"Section {i}: shipments of class {i % 7} leave from dock {i % 5}, are insured up to "
        f"{1000 * (i % 9 + 1)} dollars and must be signed for by a supervisor on shift {i % 3}."
        for i in range(60)
    )
)
QUESTIONS = [
    "Which dock does a class {k} shipment leave from?",
    "Up to how many dollars is section {k} insured?",
    "Which shift signs for section {k}?",
    "Summarise section {k} in one sentence.",
]


def prompts(n: int) -> list[str]:
    return [
        SYSTEM_PROMPT + "\n\nQuestion: " + QUESTIONS[i % len(QUESTIONS)].format(k=i % 60)
        for i in range(n)
    ]


def server_command(args, backend: str, port: int, config_path: str) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--attention-backend", backend]
    cmd += ["--mem-fraction-static", str(args.mem_fraction)]
    if backend == "tokenlake":
        cmd += ["--tokenlake-config", config_path]
    return cmd


def post(url: str, payload: dict, timeout: float):
    req = urllib.request.Request(
        url, json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before /health")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2)
    raise TimeoutError(f"server not healthy after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """Stop the server we started (its own process group), escalating after a bounded wait."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def run_backend(args, backend: str, port: int, config_path: str) -> dict:
    cmd = server_command(args, backend, port, config_path)
    print("launch:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, args.launch_timeout)
        batch = prompts(args.num_prompts)
        sampling = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens}
        post(base + "/generate", {"text": batch[:2], "sampling_params": sampling}, 600)  # warm-up
        t0 = time.perf_counter()
        out = post(base + "/generate", {"text": batch, "sampling_params": sampling}, 3600)
        wall = time.perf_counter() - t0
    finally:
        stop(proc)
    texts = [o["text"] for o in out]
    num_tokens = sum(int(o["meta_info"]["completion_tokens"]) for o in out)
    return {
        "bench": "sglang_e2e",
        "backend": backend,
        "model": args.model,
        "num_prompts": len(texts),
        "wall_s": round(wall, 3),
        "output_tokens": num_tokens,
        "output_tok_per_s": round(num_tokens / wall, 1),
        "texts": texts,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    p.add_argument("--backends", default="tokenlake,flashinfer")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=30300, help="first port; one per backend")
    p.add_argument("--mem-fraction", type=float, default=0.6)
    p.add_argument("--launch-timeout", type=float, default=900.0)
    p.add_argument("--tokenlake-config", default=None, help="pool JSON (default: 4 instances)")
    p.add_argument("--dry-run", action="store_true", help="print the server commands and exit")
    args = p.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    config_path = args.tokenlake_config
    if config_path is None:
        fd, config_path = tempfile.mkstemp(suffix=".json", prefix="tokenlake-")
        with os.fdopen(fd, "w") as f:
            json.dump({"num_instances": 4, "num_slots": 8192, "segment_len": 64}, f)
    if args.dry_run:
        for i, b in enumerate(backends):
            print(" ".join(server_command(args, b, args.port + i, config_path)))
        return 0
    results = [run_backend(args, b, args.port + i, config_path) for i, b in enumerate(backends)]
    print(f"\n{'backend':<12} {'wall s':>8} {'tokens':>8} {'tok/s':>8}")
    for r in results:
        print(
            f"{r['backend']:<12} {r['wall_s']:>8} {r['output_tokens']:>8} {r['output_tok_per_s']:>8}"
        )
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k != "texts"}))
    if len(results) >= 2:
        a, b = results[0], results[1]
        same = [x == y for x, y in zip(a["texts"], b["texts"], strict=True)]
        first_diff = [
            next((i for i, (cx, cy) in enumerate(zip(x, y, strict=False)) if cx != cy), -1)
            for x, y in zip(a["texts"], b["texts"], strict=True)
        ]
        summary = {
            "bench": "sglang_e2e_compare",
            "backends": [a["backend"], b["backend"]],
            "identical_outputs": sum(same),
            "num_prompts": len(same),
            "first_diff_chars": [d for d, s in zip(first_diff, same, strict=True) if not s],
            "throughput_ratio": round(a["output_tok_per_s"] / b["output_tok_per_s"], 3),
        }
        print(json.dumps(summary))
        return 0 if all(same) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
