"""Prefix-attention kernels: one interface, backends chosen by device.

``partial_attention`` computes attention of query rows over paged KV (the pool layout
``[num_slots, 2, C, H_kv, D]``, FlashInfer "NHD" with ``page_size = C``) and returns the
partial output with its natural-log LSE; ``merge`` combines two partial states exactly.

Backends: ``"torch"`` (reference, any device, the test oracle), ``"cpu"`` (the C++ kernel in
``csrc/``), ``"flashinfer"`` (CUDA). ``backend=None`` picks ``"cpu"`` for CPU tensors and
``"flashinfer"`` for CUDA tensors.
"""

from __future__ import annotations

import itertools

import torch

from tokenlake.errors import InvalidArgumentError
from tokenlake.kernels import reference
from tokenlake.validate import check_tensor

__all__ = ["partial_attention", "merge", "self_attention", "BACKENDS"]

BACKENDS = ("torch", "cpu", "flashinfer")
_KV_DTYPES = (torch.float32, torch.bfloat16)


def _check_inputs(q, q_indptr, pool_layer, kv_indptr, kv_indices, last_len) -> None:
    check_tensor("pool_layer", pool_layer, shape=(None,) * 5, dtype=_KV_DTYPES, contiguous=True)
    _, two, _, num_kv_heads, head_dim = pool_layer.shape
    if two != 2:
        raise InvalidArgumentError(
            f"pool_layer: expected shape [num_slots, 2, C, H_kv, D], got {list(pool_layer.shape)}"
        )
    device = pool_layer.device
    check_tensor("q", q, shape=(None, None, head_dim), dtype=pool_layer.dtype, device=device)
    if q.shape[1] % num_kv_heads != 0:
        raise InvalidArgumentError(
            f"q: expected H_q to be a multiple of H_kv={num_kv_heads}, got H_q={q.shape[1]}"
        )
    check_tensor("q_indptr", q_indptr, shape=(None,), dtype=torch.int32, device=device)
    num_reqs = q_indptr.shape[0] - 1
    if num_reqs < 0:
        raise InvalidArgumentError("q_indptr: expected shape [batch_size + 1], got [0]")
    check_tensor("kv_indptr", kv_indptr, shape=(num_reqs + 1,), dtype=torch.int32, device=device)
    check_tensor("kv_indices", kv_indices, shape=(None,), dtype=torch.int32, device=device)
    check_tensor("last_len", last_len, shape=(num_reqs,), dtype=torch.int32, device=device)


