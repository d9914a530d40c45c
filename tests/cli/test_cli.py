"""The ``tokenlake`` command: every subcommand answers ``--help``, ``tokenlake --help`` imports
no torch and answers fast, unavailable commands say why, one ``--log-level`` for all."""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tokenlake.cli.main import BENCHES, COMMANDS, Command, CommandUnavailable, main, resolve

TOKENLAKE = Path(sys.executable).with_name("tokenlake")
TRACE = Path(__file__).parents[2] / "benchmarks" / "data" / "conversation_trace_head1000.jsonl.gz"


def run(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(TOKENLAKE), *args], capture_output=True, text=True, timeout=120, **kwargs
    )


def test_help_lists_every_command_fast_and_without_torch():
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = run("--help")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert out.returncode == 0, out.stderr
    for name, command in COMMANDS.items():
        assert f"  {name}" in out.stdout and command.summary in out.stdout
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu_s < 0.5, f"tokenlake --help took {cpu_s:.2f} s of CPU"
    probe = textwrap.dedent(
        """
        import sys
        from tokenlake.cli.main import main
        try:
            main(["--help"])
        except SystemExit:
            pass
        print(sorted(m for m in ("torch", "tokenlake.benchmarks", "tokenlake.serve") if m in sys.modules))
        """
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


@pytest.mark.parametrize("name", sorted(set(COMMANDS) - {"launch", "bench"}))
def test_every_command_has_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_benchmark_has_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", name, "--help"])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_bench_without_a_name_lists_them(capsys):
    assert main(["bench"]) == 2
    out = capsys.readouterr().out
    assert all(name in out for name in BENCHES)


def test_launch_has_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["launch", "--help"])
    assert e.value.code == 0
    assert "--instances" in capsys.readouterr().out


def test_unknown_command_and_missing_dependency_are_named(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        main(["nope"])
    assert e.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err
    (tmp_path / "needs_missing.py").write_text("import not_a_real_package_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(CommandUnavailable, match="'not_a_real_package_xyz'.*tokenlake\\[serve\\]"):
        resolve(Command("needs_missing", "", needs="serve"), "x")
    with pytest.raises(CommandUnavailable, match="not_a_module_xyz is not in this installation"):
        resolve(Command("not_a_module_xyz", ""), "x")


def test_one_log_level_for_every_command():
    args = ("trace", str(TRACE), "--max-requests", "5")
    quiet = run("--log-level", "warning", *args)
    loud = run("--log-level", "info", *args)
    assert quiet.returncode == loud.returncode == 0
    assert "INFO tokenlake.benchmarks.goodput.trace_tool" in loud.stderr
    assert "INFO" not in quiet.stderr
    assert quiet.stdout == loud.stdout  # logging never goes to stdout


def test_no_bare_print_in_library_code():
    """Library code logs; only command entry points print their output."""
    root = Path(__file__).parents[2]
    allowed = {root / "serve" / name for name in ("cli.py", "ray/cli.py", "sglang_host.py")}
    offenders = []
    for package in ("tokenlake", "engines", "scheduler", "serve"):
        for path in sorted((root / package).rglob("*.py")):
            if path in allowed:
                continue
            for no, line in enumerate(path.read_text().splitlines(), 1):
                if line.lstrip().startswith("print("):
                    offenders.append(f"{path.relative_to(root)}:{no}")
    assert not offenders, offenders


def test_product_code_never_imports_bench_or_cli():
    """docs/architecture.md#the-floors: tokenlake/, engines/, scheduler/, serve/ never import the benchmarks
    (``tokenlake.benchmarks``) nor the command (``tokenlake.cli``); only the command reaches both."""
    import ast

    root = Path(__file__).parents[2]
    offenders = []
    for package in ("tokenlake", "engines", "scheduler", "serve"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                for name in names:
                    if name.split(".")[:2] in (["tokenlake", "benchmarks"], ["tokenlake", "cli"]):
                        offenders.append(f"{path.relative_to(root)}: {name}")
                    if name.split(".")[0] in ("bench", "benchmarks", "cli"):
                        offenders.append(f"{path.relative_to(root)}: {name}")
    assert not offenders, offenders
