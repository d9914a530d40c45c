"""``tokenlake serve`` with N instances against 1 instance, driven by SGLang's own client.

    python -m tokenlake.benchmarks.wallclock.serving_compare --num-prompts 30
    tokenlake bench serving-compare --models tiny-random --instances 1 4

For each model (``tiny-random``; ``bench-model``: bench_model's seeded Llama, hidden 512,
8 layers, with tiny-random's tokenizer) and each instance count, one server
(``python -m tokenlake.serve``, 127.0.0.1, a free port) is started and driven by
``python -m sglang.bench_serving --backend vllm`` with ``--dataset-name random-ids`` and with
``--dataset-name generated-shared-prefix``, each at light load (one client, requests in
sequence: ``--max-concurrency 1``) and at saturation (every prompt at once). Prints one JSON
line per case, then a table of the ratios of the largest instance count to the smallest
(TPOT, E2E: lower is better for the pool; output throughput: higher). With several
``--data-planes`` each case also runs on each plane, one server after the other, and a second
table gives each plane against the first at the same instance count, with output tokens per
CPU-second (the server process and its descendants: workers, engines, fork servers).

The client needs ``datasets``, ``pyarrow``, ``pandas`` and ``multiprocess`` next to the
``[sglang]`` extra; SGLang's imports reach ``torchvision``, which cannot be installed next to
CPU torch, so the client runs with an import-only stand-in (:data:`CLIENT_BOOT`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenlake.benchmarks.wallclock.processes import stop_process

MODELS = ("tiny-random", "bench-model")
DATA_PLANES = ("local", "mp", "compute", "workers")
DATASETS = ("random-ids", "generated-shared-prefix")
LOADS = ("light", "saturation")
# the client's printed summary: label -> the key of our result
METRICS = {
    "Successful requests": "completed",
    "Benchmark duration (s)": "duration_s",
    "Request throughput (req/s)": "request_throughput",
    "Output token throughput (tok/s)": "output_throughput",
    "Mean E2E Latency (ms)": "mean_e2e_ms",
    "Median E2E Latency (ms)": "median_e2e_ms",
    "Mean TTFT (ms)": "mean_ttft_ms",
    "Mean TPOT (ms)": "mean_tpot_ms",
    "Median TPOT (ms)": "median_tpot_ms",
}
_LINE = re.compile(r"^(?P<label>[A-Za-z0-9 ()/%.-]+?):\s+(?P<value>-?[0-9][0-9.eE+-]*)\s*$")
# run by ``python -c``: an import-only torchvision (SGLang's multimodal configs import it; the
# client never calls it), then the client as ``__main__`` with the remaining arguments
CLIENT_BOOT = """
import importlib.abc, importlib.machinery, importlib.util, runpy, sys, types
class _Any(type):  # any attribute of a stand-in class is another one
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any(name, (), {})
class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any(name, (), {})
class _Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        m = _Module(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0+stub"
        return m
    def exec_module(self, module):
        pass
if importlib.util.find_spec("torchvision") is None:
    sys.meta_path.insert(0, _Stub())
sys.argv = ["sglang.bench_serving", *sys.argv[1:]]
runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tokenlake bench serving-compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--instances", nargs="+", type=int, default=[1, 4])
    p.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    p.add_argument("--loads", nargs="+", choices=LOADS, default=list(LOADS))
    p.add_argument("--num-prompts", type=int, default=30, help="prompts per case")
    p.add_argument("--input-len", type=int, default=256, help="random-ids prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    p.add_argument("--gsp-groups", type=int, default=4, help="shared-prefix groups")
    p.add_argument("--gsp-system-len", type=int, default=512, help="shared prefix tokens")
    p.add_argument("--gsp-question-len", type=int, default=64, help="own question tokens")
    p.add_argument(
        "--data-planes",
        nargs="+",
        choices=DATA_PLANES,
        default=["local"],
        help="`tokenlake serve --data-plane` values, compared side by side",
    )
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more `tokenlake serve` argument (repeatable)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--case-timeout-s", type=float, default=1800.0)
    p.add_argument("--quick", action="store_true", help="tiny-random, 8 prompts per case")
    args = p.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len", "gsp_groups", "gsp_system_len",
                 "gsp_question_len"):  # fmt: skip
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.instances):
        p.error(f"--instances: expected counts >= 1, got {args.instances}")
    if args.quick:
        args.models, args.num_prompts = ["tiny-random"], 8
    return args


