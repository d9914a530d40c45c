"""query + local self-attention, merged, equals monolithic causal attention (docs/architecture.md#one-iterations-life)."""

from __future__ import annotations

import numpy as np
import pytest
from harness import (
    Harness,
    dop_split_and_spread,
    prefill_decode_dedup_multiturn,
    tier_round_trip,
    tokens,
)

import tokenlake as tl

GRID = [
    pytest.param(n, c, dtype, backend, id=f"N{n}-C{c}-{dtype}-{backend}")
    for n in (1, 2, 4)
    for c in (16, 64)
    for dtype in ("float32", "bfloat16")
    for backend in ("torch", "cpu")
]


@pytest.mark.parametrize("num_instances,segment_len,dtype,backend", GRID)
def test_prefill_decode_dedup_multiturn(num_instances, segment_len, dtype, backend):
    h = Harness(num_instances, segment_len, num_slots=48, dtype=dtype, backend=backend)
    prefill_decode_dedup_multiturn(h, num_instances, segment_len)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("num_instances", [2, 4])
def test_dop_split_and_spread(num_instances, backend):
    dop_split_and_spread(Harness(num_instances, 16, num_slots=64, backend=backend), num_instances)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("num_instances", [2, 4])
def test_segments_promoted_from_the_host_tier_stay_exact(num_instances, backend, dtype):
    h = Harness(num_instances, 16, num_slots=6, dtype=dtype, backend=backend, num_tier_blocks=32)
    tier_round_trip(h, num_instances)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_same_iteration_dedup_stays_exact(backend):
    """Two requests writing the same segments in one iteration store them once and both
    keep reading correct KV afterwards."""
    h = Harness(4, 16, num_slots=32, backend=backend)
    shared = tokens(21, 16 * 3)
    x, y = np.append(shared, [1, 2]), np.append(shared, [3])
    assert h.step([[tl.Chunk("x", x, 0)], [tl.Chunk("y", y, 0)]]) <= h.tolerance
    stats = h.pool.get_stats()
    assert stats["num_dedup_segments"] == 3
    assert stats["num_segments"] == 3
    assert sum(stats["slots_used"]) == 3 + 2  # shared segments once, plus two open tails
    x, y = np.append(x, 5), np.append(y, 6)
    err = h.step([[tl.Chunk("x", x, len(x) - 1), tl.Chunk("y", y, len(y) - 1)]])
    assert err <= h.tolerance
