"""The logit soft cap (``cap * tanh(s / cap)`` of every scaled score ``s``, before the softmax;
0 = none) on every CPU backend, against monolithic attention written out plainly here in
float64 -- not the torch backend, which is itself under test."""

from __future__ import annotations

import math

import pytest
import torch
from test_partial_attention import make_case

import tokenlake as tl
from tokenlake.engines.client.prefix_attention import attend_with_prefix
from tokenlake.engines.kernels import cpu, merge, partial_attention, self_attention
from tokenlake.errors import InvalidArgumentError

BACKENDS = ["torch", "cpu"]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CAPS = [0.5, 5.0, 50.0]


def plain_attention(q, k, v, causal: bool, scale: float, cap: float):
    """One request: q ``[n, H_q, D]``, k/v ``[kv_len, H_kv, D]``; float64 softmax over
    ``cap * tanh(scale * q.k / cap)`` (``cap = 0``: plain scores), bottom-right causal."""
    q, k, v = q.double(), k.double(), v.double()
    n, num_q_heads, _ = q.shape
    kv_len, group = k.shape[0], num_q_heads // k.shape[1]
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((n, num_q_heads), -math.inf, dtype=torch.float64)
    for h in range(num_q_heads):
        scores = (q[:, h] @ k[:, h // group].T) * scale  # [n, kv_len]
        if cap > 0:
            scores = cap * torch.tanh(scores / cap)
        for i in range(n):
            seen = kv_len - n + i + 1 if causal else kv_len
            if seen <= 0:
                continue
            s = scores[i, :seen]
            lse[i, h] = torch.logsumexp(s, 0)
            o[i, h] = torch.softmax(s, 0) @ v[:seen, h // group]
    return o, lse


def plain_paged(q, q_indptr, pool, kv_indptr, kv_indices, last_len, causal, scale, cap):
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64)
    for b in range(len(q_indptr) - 1):
        rows = slice(int(q_indptr[b]), int(q_indptr[b + 1]))
        pages = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        if rows.start == rows.stop or pages.numel() == 0:
            continue
        kv_len = (pages.numel() - 1) * pool.shape[2] + int(last_len[b])
        k = pool[pages, 0].flatten(0, 1)[:kv_len]
        v = pool[pages, 1].flatten(0, 1)[:kv_len]
        o[rows], lse[rows] = plain_attention(q[rows], k, v, causal, scale, cap)
    return o, lse


def assert_close(got, want, dtype) -> None:
    (o, lse), (o_ref, lse_ref) = got, want
    assert o.dtype == lse.dtype == torch.float32
    empty = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse), empty) and bool((o[empty] == 0).all())
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(o.double(), o_ref, atol=tol, rtol=0)
    torch.testing.assert_close(lse[~empty].double(), lse_ref[~empty], atol=tol, rtol=0)


MODES = {  # rows per request, pages per request, causal
    "prefill": ([24, 7, 40, 0], [3, 1, 5, 2], False),
    "prefill_causal": ([24, 7, 40], [3, 1, 5], True),
    "decode": ([1, 1, 1, 1], [4, 0, 7, 2], False),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_partial_attention_matches_plain_capped_attention(backend, mode, cap, dtype):
    rows, pages, causal = MODES[mode]
    args = make_case(rows, pages, 16, 8, 2, 64, dtype)
    args = (args[0] * 2, *args[1:])  # scores of std 2, up to ~10: caps of 0.5 and 5 bend them
    scale = 0.125
    got = partial_attention(*args, causal=causal, backend=backend, logit_cap=cap)
    want = plain_paged(*args, causal, scale, cap)
    assert_close(got, want, dtype)
    if cap < 50:  # the cap matters: the uncapped result is far away
        plain = partial_attention(*args, causal=causal, backend=backend)
        assert float((plain[0] - got[0]).abs().max()) > 0.1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [1, 24, 128])
