"""The server's flags are made from ServeConfig's fields: every field has a flag with help,
its default and its validated choices; a parsed namespace builds the config; the flags that
existed before the generator keep their names."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

import pytest

from tokenlake.serve import cli
from tokenlake.serve.cli_flags import add_config_flags, config_from_namespace
from tokenlake.serve.config import DATA_PLANES, DTYPES, SCHEDULER_MODES, ServeConfig
from tokenlake.serve.ray import cli as launch

# the flags users, docs and scripts already use (written out, not derived from the config)
EXISTING_FLAGS = [
    "--model", "--served-model-name", "--dtype", "--max-model-len", "--seed",
    "--num-instances", "--segment-len", "--num-slots", "--chunk-len", "--max-num-seqs",
    "--data-plane", "--kernel-backend", "--torch-threads", "--no-profile", "--host", "--port",
    "--log-level",
]  # fmt: skip


def actions_by_dest(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions}


def test_every_field_has_a_flag_with_help_default_and_choices():
    actions = actions_by_dest(cli.build_parser())
    for f in dataclasses.fields(ServeConfig):
        action = actions.get(f.name)
        assert action is not None, f"no flag for ServeConfig.{f.name}"
        assert "--" + f.name.replace("_", "-") in action.option_strings
        assert action.help and len(action.help) > 10, f.name
        assert action.default == f.default, f.name
    assert tuple(actions["dtype"].choices) == DTYPES
    assert tuple(actions["data_plane"].choices) == DATA_PLANES
    assert tuple(actions["scheduler_mode"].choices) == SCHEDULER_MODES


def test_existing_flag_names_are_kept():
    parser = cli.build_parser()
    known = {s for a in parser._actions for s in a.option_strings}
    assert not [f for f in EXISTING_FLAGS if f not in known]
    # the launch's parser inherits them (it redefines --host and --num-instances itself)
    known = {s for a in launch.build_parser()._actions for s in a.option_strings}
    assert not [f for f in EXISTING_FLAGS if f not in known]


def test_parsed_flags_build_the_config():
    argv = [
        "--model", "/m", "--served-model-name", "m1", "--dtype", "bfloat16",
        "--num-instances", "3", "--segment-len", "16", "--num-slots", "40",
        "--max-model-len", "100", "--chunk-len", "64", "--max-num-seqs", "5",
        "--data-plane", "mp", "--kernel-backend", "torch", "--host", "::1", "--port", "0",
        "--seed", "7", "--no-profile", "--torch-threads", "2", "--scheduler-mode",
        "colocated", "--max-body-bytes", "4096",
    ]  # fmt: skip
    config = cli.config_from_args(cli.build_parser().parse_args(argv))
    assert config == ServeConfig(
        model="/m", served_model_name="m1", dtype="bfloat16", num_instances=3,
        segment_len=16, num_slots=40, max_model_len=100, chunk_len=64, max_num_seqs=5,
        data_plane="mp", kernel_backend="torch", host="::1", port=0, seed=7, profile=False,
        torch_threads=2, scheduler_mode="colocated", max_body_bytes=4096,
    )  # fmt: skip
    assert cli.config_from_args(cli.build_parser().parse_args([])) == ServeConfig()


@pytest.mark.parametrize(
    "argv", [["--dtype", "float16"], ["--data-plane", "ray"], ["--port", "x"], ["--profile=1"]]
)
def test_bad_flag_values_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(argv)
    assert e.value.code == 2
    assert argv[0].split("=")[0] in capsys.readouterr().err


def test_a_new_field_gets_its_flag():
    @dataclass(frozen=True)
    class Toy:
        rate: float = field(default=0.5, metadata={"help": "a rate", "group": "g"})
        label: str | None = field(default=None, metadata={"help": "a label", "group": "g"})
        fast: bool = field(default=False, metadata={"help": "go fast", "group": "h"})
        mode: str = field(
            default="a", metadata={"help": "a mode", "group": "h", "choices": ("a", "b")}
        )

    parser = argparse.ArgumentParser()
    add_config_flags(parser, Toy)
    args = parser.parse_args(["--rate", "2", "--label", "x", "--fast", "--mode", "b"])
    assert config_from_namespace(Toy, args) == Toy(2.0, "x", True, "b")
    assert config_from_namespace(Toy, parser.parse_args(["--no-fast"])) == Toy()
    titles = [g.title for g in parser._action_groups]
    assert "g" in titles and "h" in titles


def test_a_field_without_help_is_a_programming_error():
    @dataclass(frozen=True)
    class NoHelp:
        size: int = 3

    @dataclass(frozen=True)
    class OddType:
        sizes: list = field(default_factory=list, metadata={"help": "sizes", "group": "g"})

    with pytest.raises(TypeError, match="size"):
        add_config_flags(argparse.ArgumentParser(), NoHelp)
    with pytest.raises(TypeError, match="annotation"):
        add_config_flags(argparse.ArgumentParser(), OddType)


@pytest.mark.parametrize(
    "values, words",
    [
        ({"dtype": "float16"}, "dtype: expected one of"),
        ({"kernel_backend": "cuda"}, "kernel_backend: expected one of"),
        ({"max_body_bytes": 0}, "max_body_bytes: expected an int in [1, "),
        ({"max_body_bytes": True}, "max_body_bytes: expected an int"),
        ({"max_body_bytes": (1 << 30) + 1}, "max_body_bytes"),
        ({"num_slots": 0}, "num_slots: expected an int >= 1, got 0"),
        ({"port": 65536}, "port: expected 0..65535"),
    ],
)
def test_config_refuses_values_outside_its_flags_choices(values, words):
    from tokenlake.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError) as e:
        ServeConfig(**values)
    assert words in str(e.value)
