"""docs/architecture.md#the-floors at the boundary, for every backend: a row that sees no key (a request without
pages, or a causal row before all of its keys) gets ``o = 0`` and ``lse = -inf``, never NaN; an
empty side merges to the other side exactly; two empty sides merge to zeros with ``-inf``. The
states come from the kernels themselves, not from hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch

from tokenlake.engines.kernels import merge, partial_attention, self_attention

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BACKENDS = [
    pytest.param("torch", "cpu", id="torch"),
    pytest.param("cpu", "cpu", id="cpu"),
    pytest.param("torch", "cuda", id="torch-cuda", marks=[pytest.mark.gpu, needs_gpu]),
    pytest.param("flashinfer", "cuda", id="flashinfer", marks=[pytest.mark.gpu, needs_gpu]),
]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
PAGE_LEN, NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM = 4, 2, 4, 64


def i32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def attention(rows, pages, last_len, device, dtype, backend, causal=False, seed=0):
    """``partial_attention`` of requests with ``rows[b]`` query rows over ``pages[b]`` pages."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = sum(pages) + 1
    pool = torch.randn(num_slots, 2, PAGE_LEN, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    q = torch.randn(sum(rows), NUM_Q_HEADS, HEAD_DIM, generator=gen)
    slots = torch.randperm(num_slots, generator=gen)[: sum(pages)].tolist()
    return partial_attention(
        q.to(device, dtype),
        i32([0, *torch.tensor(rows).cumsum(0).tolist()], device),
        pool.to(device, dtype),
        i32([0, *torch.tensor(pages).cumsum(0).tolist()], device),
        i32(slots, device),
        i32(last_len, device),
        causal=causal,
        backend=backend,
    )


def assert_empty(o: torch.Tensor, lse: torch.Tensor) -> None:
    assert torch.isneginf(lse).all() and torch.all(o == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_rows_that_see_no_key(backend, device, dtype):
    # request 0: no pages; 1: 2 pages; 2: no rows; 3: 6 causal rows over 2 keys
    for causal in (False, True):
        o, lse = attention([2, 3, 0, 6], [0, 2, 1, 1], [7, 3, 4, 2], device, dtype, backend, causal)
        assert not o.isnan().any() and not lse.isnan().any()
        assert_empty(o[:2], lse[:2])
        assert torch.isfinite(lse[2:5]).all()
        if causal:  # rows 0..3 of request 3 precede both of its keys
            assert_empty(o[5:9], lse[5:9])
        assert torch.isfinite(lse[9 if causal else 5 :]).all()


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_no_requests_and_no_rows(backend, device):
    for rows, pages in (([], []), ([0, 0], [1, 0])):
        o, lse = attention(rows, pages, [1] * len(rows), device, torch.bfloat16, backend)
        assert o.shape == (0, NUM_Q_HEADS, HEAD_DIM) and lse.shape == (0, NUM_Q_HEADS)


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_an_empty_side_merges_to_the_other_exactly(backend, device):
    # the same 3 rows, once over 2 pages, once as a request without pages
    full = attention([3], [2], [3], device, torch.bfloat16, backend)
    empty = attention([3], [0], [1], device, torch.bfloat16, backend)
    assert_empty(*empty)
    for o, lse in (merge(*full, *empty, backend=backend), merge(*empty, *full, backend=backend)):
        assert torch.equal(o, full[0]) and torch.equal(lse, full[1])


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_two_empty_sides_merge_to_zeros_and_neg_inf(backend, device):
    empty_a = attention([2, 1], [0, 0], [1, 1], device, torch.float32, backend)
    empty_b = attention([2, 1], [0, 0], [4, 4], device, torch.float32, backend)
    o, lse = merge(*empty_a, *empty_b, backend=backend)
    assert not o.isnan().any() and not lse.isnan().any()
    assert_empty(o, lse)


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_merge_is_exact_per_head(backend, device):
    # states empty in some heads only: each empty head takes the other side's head exactly
    gen = torch.Generator().manual_seed(1)
    o_a, lse_a = torch.randn(5, 3, 32, generator=gen), 3 * torch.randn(5, 3, generator=gen)
    o_b, lse_b = torch.randn(5, 3, 32, generator=gen), 3 * torch.randn(5, 3, generator=gen)
    empty = torch.zeros(5, 3, dtype=torch.bool)
    empty[:, 1], empty[2] = True, True
    lse_b[empty], o_b[empty] = -math.inf, 0.0
    states = [t.to(device) for t in (o_a, lse_a, o_b, lse_b)]
    for o, lse in (
        merge(*states, backend=backend),
        merge(*states[2:], *states[:2], backend=backend),
    ):
        assert torch.equal(o[empty].cpu(), o_a[empty]) and torch.equal(
            lse[empty].cpu(), lse_a[empty]
        )


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_self_attention_rows_before_their_keys(backend, device):
    # 5 rows over 3 keys, bottom-right aligned: rows 0 and 1 see nothing
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(5, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    k, v = (
        torch.randn(3, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
        for _ in "kv"
    )
    o, lse = self_attention(
        q, k, v, i32([0, 5], device), backend=backend, kv_indptr=i32([0, 3], device)
    )
    assert not o.isnan().any() and not lse.isnan().any()
    assert_empty(o[:2], lse[:2])
    assert torch.isfinite(lse[2:]).all()
