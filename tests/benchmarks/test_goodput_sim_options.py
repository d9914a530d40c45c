"""The goodput harness's pricing and store options reach the simulator's configs, with the
documented defaults, and bad values are refused by name."""

import pytest

from tokenlake.benchmarks.goodput.args import parse_args
from tokenlake.benchmarks.goodput.sim_options import pricing_of, store_of
from tokenlake.benchmarks.sim.systems.layered import PricingConfig
from tokenlake.benchmarks.sim.systems.mooncake_store import MooncakeStoreConfig


def test_defaults_are_layered_pricing_and_the_store_on():
    args = parse_args([])
    assert pricing_of(args) == PricingConfig("layered", rpc_s=50e-6, control_plane_scale=1.0)
    assert store_of(args) == MooncakeStoreConfig(gb_per_node=1024.0)


def test_options_make_the_configs():
    args = parse_args(
        [
            "--dist-attn-pricing",
            "overlap",
            "--rpc-latency-us",
            "0",
            "--control-plane-scale",
            "2.5",
            "--mooncake-store-gb",
            "0",
            "--systems",
            "mooncake-1p3d-no-store,tokenlake",
        ]
    )
    assert pricing_of(args) == PricingConfig("overlap", rpc_s=0.0, control_plane_scale=2.5)
    assert store_of(args).gb_per_node == 0.0


@pytest.mark.parametrize(
    "argv,name",
    [
        ("--dist-attn-pricing serial", "--dist-attn-pricing"),
        ("--rpc-latency-us -1", "--rpc-latency-us"),
        ("--control-plane-scale nan", "--control-plane-scale"),
        ("--mooncake-store-gb x", "--mooncake-store-gb"),
        ("--systems tokenlake-no-store", "--systems"),
    ],
)
def test_bad_values_exit_naming_the_option(argv, name, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv.split())
    assert name in capsys.readouterr().err


def test_every_option_field_is_a_flag_and_nothing_sniffs_argv():
    """``tokenlake goodput``'s flags are made from its option dataclasses (one field, one
    flag), as ``tokenlake serve``'s; ``--real`` is not an option of the simulator (the real
    mini-cluster is ``tokenlake bench real-cluster``)."""
    import dataclasses

    import pytest

    from tokenlake.benchmarks.goodput.args import build_parser
    from tokenlake.benchmarks.goodput.options import OPTION_CLASSES

    parser = build_parser()
    dests = {a.dest for a in parser._actions} - {"help"}
    fields = {f.name for cls in OPTION_CLASSES for f in dataclasses.fields(cls)}
    assert dests == fields
    args = parse_args(["--requests", "7", "--no-mixed-chunk", "--prefill-tokens", "1024,2048"])
    assert (args.requests, args.mixed_chunk, args.prefill_tokens) == (7, False, [1024, 2048])
    assert parse_args(["--max-requests", "9"]).requests == 9
    for bad in (["--real"], ["--workload", "conversation", "--trace", "x.jsonl"],
                ["--prefill-tokens", "0"], ["--router-balance", "8:0.5"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(bad)
