"""``tokenlake launch --detach`` without ``--address`` is refused before anything starts:
the local Ray it would start ends with the command, leaving its shared memory, its secret
directory and a stop command that cannot work. No Ray cluster is needed here."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from tokenlake.errors import InvalidArgumentError
from tokenlake.serve.ray import cli as launch


class NoLaunch:
    """Stands in for what starts a Ray: any use fails the test."""

    def __init__(self, *args, **kwargs) -> None:
        raise AssertionError("a Ray launch was started")


@pytest.fixture
def no_ray_start(monkeypatch):
    ray_launch = pytest.importorskip("tokenlake.serve.ray.launch")
    monkeypatch.setattr(ray_launch, "Launch", NoLaunch)
    monkeypatch.setattr(ray_launch, "connect", NoLaunch)
    monkeypatch.setattr(ray_launch, "stop_detached", NoLaunch)


def assert_names_the_fix(text: str) -> None:
    assert "--detach" in text and "--address" in text and "ray start --head" in text, text


@pytest.mark.parametrize("extra", [(), ("--model", "tiny-random", "--instances", "2")])
def test_detach_without_address_is_a_usage_error(no_ray_start, capsys, extra):
    with pytest.raises(SystemExit) as exc:
        launch.main(["--detach", *extra])
    assert exc.value.code == 2
    err = capsys.readouterr()
    assert err.out == ""  # no "serving at", no stop command
    assert err.err.startswith("usage:")
    assert_names_the_fix(err.err)


def test_run_refuses_a_parsed_detach_without_address(no_ray_start, capsys):
    args = launch.build_parser().parse_args(["--detach"])
    assert launch.run(args) == 2
    err = capsys.readouterr()
    assert err.out == "" and err.err.startswith("error: ")
    assert_names_the_fix(err.err)


def test_launch_options_refuse_detach_without_address():
    ray_launch = pytest.importorskip("tokenlake.serve.ray.launch")
    layout = launch.layout_of(launch.build_parser().parse_args(["--instances", "2"]))
    args = launch.build_parser().parse_args(["--instances", "2", "--detach"])
    with pytest.raises(InvalidArgumentError, match="^detach: needs an address"):
        ray_launch.LaunchOptions.from_args(args, layout)
    with_address = argparse.Namespace(**{**vars(args), "address": "auto"})
    assert ray_launch.LaunchOptions.from_args(with_address, layout).detach


def test_the_refused_command_starts_no_ray():
    """The command as typed, in a process of its own: exit 2, and Ray was never imported,
    so no cluster, shared memory or secret directory can have been made."""
    probe = (
        "import sys\n"
        "from tokenlake.serve.ray import cli as launch\n"
        "try:\n"
        "    launch.main(['--detach', '--model', 'tiny-random'])\n"
        "except SystemExit as e:\n"
        "    print('exit', e.code, 'ray' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "exit 2 False", (out.stdout, out.stderr[-2000:])
    assert_names_the_fix(out.stderr)
    cmd = subprocess.run(
        [sys.executable, "-m", "tokenlake.serve.ray.cli", "--detach"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cmd.returncode == 2 and "serving" not in cmd.stdout
    assert_names_the_fix(cmd.stderr)
