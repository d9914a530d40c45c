"""The C++ CPU kernel against the torch reference, and input validation."""

from __future__ import annotations

import math
import multiprocessing
import threading

import pytest
import torch

from tokenlake.engines.kernels import cpu, partial_attention
from tokenlake.errors import InvalidArgumentError

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_case(
    rows: list[int],
    pages: list[int],
    page_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Random paged inputs: request ``b`` has ``rows[b]`` query rows and ``pages[b]`` pages, on
    slots in shuffled (non-sorted) order with a random ``last_len``."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = sum(pages) + 3  # a few slots no request uses
    pool = torch.randn(num_slots, 2, page_len, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[: sum(pages)].to(torch.int32)
    q = torch.randn(sum(rows), num_q_heads, head_dim, generator=gen).to(dtype)
    q_indptr = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    kv_indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    last_len = torch.randint(1, page_len + 1, (len(rows),), generator=gen, dtype=torch.int32)
    return q, q_indptr, pool, kv_indptr, slots, last_len


def assert_matches(args, dtype, **kwargs) -> None:
    o_ref, lse_ref = partial_attention(*args, backend="torch", **kwargs)
    o, lse = partial_attention(*args, backend="cpu", **kwargs)
    assert o.dtype == lse.dtype == torch.float32
    assert o.shape == o_ref.shape and lse.shape == lse_ref.shape
    assert not o.isnan().any() and not lse.isnan().any()
    empty = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse), empty)
    assert torch.all(o[empty] == 0)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(o, o_ref, atol=tol, rtol=0)
    torch.testing.assert_close(lse[~empty], lse_ref[~empty], atol=tol, rtol=0)


