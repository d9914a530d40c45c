"""The ``tokenlake`` command: one entry point for TokenLake's tools.

Each subcommand hands its arguments to the module that owns it (``tokenlake serve --help``
shows the server's flags). Nothing heavy is imported before a subcommand is chosen, so
``tokenlake --help`` answers at once: this module imports the standard library and
``tokenlake.logs`` only (the ``tokenlake`` package itself needs numpy, not torch).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass

from tokenlake.logs import LOG_LEVELS, setup_logging


@dataclass(frozen=True)
class Command:
    """A subcommand: ``module.function(argv) -> exit code``, run with the arguments after it."""

    module: str
    summary: str
    function: str = "main"
    needs: str = ""  # the pip extra whose packages it imports, named when one is missing
    passes_log_level: bool = False  # the command takes --log-level itself (serve, launch)


COMMANDS: dict[str, Command] = {
    "serve": Command(
        "tokenlake.serve.cli",
        "serve a model over an OpenAI-compatible HTTP API on N pooled instances",
        needs="serve",
        passes_log_level=True,
    ),
    "launch": Command(
        "tokenlake.serve.ray.cli",
        "launch the server on a Ray cluster (multi-node)",
        needs="cluster",
        passes_log_level=True,
    ),
    "sglang-host": Command(
        "tokenlake.serve.sglang_host",
        "host one pool shared by N SGLang workers (control service + engines)",
        needs="sglang",
    ),
    "demo": Command(
        "tokenlake.benchmarks.demo.main",
        "serve tiny-random and replay multi-turn trace sessions against it (make demo)",
        needs="model,serve",
    ),
    "bench": Command(
        "tokenlake.cli.main",
        "micro-benchmarks: attention, plans, dataplane, scheduler, model, ...",
        function="bench_main",
    ),
    "goodput": Command(
        "tokenlake.benchmarks.goodput.harness",
        "goodput harness: a preset or your own trace through simulated clusters",
        needs="bench",
    ),
    "trace": Command(
        "tokenlake.benchmarks.goodput.trace_tool",
        "inspect a Mooncake-format trace (counts, lengths, infinite-cache hit rate) or convert it",
    ),
}

BENCHES: dict[str, Command] = {
    "attention": Command(
        "tokenlake.benchmarks.micro.attention", "C++ kernel vs torch reference vs SDPA; memcpy"
    ),
    "plans": Command(
        "tokenlake.benchmarks.micro.plans", "gen_plans latency; trace replays: load CV, hit rate"
    ),
    "dataplane": Command(
        "tokenlake.benchmarks.micro.dataplane", "engine query latency vs in-process kernel; put"
    ),
    "page-groups": Command(
        "tokenlake.benchmarks.micro.page_groups",
        "shared-page groups vs every request reading its copy (CPU kernel)",
    ),
    "cross-node": Command(
        "tokenlake.benchmarks.micro.cross_node",
        "query/put across nodes (gloo) vs inside one; Ray launch time",
        needs="cluster",
    ),
    "scheduler": Command("tokenlake.benchmarks.micro.scheduler", "the scheduler DP's latency"),
    "model": Command(
        "tokenlake.benchmarks.micro.model",
        "model engine vs transformers: decode, batch-16, cached prefill",
        needs="model",
    ),
    "real-cluster": Command(
        "tokenlake.benchmarks.real.cluster",
        "goodput on a real CPU mini-cluster: TokenLake vs cache-aware router",
        needs="model",
    ),
    "serving-compare": Command(
        "tokenlake.benchmarks.wallclock.serving_compare",
        "serve N vs 1 instance, SGLang's bench_serving client",
        needs="sglang",
    ),
    "wallclock": Command(
        "tokenlake.benchmarks.wallclock.run",
        "wall-clock goodput: tokenlake serve (N instances) vs the real SGLang router over N",
        needs="bench,model,serve",
    ),
    "wallclock-sglang": Command(
        "tokenlake.benchmarks.wallclock.sglang.run",
        "wall-clock goodput: N SGLang servers on one pool vs N behind the cache-aware router",
        needs="sglang",
    ),
    "sim-crosscheck": Command(
        "tokenlake.benchmarks.calibrate.crosscheck",
        "simulator step times vs published A100 figures",
    ),
    "calibrate-cpu": Command(
        "tokenlake.benchmarks.calibrate.hardware",
        "measure a CPU hardware profile for the simulator",
        needs="model",
    ),
    "calibrate-control-plane": Command(
        "tokenlake.benchmarks.calibrate.control_plane",
        "measure the control plane's cost model the simulator charges by default",
    ),
    "sim-vs-real": Command(
        "tokenlake.benchmarks.calibrate.vs_real",
        "the simulator on the wall-clock runs' workloads",
        needs="model",
    ),
    "sglang-e2e": Command(
        "tokenlake.benchmarks.real.sglang_e2e",
        "SGLang end to end, tokenlake vs flashinfer (GPU only)",
    ),
}

EPILOG = """\
examples:
  tokenlake serve --model tiny-random --num-instances 4
  tokenlake demo --sessions 4
  tokenlake trace my_trace.jsonl.gz
  tokenlake goodput --trace my_trace.jsonl.gz --systems tokenlake,router --time-scale 1
  tokenlake bench attention --quick
  tokenlake launch --help

