"""Mooncake Store (the Mooncake rows' host-DRAM pool) on constructed cases: blocks keyed by
their whole prefix, its own LRU at capacity, a prefix evicted from the prefill GPU but held in
DRAM loaded at PCIe bandwidth instead of recomputed, and the load counted as a cache hit."""

import pytest

from tokenlake.benchmarks.sim.metrics import hit_rate
from tokenlake.benchmarks.sim.runner import RunConfig, simulate
from tokenlake.benchmarks.sim.step_timer import ClusterSpec
from tokenlake.benchmarks.sim.systems.mooncake_store import GiB, MooncakeStore, MooncakeStoreConfig
from tokenlake.benchmarks.workloads.request import SimRequest, Workload

B = 512


class FakeTimer:
    """prefill 0.1 s + 1 ms per new token; decode 0.05 s + 1e-6 s per context token; a P->D
    KV transfer 0.2 s."""

    def prefill_time(self, new_lens, prefix_lens):
        return 0.1 + 0.001 * sum(new_lens)

    def decode_time(self, ctx_lens):
        return 0.05 + 1e-6 * sum(ctx_lens)

    def transfer_time(self, num_bytes, same_node=False):
        return 0.2


def store_of(num_blocks: int, spec=None) -> MooncakeStore:
    spec = spec or ClusterSpec(num_instances=4)
    gb = num_blocks * B * spec.kv_bytes_per_token / GiB  # one node
    return MooncakeStore(spec, MooncakeStoreConfig(gb_per_node=gb))


def test_blocks_are_keyed_by_their_prefix():
    store = store_of(16)
    store.put([1, 2, 3], [B, B, B], instance=0)
    assert store.match([1, 2, 3, 4]) == 3 * B
    assert store.match([9, 2, 3]) == 0  # block 2 after another first block is another block
    assert store.match([1, 2]) == 2 * B


def test_lru_eviction_at_capacity():
    store = store_of(4)
    store.put([1, 2], [B, B], instance=0)
    store.put([5, 6], [B, B], instance=0)
    assert store.cached_tokens == 4 * B and store.num_evicted_tokens == 0
    store.match([1, 2], touch=True)  # [1, 2] is now the most recent
    store.put([7, 8], [B, B], instance=0)
    assert store.cached_tokens == 4 * B and store.num_evicted_tokens == 2 * B
    assert store.match([1, 2]) == 2 * B and store.match([7, 8]) == 2 * B
    assert store.match([5, 6]) == 0  # the least recently used went
    store.put([7, 8, 9], [B, B, B], instance=0)  # a continuation evicts before its prefix
    assert store.match([7, 8, 9]) == 3 * B and store.match([1, 2]) == B


def test_load_time_pcie_on_the_same_node_rdma_across():
    spec = ClusterSpec(num_instances=8)  # two nodes of four TP-2 instances
    store = store_of(64, spec)
    store.put(list(range(8)), [B] * 8, instance=0)  # written on node 0
    per_token = spec.kv_bytes_per_token
    lat = spec.hw.net_latency_s
    near = store.load_time(list(range(8)), 2 * B, 8 * B, instance=1)
    assert near == pytest.approx(lat + 6 * B * per_token / (25e9 * 2))
    far = store.load_time(list(range(8)), 0, 8 * B, instance=4)  # node 1: over RDMA
    assert far == pytest.approx(lat + 8 * B * per_token / (spec.hw.inter_node_bandwidth * 2))


@pytest.mark.parametrize("field,value", [("gb_per_node", -1.0), ("pcie_bandwidth", 0.0)])
def test_bad_store_config_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        MooncakeStoreConfig(**{field: value})


def evicted_then_reused(system: str):
    """1P3D, GPUs of 18 blocks: A (16 blocks) is pushed out of the prefill GPU by
    B (16 other blocks) but for its first two blocks; C, later, is A's prompt plus one block."""
    spec = ClusterSpec(num_instances=4, cache_tokens=18 * B)
    reqs = [
        SimRequest(0, 0.0, 16 * B, 2, tuple(range(16))),
        SimRequest(1, 20.0, 16 * B, 2, tuple(range(100, 116))),
        SimRequest(2, 100.0, 17 * B, 2, tuple(range(16)) + (200,)),
    ]
    res = simulate(Workload("t", tuple(reqs), B), spec, FakeTimer(), RunConfig(system))
    assert all(r.finished for r in res.records)
    return spec, res


def test_a_prefix_evicted_from_gpu_is_loaded_from_dram_not_recomputed():
    spec, res = evicted_then_reused("mooncake-1p3d")
    c = res.records[2]
    assert c.hit_tokens == 16 * B and res.extra["store_loads"] == 1
    # 14 blocks loaded over the prefill instance's PCIe (25 GB/s per GPU, TP 2), then one
    # block computed; the P->D transfer (0.2 s from the prefill's start) ends earlier
    load = spec.hw.net_latency_s + 14 * B * spec.kv_bytes_per_token / (2 * 25e9)
    assert c.first_token_s == pytest.approx(100.0 + load + 0.1 + 0.001 * B)
    # without the store the 14 blocks are recomputed
    _, off = evicted_then_reused("mooncake-1p3d-no-store")
    assert off.records[2].hit_tokens == 2 * B and "store_loads" not in off.extra
    assert off.records[2].first_token_s == pytest.approx(100.0 + 0.1 + 0.001 * 15 * B)
    # the hit counts in the hit rate
    assert hit_rate(res.records) > hit_rate(off.records)
