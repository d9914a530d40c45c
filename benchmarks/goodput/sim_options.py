"""The configs that ``tokenlake goodput``'s pricing and store options make
(:class:`PricingConfig`, :class:`MooncakeStoreConfig`; the options themselves are fields of
:class:`~tokenlake.benchmarks.goodput.options.ClusterOptions`)."""

from __future__ import annotations

import argparse

from tokenlake.benchmarks.goodput.options import DEFAULT_PRICING, DEFAULT_RPC_US, DEFAULT_STORE
from tokenlake.benchmarks.sim.control_plane_cost import ControlPlaneCost
from tokenlake.benchmarks.sim.cpu_profile import load_cpu_profile
from tokenlake.benchmarks.sim.systems.layered import PricingConfig
from tokenlake.benchmarks.sim.systems.mooncake_store import MooncakeStoreConfig


def pricing_of(args: argparse.Namespace) -> PricingConfig:
    """The pricing the options ask for (defaults where a namespace lacks them)."""
    return PricingConfig(
        getattr(args, "dist_attn_pricing", DEFAULT_PRICING.dist_attn),
        rpc_s=getattr(args, "rpc_latency_us", DEFAULT_RPC_US) / 1e6,
        control_plane_scale=getattr(
            args, "control_plane_scale", DEFAULT_PRICING.control_plane_scale
        ),
        control_plane=getattr(args, "control_plane", DEFAULT_PRICING.control_plane),
        holder_priority=getattr(args, "holder_priority", DEFAULT_PRICING.holder_priority),
        overlap_scheduling=getattr(args, "overlap_scheduling", DEFAULT_PRICING.overlap_scheduling),
        price_hops=getattr(args, "price_hops", DEFAULT_PRICING.price_hops),
    )


def control_plane_cost_of(args: argparse.Namespace) -> ControlPlaneCost | None:
    """The cost model of ``--hardware-profile`` when it holds one (None: the default)."""
    path = getattr(args, "hardware_profile", None)
    return load_cpu_profile(path).control_plane if path is not None else None


def store_of(args: argparse.Namespace) -> MooncakeStoreConfig:
    return MooncakeStoreConfig(getattr(args, "mooncake_store_gb", DEFAULT_STORE.gb_per_node))


def describe(args: argparse.Namespace) -> str:
    """One phrase for the harness's header."""
    p, store = pricing_of(args), store_of(args)
    return (
        f"distributed attention {p.dist_attn}, RPC {p.rpc_s * 1e6:g} us, control plane x"
        f"{p.control_plane_scale:g} ({p.control_plane}){_levers(p)}; Mooncake Store {store.gb_per_node:g} GiB/node"
    )


def _levers(p: PricingConfig) -> str:
    on = [n for n, v in (("holder priority", p.holder_priority),
                         ("overlap scheduling", p.overlap_scheduling),
                         ("hops priced", p.price_hops)) if v]  # fmt: skip
    return f", {' and '.join(on)}" if on else ""
