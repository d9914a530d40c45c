"""SGLang's prefix matcher consulting the pool: a real ``UnifiedRadixCache`` subclass over a
real ``TokenToKVPoolAllocator``; a prefix SGLang's tree lacks but the pool holds is loaded
back into SGLang's KV cache, and attention over it matches SGLang's ``torch_native``."""

from __future__ import annotations

from array import array

import pytest

sgl_world = pytest.importorskip("sgl_world", reason="sglang is not installed")

import torch  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components import ComponentType  # noqa: E402

from tokenlake.engines.sglang.config import SGLangPoolConfig  # noqa: E402
from tokenlake.engines.sglang.radix_cache import TokenLakeRadixCache  # noqa: E402

TOL = sgl_world.TOLERANCE


def setup(num_instances: int, segment_len: int):
    w = sgl_world.World(SGLangPoolConfig(num_instances, 512, segment_len))
    kv = w.runner.token_to_kv_pool
    w.allocator = TokenToKVPoolAllocator(kv.size, torch.float32, "cpu", kv, need_sort=False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=w.rtt,
        token_to_kv_pool_allocator=w.allocator,
        page_size=1,
        tree_components=(ComponentType.FULL,),
    )
    cache = TokenLakeRadixCache(params)
    cache.attach(w.tokenlake)
    return w, cache


def key(ids: list[int]) -> RadixKey:
    return RadixKey(array("q", ids))


@pytest.mark.parametrize("num_instances,segment_len", [(1, 8), (3, 5), (4, 16)])
def test_pool_prefix_is_loaded_back_and_attended_exactly(num_instances, segment_len) -> None:
    w, cache = setup(num_instances, segment_len)
    a = sgl_world.tokens(1, 37)
    w.add("a", a + sgl_world.tokens(2, 4))
    assert w.step({"a": 37}) <= TOL
    assert w.step({"a": 1}) <= TOL
    a_ids = w.reqs["a"].tokens[:38]
    a_slots = list(w.reqs["a"].slots)
    w.release("a")  # finished; SGLang's tree never kept it (as if SGLang evicted it)
    w.add("z", sgl_world.tokens(3, 3))
    assert w.step({"z": 3}) <= TOL  # the next forward finishes "a" in the pool
    free_before = w.allocator.available_size()

    b = a_ids + sgl_world.tokens(4, 6)
    m = cache.match_prefix(MatchPrefixParams(key=key(b)))
    assert m.device_prefix_len == 38 == cache.num_loaded_tokens  # sealed segments + the tail
    assert w.allocator.available_size() == free_before - 38
    loaded = cache.path_device_indices(m.last_device_node)[:38]
    assert set(loaded.tolist()).isdisjoint(a_slots)
    kv = w.runner.token_to_kv_pool
    for layer in range(len(w.layers)):  # a copy of exactly what "a" computed
        for buf in (kv.get_key_buffer(layer), kv.get_value_buffer(layer)):
            assert torch.equal(buf[loaded], buf[torch.tensor(a_slots)])
    again = cache.match_prefix(MatchPrefixParams(key=key(b)))  # now SGLang's own hit
    assert again.device_prefix_len == 38 and cache.num_loaded_tokens == 38
    assert w.allocator.available_size() == free_before - 38

    w.add("b", b, prefix_slots=loaded.tolist())
    assert w.step({"b": 6}) <= TOL  # torch_native reads the loaded slots
    assert w.step({"b": 1, "z": 1}) <= TOL


def test_only_what_sglang_lacks_is_loaded() -> None:
    """SGLang's tree holds the first part; only the rest is copied, and the tree's own
    slots are neither duplicated nor freed."""
    w, cache = setup(2, 4)
    ids = sgl_world.tokens(7, 30)
    w.add("p", ids + [1])
    assert w.step({"p": 30}) <= TOL
    p_slots = w.reqs["p"].slots
    # SGLang's tree keeps the first 10 tokens of "p" (its own slots)
    owned = torch.tensor(p_slots[:10], dtype=torch.int64)
    cache.insert(InsertParams(key=key(ids[:10]), value=owned))
    free_before = w.allocator.available_size()
    m = cache.match_prefix(MatchPrefixParams(key=key(ids + [5, 6])))
    assert m.device_prefix_len == 28  # the pool's 7 sealed segments of 4
    assert cache.num_loaded_tokens == 18
    assert w.allocator.available_size() == free_before - 18
    path = cache.path_device_indices(m.last_device_node)[:28]
    assert torch.equal(path[:10], owned.to(path.dtype))
    w.add("q", ids + [5, 6], prefix_slots=path.tolist())
    assert w.step({"q": 4}) <= TOL


def test_a_capped_match_loads_only_up_to_the_cap_and_leaks_no_slot() -> None:
    """SGLang caps a request's match below its length (``RadixKey.limit``: input_len - 1)
    without slicing the key's tokens. Loading past the cap took slots the tree never kept:
    SGLang's idle check then failed with ``pool memory leak detected``."""
    w, cache = setup(1, 8)
    ids = sgl_world.tokens(5, 21)
    w.add("p", ids + [1])
    assert w.step({"p": 21}) <= TOL  # the pool holds all 21 (two segments and a tail)
    w.release("p")
    w.add("z", sgl_world.tokens(6, 2))
    assert w.step({"z": 2}) <= TOL  # finishes "p" in the pool
    free_before, evictable_before = w.allocator.available_size(), cache.evictable_size()
    capped = RadixKey(array("q", ids), limit=len(ids) - 1)  # as the scheduler asks
    m = cache.match_prefix(MatchPrefixParams(key=capped))
    assert m.device_prefix_len == 20 == cache.num_loaded_tokens
    # SGLang's invariant: every slot is free, or in the tree (nothing is running)
    assert w.allocator.available_size() == free_before - 20
    assert cache.evictable_size() == evictable_before + 20


def test_a_pool_that_shrank_since_the_match_loads_nothing_and_frees_its_slots() -> None:
    """Another worker's forward may evict or replace part of a prefix between the pool's
    match and the read (seen in the real-server soak): the load is given up, its slots are
    freed, and SGLang computes what its own tree lacks (the scheduler went down before)."""
    w, cache = setup(1, 8)
    ids = sgl_world.tokens(8, 21)
    w.add("p", ids + [1])
    assert w.step({"p": 21}) <= TOL
    w.release("p")
    w.add("z", sgl_world.tokens(9, 2))
    assert w.step({"z": 2}) <= TOL
    runtime = w.tokenlake.runtime
    runtime.match_len = lambda token_ids: 24  # "held" at the match, gone by the read
    free_before, evictable_before = w.allocator.available_size(), cache.evictable_size()
    m = cache.match_prefix(MatchPrefixParams(key=key(ids + [1, 2, 3])))
    assert m.device_prefix_len == 0 and cache.num_load_races == 1
    assert w.allocator.available_size() == free_before
    assert cache.evictable_size() == evictable_before
