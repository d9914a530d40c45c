"""TokenLake's host tier in the simulator (the ``tokenlake-tier`` variant): the pool's own
host tier (``PoolConfig.num_tier_blocks``, docs/architecture.md, "Two tiers") with the
capacity and the transfer prices of Mooncake's DRAM store (:mod:`.mooncake_store`), so the
two systems' tiers below accelerator memory are alike:

- capacity: ``gb_per_node`` GiB of host DRAM on every node, pooled (the tier's blocks are
  striped over the nodes: block ``b`` lives on node ``b % num_nodes``);
- a load (a hit in the tier, before the layers that read it) and a demotion (a segment
  evicted from the pool, copied out before its slot is written) cost one network latency
  plus their bytes over PCIe when the block is on the instance's node, over RDMA (the
  hardware profile's inter-node bandwidth) otherwise, both paths at once, every GPU of the
  instance's TP group moving its share. They are charged before the iteration's work: the
  layer-by-layer overlap of the CUDA data plane is not counted (a pessimistic price;
  Mooncake's store loads are charged the same way, its stores not at all).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenlake.benchmarks.sim.step_timer import ClusterSpec
from tokenlake.benchmarks.sim.systems.mooncake_store import GiB, MooncakeStoreConfig
from tokenlake.plans import Plans


@dataclass(frozen=True)
class HostTierConfig:
    """Args: gb_per_node (GiB of host DRAM per node for the tier; 0: no tier); pcie_bandwidth
    (bytes/s one GPU moves to or from its node's DRAM), Mooncake Store's by default."""

    gb_per_node: float = 0.0
    pcie_bandwidth: float = MooncakeStoreConfig().pcie_bandwidth

    @classmethod
    def like(cls, store: MooncakeStoreConfig) -> HostTierConfig:
        """The tier Mooncake's store would be: the same GiB per node and PCIe bandwidth."""
        return cls(store.gb_per_node, store.pcie_bandwidth)


def num_nodes(spec: ClusterSpec) -> int:
    return spec.node_of(spec.num_instances - 1) + 1


def num_blocks(spec: ClusterSpec, segment_len: int, config: HostTierConfig) -> int:
    """The pool's ``num_tier_blocks``: segments the nodes' tier DRAM holds."""
    total = config.gb_per_node * GiB * num_nodes(spec)
    return int(total // (segment_len * spec.kv_bytes_per_token))


def move_seconds(
    plans: Plans, spec: ClusterSpec, segment_len: int, config: HostTierConfig
) -> float:
    """Seconds before an iteration's work for its host-tier runs: the slowest sub-batch's
    loads and demotions (0 when it has none)."""
    nodes = num_nodes(spec)
    seg_bytes = segment_len * spec.kv_bytes_per_token
    pcie = config.pcie_bandwidth * spec.tp
    rdma = spec.hw.inter_node_bandwidth * spec.tp
    worst = 0.0
    for tp in plans.transfer_plans:
        moves = list(zip(tp.load_src_block.tolist(), tp.load_dst_instance.tolist(), strict=True))
        moves += zip(tp.demote_dst_block.tolist(), tp.demote_src_instance.tolist(), strict=True)
        if not moves:
            continue
        near = sum(b % nodes == spec.node_of(i) for b, i in moves)
        far = len(moves) - near
        seconds = spec.hw.net_latency_s + max(near * seg_bytes / pcie, far * seg_bytes / rdma)
        worst = max(worst, seconds)
    return worst