def test_head_dims_and_sm_scale(backend, head_dim):
    args = make_case([1, 33], [3, 2], 16, 4, 4, head_dim, torch.float32, seed=3)
    for causal in (False, True):
        got = partial_attention(*args, causal=causal, sm_scale=0.9, backend=backend, logit_cap=2)
        assert_close(got, plain_paged(*args, causal, 0.9, 2.0), torch.float32)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_long_prefix_split_across_threads_merges_exactly(num_threads):
    # 4096 keys per request: the C++ kernel splits a request's pages into items on several
    # threads and merges their (o, lse) states; with a cap the LSEs are of capped scores
    args = make_case([1, 3], [256, 256], 16, 8, 2, 64, torch.float32, seed=1)
    args = (args[0] * 4, *args[1:])
    before = cpu.get_num_threads()
    cpu.set_num_threads(num_threads)
    try:
        got = partial_attention(*args, backend="cpu", logit_cap=3.0)
    finally:
        cpu.set_num_threads(before)
    assert_close(got, plain_paged(*args, False, 0.125, 3.0), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_capped_partials_over_split_keys_merge_to_the_whole(backend):
    """What the pool does: holders attend over disjoint pages, the origin merges by LSE."""
    q, q_indptr, pool, kv_indptr, kv_indices, last_len = make_case(
        [5], [6], 16, 8, 2, 64, torch.float32, seed=2
    )
    q = q * 3
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    first = partial_attention(
        q, q_indptr, pool, i32([0, 4]), kv_indices[:4], i32([16]), backend=backend, logit_cap=4
    )
    rest = partial_attention(
        q, q_indptr, pool, i32([0, 2]), kv_indices[4:], last_len, backend=backend, logit_cap=4
    )
    merged = merge(*first, *rest, backend=backend)
    whole = plain_paged(q, q_indptr, pool, kv_indptr, kv_indices, last_len, False, 0.125, 4.0)
    assert_close(merged, whole, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("same", [True, False], ids=["kv=q", "more_keys"])
def test_self_attention(backend, same):
    gen = torch.Generator().manual_seed(4)
    q_lens, kv_lens = [3, 1, 6], [3, 1, 6] if same else [5, 4, 6]
    q = 3 * torch.randn(sum(q_lens), 6, 32, generator=gen)
    k, v = (torch.randn(sum(kv_lens), 2, 32, generator=gen) for _ in range(2))
    indptr = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    kv_indptr = None if same else torch.tensor([0, 5, 9, 15], dtype=torch.int32)
    o, lse = self_attention(
        q, k, v, indptr, sm_scale=0.3, backend=backend, kv_indptr=kv_indptr, logit_cap=1.5
    )
    bounds = (kv_indptr if kv_indptr is not None else indptr).tolist()
    for b in range(3):
        rows = slice(int(indptr[b]), int(indptr[b + 1]))
        keys = slice(bounds[b], bounds[b + 1])
        want = plain_attention(q[rows], k[keys], v[keys], True, 0.3, 1.5)
        assert_close((o[rows], lse[rows]), want, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("decode", [True, False])
def test_attend_with_prefix_equals_whole_capped_attention(backend, decode):
    """The compute engines' step: the pool's capped prefix partial + capped local causal
    attention, merged; also the all-decode shortcut (one new token each)."""
    gen = torch.Generator().manual_seed(5)
    prefix, new = [9, 0, 20], [1, 1, 1] if decode else [4, 1, 7]
    num_q_heads, num_kv_heads, d, cap, scale = 8, 2, 16, 2.5, 0.4
    rows = sum(new)
    q = 2 * torch.randn(rows, num_q_heads, d, generator=gen)
    k_all = [
        torch.randn(p + n, num_kv_heads, d, generator=gen) for p, n in zip(prefix, new, strict=True)
    ]
    v_all = [
        torch.randn(p + n, num_kv_heads, d, generator=gen) for p, n in zip(prefix, new, strict=True)
    ]
    prefix_o = torch.zeros(rows, num_q_heads, d)
    prefix_lse = torch.full((rows, num_q_heads), -math.inf)
    want_o, want_lse, lo = [], [], 0
    for b, (p, n) in enumerate(zip(prefix, new, strict=True)):
        qb = q[lo : lo + n]
        if p:
            po, pl = plain_attention(qb, k_all[b][:p], v_all[b][:p], False, scale, cap)
            prefix_o[lo : lo + n], prefix_lse[lo : lo + n] = po.float(), pl.float()
        wo, wl = plain_attention(qb, k_all[b], v_all[b], True, scale, cap)
        want_o.append(wo)
        want_lse.append(wl)
        lo += n
    k = torch.cat([kb[p:] for kb, p in zip(k_all, prefix, strict=True)])
    v = torch.cat([vb[p:] for vb, p in zip(v_all, prefix, strict=True)])
    indptr = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    got = attend_with_prefix(
        q, k, v, indptr, prefix_o, prefix_lse, sm_scale=scale, backend=backend, logit_cap=cap
    )
    assert_close(got, (torch.cat(want_o), torch.cat(want_lse)), torch.float32)


def test_zero_cap_is_the_uncapped_kernel_bit_for_bit():
    args = make_case([3, 1], [4, 2], 16, 8, 2, 64, torch.float32)
    for backend in BACKENDS:
        a = partial_attention(*args, backend=backend)
        b = partial_attention(*args, backend=backend, logit_cap=0)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


BAD_CAPS = [math.nan, math.inf, -math.inf, -1.0, -1e-9, 1e-7, 1e7, True, False, None, "30",
            torch.tensor(30.0), complex(30, 0)]  # fmt: skip


@pytest.mark.parametrize("cap", BAD_CAPS, ids=repr)
def test_bad_caps_are_rejected_naming_the_argument(cap):
    args = make_case([2], [1], 16, 4, 2, 16, torch.float32)
    q, k, v = args[0], args[0][:, :2], args[0][:, :2]
    indptr = args[1]
    calls = [
        lambda b: partial_attention(*args, backend=b, logit_cap=cap),
        lambda b: self_attention(q, k, v, indptr, backend=b, logit_cap=cap),
    ]
    for backend in BACKENDS:
        for call in calls:
            with pytest.raises(InvalidArgumentError, match=r"^logit_cap: expected 0 \(no cap\)"):
                call(backend)
    with pytest.raises(InvalidArgumentError, match=r"^ModelShape\.logit_cap: expected"):
        tl.ModelShape(2, 4, 2, 16, logit_cap=cap)


def test_model_shape_carries_the_cap():
    assert tl.ModelShape(2, 4, 2, 16).logit_cap == 0.0
    shape = tl.ModelShape(2, 4, 2, 16, logit_cap=30)
    assert shape.logit_cap == 30.0 and type(shape.logit_cap) is float
    assert tl.ModelShape(2, 4, 2, 16, logit_cap=-0.0).logit_cap == 0.0
