"""query + local self-attention, merged, equals monolithic causal attention (DESIGN §3.1)."""

from __future__ import annotations

import numpy as np
import pytest
from harness import Harness, tokens

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
    c = segment_len
    doc = tokens(1, 5 * c + c // 2)
    a_ids = np.concatenate([doc, tokens(2, c + 3)])
    errs = []

    # empty prefix, chunked prefill whose first chunk ends mid-segment
    errs.append(h.step([[tl.Chunk("a", a_ids, 0, 2 * c + c // 4)]]))
    errs.append(h.step([[tl.Chunk("a", a_ids, 2 * c + c // 4)]]))
    # b shares a's document: hits a's sealed segments and copies part of the next one
    b_ids = np.concatenate([doc, tokens(3, 2 * c)])
    hit = h.cached(b_ids)
    assert hit == 5 * c + c // 2
    errs.append(h.step([[tl.Chunk("b", b_ids, hit)]]))
    # decode both in one batch, then one batch each with a fresh empty-prefix request
    for step in range(3):
        a_ids = np.append(a_ids, 7 + step)
        b_ids = np.append(b_ids, 9 + step)
        na, nb = h.pool.num_stored_tokens("a"), h.pool.num_stored_tokens("b")
        errs.append(h.step([[tl.Chunk("a", a_ids, na), tl.Chunk("b", b_ids, nb)]]))
    d_ids = tokens(4, c + 5)
    batches = [[tl.Chunk("a", np.append(a_ids, 1), len(a_ids))], [tl.Chunk("d", d_ids, 0)]]
    if num_instances >= 2:
        batches.append([tl.Chunk("b", np.append(b_ids, 1), len(b_ids))])
    errs.append(h.step(batches[:num_instances]))
    a_ids = np.append(a_ids, 1)
    # a's next turn as a new request: hits its sealed segments and its partial tail
    h.pool.finish("a")
    turn2 = np.concatenate([a_ids, tokens(5, 2 * c + 1)])
    hit2 = h.cached(turn2)
    assert hit2 == len(a_ids)
    errs.append(h.step([[tl.Chunk("a2", turn2, hit2)]]))
    copies = h.last_plans.transfer_plans[0].copy_len
    assert list(copies) == ([len(a_ids) % c] if len(a_ids) % c else [])
    assert max(errs) <= h.tolerance, errs


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("num_instances", [2, 4])
def test_dop_split_and_spread(num_instances, backend):
    """A DoP>1 batch splits rows across instances; the prefix lives on several holders."""
    h = Harness(num_instances, 16, num_slots=64, backend=backend)
    ids = tokens(11, 16 * 12 + 5)
    assert h.step([[tl.Chunk("p", ids, 0, 16 * 9)]], dops=[num_instances]) <= h.tolerance
    groups = h.last_plans.groups[0]
    assert len(set(groups)) == num_instances
    err = h.step([[tl.Chunk("p", ids, 16 * 9)]], dops=[2])
    assert err <= h.tolerance
    holders = {int(i) for qp in h.last_plans.query_plans for i in qp.holder_ids}
    assert len(holders) >= 2, "prefix should be spread over several instances"


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
