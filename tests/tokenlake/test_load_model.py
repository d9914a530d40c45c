"""get_cache_load (§6.1) against a hand computation."""

from __future__ import annotations

import pytest

import tokenlake as tl
from tokenlake.cluster.load_model import LoadModel
from tokenlake.cluster.profiles import A100_80G, H200, LLAMA2_7B, calibrate_cpu
from tokenlake.errors import InvalidArgumentError


def pool_with(load_model, n=8):
    return tl.Pool(tl.PoolConfig(LLAMA2_7B.shape, n, 16, 512), load_model=load_model)


def test_cache_load_matches_hand_computation():
    m, hw, n = LLAMA2_7B, A100_80G, 8
    reqs = [(12_000, 1), (30_000, 1), (0, 4096), (8192, 2048)]
    kv_tok = m.num_layers * 2 * m.num_kv_heads * m.head_dim * 2  # bf16 K and V, all layers
    mem = sum(p + i for p, i in reqs) * kv_tok
    attn = sum(4 * m.num_layers * m.num_q_heads * m.head_dim * i * p for p, i in reqs)
    linear = 2 * m.num_params * sum(i for _, i in reqs)
    all_attn = sum(4 * m.num_layers * m.num_q_heads * m.head_dim * i * (p + i) for p, i in reqs)
    t_r = max(
        (linear + all_attn) / (n * hw.peak_flops),
        (n * m.weight_bytes + mem) / (n * hw.mem_bandwidth),
    )
    want = max(mem / (mem + n * hw.mem_bandwidth * t_r), attn / (attn + n * hw.peak_flops * t_r))
    pool = pool_with(LoadModel(hw, m), n)
    got = pool.get_cache_load(reqs, pool.get_prefix_tree())
    assert got == pytest.approx(want, rel=1e-12)
    assert 0 < got < 1


def test_cache_load_grows_with_prefix_and_is_zero_for_nothing():
    for hw in (A100_80G, H200):
        pool = pool_with(LoadModel(hw, LLAMA2_7B))
        loads = [pool.get_cache_load([(prefix, 1)] * 32) for prefix in (0, 1_000, 10_000, 100_000)]
        assert loads == sorted(loads) and loads[0] < loads[-1]
        assert pool.get_cache_load([]) == 0.0


def test_cpu_profile_is_measured_and_usable():
    cpu = calibrate_cpu(num_bytes=16 * 2**20, matmul_size=256, repeats=1)
    assert cpu.peak_flops > 1e8 and cpu.mem_bandwidth > 1e8
    assert 0 <= pool_with(LoadModel(cpu, LLAMA2_7B)).get_cache_load([(4096, 16)]) < 1


def test_bad_input_names_the_argument():
    pool = pool_with(LoadModel(A100_80G, LLAMA2_7B))
    with pytest.raises(InvalidArgumentError, match=r"reqs\[1\]"):
        pool.get_cache_load([(1, 1), (-1, 3)])
    with pytest.raises(InvalidArgumentError, match="load_model"):
        pool_with(None).get_cache_load([(1, 1)])
    with pytest.raises(InvalidArgumentError, match="tree"):
        pool.get_cache_load([(1, 1)], tree=object())
