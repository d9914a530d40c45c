"""Merging partial attention states: exactness, empty sides, and split-then-merge equivalence."""

from __future__ import annotations

import math

import pytest
import torch

from tokenlake.engines.kernels import merge, partial_attention, reference, self_attention
from tokenlake.errors import InvalidArgumentError

BACKENDS = ("torch", "cpu")


def random_state(n: int, h: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, d, generator=gen), 3 * torch.randn(n, h, generator=gen)


def test_cpu_matches_reference():
    o_a, lse_a = random_state(7, 4, 64, 0)
    o_b, lse_b = random_state(7, 4, 64, 1)
    o_ref, lse_ref = merge(o_a, lse_a, o_b, lse_b, backend="torch")
    o, lse = merge(o_a, lse_a, o_b, lse_b, backend="cpu")
    torch.testing.assert_close(o, o_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, lse_ref, atol=1e-6, rtol=1e-6)
    # Inputs are left alone and the outputs are new tensors.
    assert o.data_ptr() not in (o_a.data_ptr(), o_b.data_ptr())


def _split_pages(args, seed):
    """Deal each request's pages into two disjoint sets (either may be empty); the partial last
    page stays last in whichever set gets it, every other page is full."""
    q, q_indptr, pool, kv_indptr, slots, last_len = args
    gen = torch.Generator().manual_seed(seed)
    page_len = pool.shape[2]
    sides = [([0], [], []), ([0], [], [])]
    for b in range(len(last_len)):
        pages = slots[kv_indptr[b] : kv_indptr[b + 1]].tolist()
        owner = torch.randint(0, 2, (len(pages),), generator=gen).tolist()
        for s, (indptr, indices, lens) in enumerate(sides):
            mine = [p for p, o in zip(pages, owner, strict=True) if o == s]
            has_last = bool(pages) and owner[-1] == s
            indices += mine
            indptr.append(len(indices))
            lens.append(int(last_len[b]) if has_last else page_len)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return [(q, q_indptr, pool, i32(p), i32(i), i32(n)) for p, i, n in sides]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 9], ids=["decode", "prefill"])
def test_split_then_merge_equals_all_at_once(backend, dtype, rows):
    gen = torch.Generator().manual_seed(7)
    pages = [5, 1, 0, 8]
    num_slots = sum(pages) + 2
    pool = torch.randn(num_slots, 2, 16, 2, 64, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[: sum(pages)].to(torch.int32)
    q = torch.randn(rows * len(pages), 8, 64, generator=gen).to(dtype)
    q_indptr = torch.arange(0, rows * len(pages) + 1, rows, dtype=torch.int32)
    kv_indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    last_len = torch.tensor([3, 16, 1, 9], dtype=torch.int32)
    args = (q, q_indptr, pool, kv_indptr, slots, last_len)
    o_all, lse_all = partial_attention(*args, backend="torch")
    side_a, side_b = _split_pages(args, seed=11)
    o_a, lse_a = partial_attention(*side_a, backend=backend)
    o_b, lse_b = partial_attention(*side_b, backend=backend)
    o, lse = merge(o_a, lse_a, o_b, lse_b, backend=backend)
    assert not o.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_all))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o, o_all, atol=tol, rtol=0)
    finite = torch.isfinite(lse_all)
    torch.testing.assert_close(lse[finite], lse_all[finite], atol=tol, rtol=0)


@pytest.mark.parametrize("num_new", [1, 13])
def test_prefix_plus_self_attention_equals_full_causal_attention(num_new):
    """The serving identity: attention over prefix pages (non-causal, C++ kernel) merged with the
    new tokens' causal self-attention equals causal attention over the whole sequence."""
    gen = torch.Generator().manual_seed(5)
    page_len, num_q_heads, num_kv_heads, head_dim = 16, 8, 2, 64
    prefix_len = 3 * page_len + 5
    num_pages = math.ceil(prefix_len / page_len)
    k = torch.randn(prefix_len + num_new, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(prefix_len + num_new, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(num_new, num_q_heads, head_dim, generator=gen)
    scale = 1 / math.sqrt(head_dim)
    o_full, lse_full = reference.attend(q, k, v, True, scale)

    pool = torch.randn(num_pages + 4, 2, page_len, num_kv_heads, head_dim, generator=gen)
    slots = torch.randperm(num_pages + 4, generator=gen)[:num_pages].to(torch.int32)
    for i, slot in enumerate(slots.tolist()):
        n = min(page_len, prefix_len - i * page_len)
        pool[slot, 0, :n] = k[i * page_len : i * page_len + n]
        pool[slot, 1, :n] = v[i * page_len : i * page_len + n]
    o_prefix, lse_prefix = partial_attention(
        q,
        torch.tensor([0, num_new], dtype=torch.int32),
        pool,
        torch.tensor([0, num_pages], dtype=torch.int32),
        slots,
        torch.tensor([prefix_len - (num_pages - 1) * page_len], dtype=torch.int32),
        causal=False,
        backend="cpu",
    )
    indptr = torch.tensor([0, num_new], dtype=torch.int32)
    o_new, lse_new = self_attention(q, k[prefix_len:], v[prefix_len:], indptr, scale)
    o, lse = merge(o_prefix, lse_prefix, o_new, lse_new, backend="cpu")
    torch.testing.assert_close(o, o_full, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, lse_full, atol=1e-5, rtol=0)


def test_bad_inputs_name_the_argument():
    o, lse = random_state(3, 2, 16, 0)
    with pytest.raises(InvalidArgumentError, match="lse_b"):
        merge(o, lse, o, lse[:2], backend="cpu")
    with pytest.raises(InvalidArgumentError, match="o_b"):
        merge(o, lse, o.double(), lse, backend="cpu")
    with pytest.raises(InvalidArgumentError, match="o_a"):
        merge(o[0], lse, o, lse, backend="cpu")
