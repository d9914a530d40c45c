"""The data plane's host tier (``engines/core/host_tier.py``): a demotion copies a slot, all
layers, into a block of host memory and a load copies it back, bytes unchanged. On CPU the
tier is a shared-memory region; on CUDA it is pinned memory and loads run on a side stream,
layer by layer, each layer's event waited for before that layer is read (the ``gpu`` test:
not run on a GPU). Attention over promoted segments: tests/test_exactness.py."""

from __future__ import annotations

import pytest
import torch

import tokenlake as tl
from tokenlake.engines.core.host_tier import HostTierStore
from tokenlake.engines.core.kv_pool import KVPool

SHAPE = tl.ModelShape(3, 4, 2, 8, "bfloat16")
SEG = 16


def round_trip(device: str) -> None:
    pool = KVPool(SHAPE, 6, SEG, device=device)
    pool.data.copy_(torch.randn(pool.data.shape).to(pool.data.dtype))
    before = pool.data.clone()
    tier = HostTierStore(SHAPE, 4, SEG, device)
    assert tier.blocks.data.device.type == "cpu"
    if device == "cuda":
        assert tier.blocks.data.is_pinned()
    tier.demote(pool, 2, 3)
    tier.demote(pool, 5, 0)
    pool.data[:, [2, 5]] = 0  # the slots are reused
    tier.load([(3, pool, 1), (0, pool, 4)])
    for layer in range(SHAPE.num_layers):
        tier.wait(layer)  # a query of this layer would run now
        assert torch.equal(pool.data[layer, 1].cpu(), before[layer, 2].cpu())
        assert torch.equal(pool.data[layer, 4].cpu(), before[layer, 5].cpu())
    assert torch.equal(pool.data[:, 0].cpu(), before[:, 0].cpu())  # nothing else touched


def test_cpu_tier_round_trip_keeps_the_bytes():
    round_trip("cpu")
    tier = HostTierStore(SHAPE, 2, SEG, "cpu")
    assert tier.blocks.data.is_shared() and tier.num_blocks == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tier_loads_on_a_side_stream_keep_the_bytes():
    round_trip("cuda")
