"""Mooncake Store for the Mooncake rows: the host-DRAM KV pool of every node (seed 000:
Qin et al., "Mooncake", §3.1, §3.2.1 and §6; seed 002: Mooncake Store as SGLang HiCache's
distributed L3 tier).

- capacity: ``gb_per_node`` GiB of DRAM on every node (the paper's first deployment gave
  each node 1 TB; the RBG example provisions 10 GiB per store replica), pooled across
  nodes (a block on any node can be loaded by any prefill instance);
- blocks: KV is stored as paged blocks keyed by a hash of the block and its whole prefix
  (§3.2.1), so a lookup walks a prompt's blocks until the first one missing;
- eviction: its own LRU over blocks, separate from the GPU caches (the paper's first policy;
  its later semantics-aware policy is not modelled);
- transfer (§3.1 steps 1-2): the prefill instance loads the prefix from CPU memory into its
  GPU before the prefill, over PCIe when the block is on its own node and over RDMA (the
  node's NICs, the hardware profile's inter-node bandwidth) otherwise; it stores the new
  KV back into its node's CPU memory, streamed layer by layer beside the prefill (not on
  the request's path, not costed).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from tokenlake.benchmarks.sim.step_timer import ClusterSpec

GiB = 2**30


@dataclass(frozen=True)
class MooncakeStoreConfig:
    """Args: gb_per_node (GiB of host DRAM each node gives the store; 0: no store, the
    Mooncake rows' cache is their prefill GPUs only); pcie_bandwidth (bytes/s one GPU loads
    from its own node's DRAM: PCIe 4.0 x16 is 32 GB/s each way, about 25 achieved)."""

    gb_per_node: float = 1024.0
    pcie_bandwidth: float = 25e9

    def __post_init__(self) -> None:
        if not 0 <= self.gb_per_node < float("inf"):
            raise ValueError(
                f"MooncakeStoreConfig.gb_per_node: expected a number >= 0, got {self.gb_per_node!r}"
            )
        if not 0 < self.pcie_bandwidth < float("inf"):
            raise ValueError(
                f"MooncakeStoreConfig.pcie_bandwidth: expected > 0, got {self.pcie_bandwidth!r}"
            )


def chain_keys(keys: Sequence[Hashable]) -> list[int]:
    """Each block's store key: a hash of the block and every block before it."""
    out, h = [], 0
    for key in keys:
        h = hash((h, key))
        out.append(h)
    return out


class MooncakeStore:
    """The pooled DRAM store: ``store key -> (tokens, node)``, least recently used first."""

    def __init__(self, spec: ClusterSpec, config: MooncakeStoreConfig) -> None:
        num_nodes = spec.node_of(spec.num_instances - 1) + 1
        self.spec, self.config = spec, config
        self.capacity_tokens = int(config.gb_per_node * GiB * num_nodes // spec.kv_bytes_per_token)
        self.blocks: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self.cached_tokens = 0
        self.num_evicted_tokens = 0
        self.num_loads = 0

    def stats(self) -> dict:
        return {
            "store_loads": self.num_loads,
            "store_tokens": self.cached_tokens,
            "store_evicted_tokens": self.num_evicted_tokens,
        }

    def match(self, keys: Sequence[Hashable], touch: bool = False) -> int:
        """Tokens of the leading blocks of ``keys`` held (a touch makes them most recent,
        the first block last, so a prefix outlives its continuations)."""
        tokens, found = 0, []
        for key in chain_keys(keys):
            block = self.blocks.get(key)
            if block is None:
                break
            tokens += block[0]
            found.append(key)
        if touch:
            for key in reversed(found):
                self.blocks.move_to_end(key)
        return tokens

    def put(self, keys: Sequence[Hashable], lengths: Sequence[int], instance: int) -> None:
        """Store a prompt's blocks written by ``instance`` (on its node), then evict LRU
        blocks beyond the capacity."""
        node = self.spec.node_of(instance)
        for key, n in reversed(list(zip(chain_keys(keys), lengths, strict=True))):
            if key not in self.blocks:
                self.blocks[key] = (n, node)
                self.cached_tokens += n
            self.blocks.move_to_end(key)
        while self.cached_tokens > self.capacity_tokens and self.blocks:
            _, (n, _) = self.blocks.popitem(last=False)
            self.cached_tokens -= n
            self.num_evicted_tokens += n

    def load_time(self, keys: Sequence[Hashable], first: int, end: int, instance: int) -> float:
        """Seconds for ``instance`` to load tokens ``first:end`` of the prefix ``keys`` names
        (whole blocks overlapping that range): over PCIe from its own node, RDMA from others,
        the two paths at once, after one network latency."""
        spec, node = self.spec, self.spec.node_of(instance)
        near = far = 0
        pos = 0
        for key in chain_keys(keys):
            block = self.blocks.get(key)
            if block is None or pos >= end:
                break
            n, where = block
            if pos + n > first:
                if where == node:
                    near += n
                else:
                    far += n
            pos += n
        per_token = spec.kv_bytes_per_token
        pcie = self.config.pcie_bandwidth * spec.tp
        rdma = spec.hw.inter_node_bandwidth * spec.tp
        return spec.hw.net_latency_s + max(near * per_token / pcie, far * per_token / rdma)
