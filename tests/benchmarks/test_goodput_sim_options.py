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
