"""The ``tokenlake goodput`` options of the simulator's pricing and of the Mooncake rows'
store, and the configs they make (:class:`PricingConfig`, :class:`MooncakeStoreConfig`)."""

from __future__ import annotations

import argparse
import math

from tokenlake.benchmarks.sim.systems.layered import PRICINGS, PricingConfig
from tokenlake.benchmarks.sim.systems.mooncake_store import MooncakeStoreConfig

DEFAULT_PRICING = PricingConfig()
DEFAULT_STORE = MooncakeStoreConfig()
DEFAULT_RPC_US = round(DEFAULT_PRICING.rpc_s * 1e6, 6)


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def add_sim_options(group: argparse._ArgumentGroup) -> None:
    """Add the pricing and store options to ``group``."""
    group.add_argument(
        "--dist-attn-pricing",
        choices=PRICINGS,
        default=DEFAULT_PRICING.dist_attn,
        help="TokenLake's distributed attention: layered (default: per layer q out, holders' "
        "parts at their share of a busy GPU, (o, lse) back with link latency, merge; launches "
        "and merge costed, links shared, NVLink at its per-direction figure) or overlap (the "
        "older pricing: each GPU's work and the bytes on the wire overlap, links unshared)",
    )
    group.add_argument(
        "--rpc-latency-us",
        type=_non_negative,
        default=DEFAULT_RPC_US,
        help="TokenLake's dispatch of each iteration to its instances, charged before it "
        f"starts (default {DEFAULT_RPC_US:g} us)",
    )
    group.add_argument(
        "--control-plane-scale",
        type=_non_negative,
        default=DEFAULT_PRICING.control_plane_scale,
        help="TokenLake's control plane (the scheduler's step with gen_plans, and its commit) "
        "costs its measured CPU time times this in simulated time (default 1; 0: free, "
        "which makes runs deterministic; a measured time depends on the machine's load)",
    )
    group.add_argument(
        "--mooncake-store-gb",
        type=_non_negative,
        default=DEFAULT_STORE.gb_per_node,
        help="Mooncake Store's host DRAM per 8-GPU node in GiB, pooled across nodes, for the "
        f"Mooncake rows (default {DEFAULT_STORE.gb_per_node:g}, the Mooncake paper's 1 TB per "
        "node; 0: no store, as the -no-store variant)",
    )


def pricing_of(args: argparse.Namespace) -> PricingConfig:
    """The pricing the options ask for (defaults where a namespace lacks them)."""
    return PricingConfig(
        getattr(args, "dist_attn_pricing", DEFAULT_PRICING.dist_attn),
        rpc_s=getattr(args, "rpc_latency_us", DEFAULT_RPC_US) / 1e6,
        control_plane_scale=getattr(
            args, "control_plane_scale", DEFAULT_PRICING.control_plane_scale
        ),
    )


def store_of(args: argparse.Namespace) -> MooncakeStoreConfig:
    return MooncakeStoreConfig(getattr(args, "mooncake_store_gb", DEFAULT_STORE.gb_per_node))


def describe(args: argparse.Namespace) -> str:
    """One phrase for the harness's header."""
    p, store = pricing_of(args), store_of(args)
    return (
        f"distributed attention {p.dist_attn}, RPC {p.rpc_s * 1e6:g} us, control plane x"
        f"{p.control_plane_scale:g}; Mooncake Store {store.gb_per_node:g} GiB/node"
    )