`tokenlake COMMAND --help` shows a command's options."""


def _commands_help(commands: dict[str, Command]) -> str:
    width = max(map(len, commands))
    return "\n".join(f"  {name:<{width}}  {c.summary}" for name, c in commands.items())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenlake",
        description="TokenLake: a segment-level prefix-cache pool with distributed prefix "
        "attention for LLM serving.\n\ncommands:\n" + _commands_help(COMMANDS),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="tokenlake [-h] [--version] [--log-level LEVEL] COMMAND [ARGS ...]",
    )
    p.add_argument("--version", action="store_true", help="print the version and exit")
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="log level of every command (default: %(default)s)",
    )
    p.add_argument("command", nargs="?", choices=sorted(COMMANDS), help=argparse.SUPPRESS)
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``tokenlake``'s own options and the command, then the command's arguments untouched."""
    i = 0
    while i < len(argv):
        if argv[i] == "--log-level":
            i += 2
        elif argv[i].startswith("-"):
            i += 1
        else:
            return argv[: i + 1], argv[i + 1 :]
    return argv, []


def resolve(command: Command, name: str) -> Callable[[list[str]], int | None]:
    """The command's function, or a :class:`CommandUnavailable` saying what to install."""
    try:
        available = importlib.util.find_spec(command.module) is not None
    except ModuleNotFoundError:
        available = False
    if not available:
        raise CommandUnavailable(f"tokenlake {name}: {command.module} is not in this installation")
    try:
        module = importlib.import_module(command.module)
    except ModuleNotFoundError as e:
        extra = f' (pip install "tokenlake[{command.needs}]")' if command.needs else ""
        raise CommandUnavailable(f"tokenlake {name}: needs the package {e.name!r}{extra}") from e
    return getattr(module, command.function)


class CommandUnavailable(Exception):
    """A subcommand whose module or one of its dependencies is not installed."""


def _run(command: Command, name: str, argv: list[str]) -> int:
    try:
        fn = resolve(command, name)
    except CommandUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    old_argv0 = sys.argv[0]
    sys.argv[0] = f"tokenlake {name}"  # argparse's prog in the command's own --help
    try:
        code = fn(argv)
    except KeyboardInterrupt:
        return 130
    finally:
        sys.argv[0] = old_argv0
    return int(code or 0)


def bench_main(argv: list[str]) -> int:
    """``tokenlake bench NAME [ARGS]``: one of the micro-benchmarks in ``tokenlake.benchmarks``."""
    p = argparse.ArgumentParser(
        prog="tokenlake bench",
        usage="tokenlake bench [-h] NAME [ARGS ...]",
        description="Micro-benchmarks; each prints a table and one JSON line per case "
        "(`--quick` for a short run).\n\nbenchmarks:\n" + _commands_help(BENCHES),
        epilog="`tokenlake bench NAME --help` shows a benchmark's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", nargs="?", choices=sorted(BENCHES), help=argparse.SUPPRESS)
    own, rest = split_argv(argv)
    args = p.parse_args(own)
    if args.name is None:
        p.print_help()
        return 2
    return _run(BENCHES[args.name], f"bench {args.name}", rest)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    own, rest = split_argv(argv)
    args = parser.parse_args(own)
    if args.version:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"tokenlake {version('tokenlake')}")
        except PackageNotFoundError:
            print("tokenlake (not installed as a distribution)")
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    command = COMMANDS[args.command]
    setup_logging(args.log_level)
    if command.passes_log_level and not any(a.split("=")[0] == "--log-level" for a in rest):
        rest = ["--log-level", args.log_level, *rest]
    return _run(command, args.command, rest)


if __name__ == "__main__":
    sys.exit(main())
