"""The simulator's ``tokenlake-tier`` variant: TokenLake's pool with a host tier sized and
priced as Mooncake's store (same GiB per node, same PCIe bandwidth and network latency, RDMA
for a block on another node), against the prices computed by hand."""

from __future__ import annotations

import dataclasses

import pytest

from tokenlake.benchmarks.sim.step_timer import ClusterSpec
from tokenlake.benchmarks.sim.systems.mooncake_store import GiB, MooncakeStoreConfig
from tokenlake.benchmarks.sim.systems.systems import split_system
from tokenlake.benchmarks.sim.systems.tokenlake_tier import (
    HostTierConfig,
    move_seconds,
    num_blocks,
)
from tokenlake.plans import Plans, TransferPlan, frozen_i32

SPEC = ClusterSpec(num_instances=8, tp=2)  # 2 nodes of 8 GPUs: instances 0-3, 4-7
SEG = 512


def plan(**runs) -> TransferPlan:
    empty = frozen_i32([])
    base = dict(epoch=1, batch_index=0, sub_batch_index=0, origin=0, request_ids=(),
                num_rows=0, dst_ids=empty, dst_indptr=frozen_i32([0]), run_src_row=empty,
                run_len=empty, run_dst_slot=empty, run_dst_offset=empty)  # fmt: skip
    return TransferPlan(**base, **{k: frozen_i32(v) for k, v in runs.items()})


def test_the_tier_variant_is_a_tokenlake_variant():
    assert split_system("tokenlake-tier") == ("tokenlake", {"tier"})
    assert split_system("tokenlake-1p3d-tier") == ("tokenlake-1p3d", {"tier"})
    store = MooncakeStoreConfig(gb_per_node=10.0, pcie_bandwidth=20e9)
    assert HostTierConfig.like(store) == HostTierConfig(10.0, 20e9)


def test_capacity_and_prices_follow_the_store():
    config = HostTierConfig.like(MooncakeStoreConfig(gb_per_node=64.0))
    seg_bytes = SEG * SPEC.kv_bytes_per_token
    assert num_blocks(SPEC, SEG, config) == int(2 * 64 * GiB // seg_bytes)
    # block 2 is on node 0, block 3 on node 1; instance 1 is on node 0
    loads = plan(load_src_block=[2, 3], load_dst_instance=[1, 1], load_dst_slot=[5, 6])
    near_s = seg_bytes / (config.pcie_bandwidth * SPEC.tp)
    far_s = seg_bytes / (SPEC.hw.inter_node_bandwidth * SPEC.tp)
    want = SPEC.hw.net_latency_s + max(near_s, far_s)
    plans = Plans(1, (), (loads,), ((0,),))
    assert move_seconds(plans, SPEC, SEG, config) == pytest.approx(want)
    demotes = plan(demote_src_instance=[1, 1, 1], demote_src_slot=[0, 1, 2],
                   demote_dst_block=[0, 2, 4])  # fmt: skip
    both = Plans(1, (), (loads, demotes), ((0, 1),))
    slowest = SPEC.hw.net_latency_s + 3 * near_s  # the sub-batch demoting three, all near
    assert move_seconds(both, SPEC, SEG, config) == pytest.approx(max(want, slowest))
    assert move_seconds(dataclasses.replace(plans, transfer_plans=(plan(),)), SPEC, SEG,
                        config) == 0.0  # fmt: skip