def parse_bench_output(text: str) -> dict[str, float]:
    """The client's summary figures (``METRICS``) from its printed output; raises
    ``ValueError`` when the summary is missing (the run failed)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m and m.group("label") in METRICS:
            found[METRICS[m.group("label")]] = float(m.group("value"))
    missing = {"completed", "mean_e2e_ms", "output_throughput"} - found.keys()
    if missing:
        raise ValueError(f"bench_serving output: no {sorted(missing)} in its summary")
    return found


def client_argv(args: argparse.Namespace, dataset: str, load: str, port: int, name: str,
                tokenizer: Path) -> list[str]:  # fmt: skip
    """The ``bench_serving`` command line of one case."""
    argv = [sys.executable, "-c", CLIENT_BOOT, "--backend", "vllm",
            "--base-url", f"http://127.0.0.1:{port}", "--model", name,
            "--tokenizer", str(tokenizer), "--dataset-name", dataset, "--seed", str(args.seed),
            "--disable-tqdm", "--request-rate", "inf"]  # fmt: skip
    if dataset == "random-ids":
        argv += ["--num-prompts", str(args.num_prompts), "--random-input-len",
                 str(args.input_len), "--random-output-len", str(args.output_len),
                 "--random-range-ratio", "1.0"]  # fmt: skip
    else:
        per_group = max(1, args.num_prompts // args.gsp_groups)
        argv += ["--gsp-num-groups", str(args.gsp_groups), "--gsp-prompts-per-group",
                 str(per_group), "--gsp-system-prompt-len", str(args.gsp_system_len),
                 "--gsp-question-len", str(args.gsp_question_len), "--gsp-output-len",
                 str(args.output_len)]  # fmt: skip
    if load == "light":
        argv += ["--max-concurrency", "1"]
    return argv


def ratio_rows(results: Sequence[dict]) -> list[dict]:
    """Per (model, dataset, load): the most instances against the fewest, as ratios."""
    rows = []
    keys = sorted({(r["model"], r["dataset"], r["load"]) for r in results})
    for key in keys:
        runs = sorted((r for r in results if (r["model"], r["dataset"], r["load"]) == key),
                      key=lambda r: r["num_instances"])  # fmt: skip
        lo, hi = runs[0], runs[-1]
        if lo["num_instances"] == hi["num_instances"]:
            continue

        def ratio(metric: str, hi: dict = hi, lo: dict = lo) -> float | None:
            a, b = hi.get(metric), lo.get(metric)
            return round(a / b, 3) if a is not None and b else None

        rows.append(dict(zip(("model", "dataset", "load"), key, strict=True),
                         instances=f"{hi['num_instances']}/{lo['num_instances']}",
                         tpot=ratio("mean_tpot_ms"), e2e=ratio("mean_e2e_ms"),
                         throughput=ratio("output_throughput")))  # fmt: skip
    return rows


def plane_rows(results: Sequence[dict]) -> list[dict]:
    """Per (model, dataset, load, instances): every other data plane against the first one
    run, as ratios (TPOT, E2E, output throughput, output tokens per CPU-second)."""
    rows = []
    keys = sorted({(r["model"], r["dataset"], r["load"], r["num_instances"]) for r in results})
    for key in keys:
        runs = [r for r in results
                if (r["model"], r["dataset"], r["load"], r["num_instances"]) == key]  # fmt: skip
        base = runs[0]
        for other in runs[1:]:

            def ratio(metric: str, a: dict = other, b: dict = base) -> float | None:
                x, y = a.get(metric), b.get(metric)
                return round(x / y, 3) if x is not None and y else None

            rows.append(dict(zip(("model", "dataset", "load"), key[:3], strict=True),
                             instances=str(key[3]),
                             planes=f"{other['data_plane']}/{base['data_plane']}",
                             tpot=ratio("mean_tpot_ms"), e2e=ratio("mean_e2e_ms"),
                             throughput=ratio("output_throughput"),
                             tokens_per_cpu_s=ratio("tokens_per_cpu_s")))  # fmt: skip
    return rows


def format_table(rows: Sequence[dict]) -> str:
    planes = any("planes" in r for r in rows)
    extra = ("planes",) if planes else ()
    metrics = ("tpot", "e2e", "throughput") + (("tokens_per_cpu_s",) if planes else ())
    head = (
        f"{'model':<12} {'dataset':<24} {'load':<11} {'N':<5} "
        + "".join(f"{k:<17} " for k in extra)
        + " ".join(f"{k[:6]:>6}" for k in metrics)
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [f"{r[k]:>6.2f}" if r[k] is not None else f"{'-':>6}" for k in metrics]
        first = "".join(f"{r[k]:<17} " for k in extra)
        lines.append(f"{r['model']:<12} {r['dataset']:<24} {r['load']:<11} {r['instances']:<5} " + first + " ".join(cells))  # fmt: skip
    return "\n".join(lines)


def prepare_model(name: str, directory: Path, seed: int) -> Path:
    """A checkpoint directory with a tokenizer for ``name``."""
    from tokenlake.engines.model.tiny import write_tiny_random

    tiny = write_tiny_random(directory / "tiny", seed=seed)
    if name == "tiny-random":
        return tiny
    import torch
    import transformers

    from tokenlake.benchmarks.micro.model_steps import SHAPE

    # bench_model's shape with the tiny tokenizer's vocabulary: every sampled id then decodes
    # to text, which the client needs to time first tokens
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{**SHAPE, "vocab_size": vocab}, bos_token_id=None,
                                   eos_token_id=None)  # fmt: skip
    path = directory / "bench-model"
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(str(path))
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, path / f.name)
    return path


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds so far of process ``pid`` and its live descendants (a
    server's workers, engines and fork servers; from /proc)."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    tree, frontier = {pid}, {pid}
    while frontier:
        frontier = {p for p, (ppid, _) in stats.items() if ppid in frontier} - tree
        tree |= frontier
    return sum(stats[p][1] for p in tree if p in stats) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(args, model_dir: Path, name: str, num_instances: int,
                   data_plane: str) -> Iterator[tuple[int, int]]:  # fmt: skip
    """A ``tokenlake serve`` process until the block ends; yields its port and pid."""
    port = _free_port()
    argv = [sys.executable, "-m", "tokenlake.serve", "--model", str(model_dir),
            "--served-model-name", name, "--num-instances", str(num_instances),
            "--data-plane", data_plane, "--host", "127.0.0.1", "--port", str(port),
            "--seed", str(args.seed), *args.serve_arg]  # fmt: skip
    log = tempfile.TemporaryFile()  # noqa: SIM115 -- closed in the finally below
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + args.start_timeout_s
        health = f"http://127.0.0.1:{port}/health"
        while True:
            if proc.poll() is not None:
                log.seek(0)
                tail = log.read()[-2000:].decode(errors="replace")
                raise RuntimeError(f"server exited ({proc.returncode}):\n{tail}")
            with contextlib.suppress(OSError), urllib.request.urlopen(health, timeout=2):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not up after {args.start_timeout_s} s")
            time.sleep(0.5)
        yield port, proc.pid
    finally:
        stop_process(proc)  # it stops its own workers and engines
        log.close()


def run_case(args, port: int, name: str, tokenizer: Path, dataset: str, load: str) -> dict:
    argv = client_argv(args, dataset, load, port, name, tokenizer)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_DATASETS_OFFLINE="1")
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as cwd:  # it writes a JSONL there
        out = subprocess.run(argv, capture_output=True, text=True, timeout=args.case_timeout_s,
                             env=env, check=False, cwd=cwd)  # fmt: skip
    try:
        return parse_bench_output(out.stdout)
    except ValueError as e:
        raise RuntimeError(f"{e}; rc={out.returncode}\n{out.stderr[-3000:]}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="tokenlake-serving-compare-") as tmp:
        for model in args.models:
            model_dir = prepare_model(model, Path(tmp) / model, args.seed)
            for n in args.instances:
                for plane in args.data_planes:
                    results += run_server_cases(args, model, model_dir, n, plane)
    for plane in args.data_planes:
        rows = ratio_rows([r for r in results if r["data_plane"] == plane])
        if rows:
            print(f"--data-plane {plane}, most instances against fewest:")
            print(format_table(rows))
    if len(args.data_planes) > 1:
        print(f"each data plane against {args.data_planes[0]}, same instance count:")
        print(format_table(plane_rows(results)))
    return 0


def run_server_cases(args, model: str, model_dir: Path, n: int, plane: str) -> list[dict]:
    """Every dataset and load on one fresh server; one JSON line each, with the CPU seconds
    the server's process group spent on the case."""
    out = []
    with running_server(args, model_dir, model, n, plane) as (port, pid):
        for dataset in args.datasets:
            for load in args.loads:
                cpu0 = tree_cpu_seconds(pid)
                figures = run_case(args, port, model, model_dir, dataset, load)
                cpu_s = tree_cpu_seconds(pid) - cpu0
                tokens = figures["output_throughput"] * figures.get("duration_s", 0.0)
                row = dict(model=model, num_instances=n, data_plane=plane, dataset=dataset,
                           load=load, num_prompts=args.num_prompts, **figures,
                           cpu_s=round(cpu_s, 3),
                           tokens_per_cpu_s=round(tokens / cpu_s, 2) if cpu_s > 0 else None)  # fmt: skip
                out.append(row)
                print(json.dumps(row), flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