def partial_attention(
    q: torch.Tensor,
    q_indptr: torch.Tensor,
    pool_layer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    last_len: torch.Tensor,
    causal: bool = False,
    sm_scale: float | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each request's query rows over its pages of one layer's pool.

    Args:
        q: ``[num_rows, H_q, D]``, same dtype as ``pool_layer`` (float32 or bfloat16).
        q_indptr: int32 ``[batch_size + 1]``; request ``b`` owns rows ``q_indptr[b]:q_indptr[b+1]``.
        pool_layer: ``[num_slots, 2, C, H_kv, D]`` contiguous; ``[:, 0]`` is K, ``[:, 1]`` is V.
        kv_indptr: int32 ``[batch_size + 1]``; request ``b`` owns ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
        kv_indices: int32 ``[nnz_pages]`` slot ids, in key order.
        last_len: int32 ``[batch_size]``, valid tokens in each request's last page, ``1..C``
            (ignored for a request with no pages).
        causal: if true, row ``i`` of a request with ``n`` rows and ``kv_len`` keys sees only keys
            ``j <= kv_len - n + i`` (bottom-right aligned); prefix attention uses ``False``.
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        backend: ``"torch"``, ``"cpu"``, ``"flashinfer"`` or ``None`` (by device).
    Returns:
        ``o`` ``[num_rows, H_q, D]`` float32 and ``lse`` ``[num_rows, H_q]`` float32, natural log;
        rows that see no keys get ``o = 0``, ``lse = -inf``.
    """
    _check_inputs(q, q_indptr, pool_layer, kv_indptr, kv_indices, last_len)
    backend = _pick_backend(backend, pool_layer.device)
    if backend == "torch":
        return reference.partial_attention(
            q, q_indptr, pool_layer, kv_indptr, kv_indices, last_len, causal, sm_scale
        )
    if backend == "cpu":
        from tokenlake.kernels import cpu

        return cpu.partial_attention(
            q, q_indptr, pool_layer, kv_indptr, kv_indices, last_len, causal, sm_scale
        )
    from tokenlake.kernels import flashinfer_backend

    return flashinfer_backend.partial_attention(
        q, q_indptr, pool_layer, kv_indptr, kv_indices, last_len, causal, sm_scale
    )


def merge(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial states over disjoint key sets into one.

    Args:
        o_a, o_b: ``[n, H, D]`` float32. lse_a, lse_b: ``[n, H]`` float32, natural log.
    Returns:
        ``(o, lse)`` with the same shapes. A side with ``lse = -inf`` contributes nothing; two
        empty sides give ``o = 0``, ``lse = -inf``.
    """
    check_tensor("o_a", o_a, shape=(None, None, None), dtype=torch.float32)
    n, h, d = o_a.shape
    check_tensor("lse_a", lse_a, shape=(n, h), dtype=torch.float32, device=o_a.device)
    check_tensor("o_b", o_b, shape=(n, h, d), dtype=torch.float32, device=o_a.device)
    check_tensor("lse_b", lse_b, shape=(n, h), dtype=torch.float32, device=o_a.device)
    backend = _pick_backend(backend, o_a.device)
    if backend == "cpu":
        from tokenlake.kernels import cpu

        return cpu.merge(o_a, lse_a, o_b, lse_b)
    return reference.merge(o_a, lse_a, o_b, lse_b)


def self_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indptr: torch.Tensor,
    sm_scale: float | None = None,
    backend: str | None = None,
    kv_indptr: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each request's new tokens over themselves.

    Args:
        q: ``[T_q, H_q, D]``; k, v: ``[T_kv, H_kv, D]`` (same dtype as ``q``).
        indptr: int32 ``[B + 1]`` q row offsets per request.
        kv_indptr: int32 ``[B + 1]`` key offsets (default ``indptr``); request ``b``'s q rows
            are its last rows (bottom-right causal alignment).
    Returns:
        ``o`` ``[T_q, H_q, D]`` float32 and ``lse`` ``[T_q, H_q]`` float32 (natural log).
    """
    check_tensor("k", k, shape=(None, None, q.shape[-1]), dtype=q.dtype, device=q.device)
    check_tensor("v", v, shape=tuple(k.shape), dtype=q.dtype, device=q.device)
    backend = _pick_backend(backend, q.device)
    if backend == "torch":
        return reference.self_attention(q, k, v, indptr, sm_scale, kv_indptr)
    # other backends take paged KV: one page per request, as long as the longest request
    kv_indptr = indptr if kv_indptr is None else kv_indptr
    bounds = kv_indptr.tolist()
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    page_len = max(max(lens), 1)
    pages = q.new_zeros((len(lens), 2, page_len, k.shape[1], k.shape[2]))
    for b, (s, n) in enumerate(zip(bounds[:-1], lens, strict=True)):
        pages[b, 0, :n] = k[s : s + n]
        pages[b, 1, :n] = v[s : s + n]
    has_kv = [b for b, n in enumerate(lens) if n]
    i32 = dict(dtype=torch.int32, device=q.device)
    page_indptr = torch.tensor([0] + list(itertools.accumulate(1 if n else 0 for n in lens)), **i32)
    return partial_attention(
        q,
        indptr.to(torch.int32),
        pages,
        page_indptr,
        torch.tensor(has_kv, **i32),
        torch.tensor([max(n, 1) for n in lens], **i32),
        causal=True,
        sm_scale=sm_scale,
        backend=backend,
    )


def _pick_backend(backend: str | None, device: torch.device) -> str:
    if backend is None:
        return "flashinfer" if device.type == "cuda" else "cpu"
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"backend: expected one of {BACKENDS} or None, got {backend!r}")
    if backend == "cpu" and device.type != "cpu":
        raise InvalidArgumentError(f"backend: 'cpu' needs CPU tensors, got {device}")
    return backend