MODES = {
    # (rows per request, pages per request, causal)
    "prefill": ([24, 7, 40], [3, 1, 5], False),
    "prefill_causal": ([24, 7, 40], [3, 1, 5], True),
    "decode": ([1, 1, 1, 1], [4, 1, 7, 2], False),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("page_len", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_reference(mode, heads, page_len, dtype):
    rows, pages, causal = MODES[mode]
    args = make_case(rows, pages, page_len, *heads, 64, dtype)
    assert_matches(args, dtype, causal=causal)


@pytest.mark.parametrize("head_dim", [24, 128, 256])
@pytest.mark.parametrize("rows", [1, 33], ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_dims(head_dim, rows, dtype):
    # 24 is not a multiple of the 16-float vector: the kernel pads a staged copy.
    args = make_case([rows, rows], [3, 2], 16, 8, 2, head_dim, dtype)
    assert_matches(args, dtype, causal=rows > 1)


@pytest.mark.parametrize("num_threads", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_prefix_split_across_threads(num_threads, dtype):
    # Long prefixes are split over threads and the pieces merged by LSE.
    before = cpu.get_num_threads()
    cpu.set_num_threads(num_threads)
    try:
        for args in (
            make_case([1, 1, 2], [80, 3, 50], 16, 8, 2, 128, dtype),  # decode items
            make_case([40], [60], 16, 8, 2, 64, dtype),  # prefill items
        ):
            assert_matches(args, dtype)
            assert_matches(args, dtype, causal=True)
    finally:
        cpu.set_num_threads(before)


def test_reversed_slot_order_and_sm_scale():
    args = make_case([5, 1], [4, 3], 16, 8, 4, 64, torch.float32, seed=3)
    q, q_indptr, pool, kv_indptr, slots, last_len = args
    reversed_slots = slots.flip(0).contiguous()
    args = (q, q_indptr, pool, kv_indptr, reversed_slots, last_len)
    assert_matches(args, torch.float32, sm_scale=0.3)
    assert_matches(args, torch.float32, sm_scale=0.3, causal=True)
    o_default, _ = partial_attention(*args, backend="cpu")
    o_scaled, _ = partial_attention(*args, backend="cpu", sm_scale=1 / math.sqrt(64))
    torch.testing.assert_close(o_default, o_scaled, atol=0, rtol=0)


def test_non_contiguous_query():
    q, q_indptr, pool, kv_indptr, slots, last_len = make_case([4], [3], 16, 4, 2, 64, torch.float32)
    q_strided = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not q_strided.is_contiguous()
    assert_matches((q_strided, q_indptr, pool, kv_indptr, slots, last_len), torch.float32)


def test_concurrent_calls_from_python_threads():
    # The GIL is released during the call, so several threads share the C++ pool at once.
    args = make_case([1, 1, 3], [40, 3, 20], 16, 8, 2, 128, torch.float32)
    expected = partial_attention(*args, backend="cpu")
    results: list[tuple[torch.Tensor, torch.Tensor]] = []

    def work() -> None:
        for _ in range(5):
            results.append(partial_attention(*args, backend="cpu"))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 20
    for o, lse in results:
        assert torch.equal(o, expected[0]) and torch.equal(lse, expected[1])


def _attention_in_child(queue) -> None:
    args = make_case([1, 2], [30, 2], 16, 4, 2, 64, torch.float32)
    o, _ = partial_attention(*args, backend="cpu")
    queue.put(float(o.abs().sum()))


def test_forked_child_gets_a_working_pool():
    # The parent's workers do not exist in a forked child; its first call must not hang.
    cpu.set_num_threads(2)
    args = make_case([1, 2], [30, 2], 16, 4, 2, 64, torch.float32)
    expected = float(partial_attention(*args, backend="cpu")[0].abs().sum())
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_attention_in_child, args=(queue,))
    child.start()
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
        pytest.fail("kernel call in a forked child hung")
    assert child.exitcode == 0
    assert queue.get(timeout=5) == expected


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bad_inputs_name_the_argument(backend):
    q, q_indptr, pool, kv_indptr, slots, last_len = make_case(
        [2, 1], [2, 1], 16, 4, 2, 64, torch.float32
    )

    def _bad(name: str, **overrides) -> None:
        args = dict(
            q=q, q_indptr=q_indptr, pool_layer=pool, kv_indptr=kv_indptr, kv_indices=slots,
            last_len=last_len,
        )  # fmt: skip
        with pytest.raises(InvalidArgumentError, match=f"^{name}: "):
            partial_attention(**{**args, **overrides}, backend=backend)

    _bad("q", q=q.double())
    _bad("q", q=q[..., :32])
    _bad("q", q=q[:, :3])  # H_q not a multiple of H_kv
    _bad("pool_layer", pool_layer=pool.half(), q=q.half())
    _bad("pool_layer", pool_layer=pool[:, :1])
    _bad("q_indptr", q_indptr=q_indptr.long())
    _bad("kv_indptr", kv_indptr=kv_indptr.long())
    _bad("kv_indptr", kv_indptr=kv_indptr[:-1])
    _bad("kv_indices", kv_indices=slots.long())
    _bad("last_len", last_len=last_len.long())
    # The index arrays' values, checked in one C++ pass.
    _bad("kv_indices", kv_indices=torch.tensor([0, 1, pool.shape[0]], dtype=torch.int32))
    _bad("kv_indices", kv_indices=torch.tensor([0, -1, 2], dtype=torch.int32))
    _bad("last_len", last_len=torch.tensor([0, 1], dtype=torch.int32))
    _bad("last_len", last_len=torch.tensor([17, 1], dtype=torch.int32))
    _bad("q_indptr", q_indptr=torch.tensor([0, 3, 2], dtype=torch.int32))
    _bad("q_indptr", q_indptr=torch.tensor([0, 2, 4], dtype=torch.int32))
    _bad("kv_indptr", kv_indptr=torch.tensor([0, 2, 4], dtype=torch.int32))
    # Issue 16: rows that q_indptr does not cover, indices kv_indptr does not cover.
    _bad("q_indptr", q_indptr=torch.tensor([0, 2, 2], dtype=torch.int32))
    _bad("q_indptr", q_indptr=torch.tensor([1, 2, 3], dtype=torch.int32))
    _bad("kv_indptr", kv_indices=torch.cat([slots, slots[:1]]))
    # Issue 16: a NaN or infinite sm_scale gave NaN outputs; bools pass for no number.
    for scale in (math.nan, math.inf, -math.inf, 0.0, -0.1, True, torch.tensor(0.1), "0.1"):
        _bad("sm_scale", sm_scale=scale)
    for causal in (1, None, torch.tensor(True)):
        _bad("causal", causal=causal)


def test_set_num_threads_rejects_bad_values():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="num_threads"):
            cpu.set_num_threads(bad)
    assert cpu.get_num_threads() >= 1
