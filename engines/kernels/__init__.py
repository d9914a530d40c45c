"""Prefix-attention kernels: one interface, backends chosen by device.

``partial_attention`` computes attention of query rows over paged KV (the pool layout
``[num_slots, 2, C, H_kv, D]``, FlashInfer "NHD" with ``page_size = C``) and returns the
partial output with its natural-log LSE; ``merge`` combines two partial states exactly.

Backends: ``"torch"`` (reference, any device, the test oracle), ``"cpu"`` (the C++ kernel in
``csrc/``), ``"flashinfer"`` (CUDA). ``backend=None`` picks ``"cpu"`` for CPU tensors and
``"flashinfer"`` for CUDA tensors. A logit soft cap (``logit_cap > 0``; 0 means none, as in
SGLang and FlashInfer) replaces every scaled score ``s`` by ``logit_cap * tanh(s / logit_cap)``
before the softmax, on every backend. Every call checks all of its arguments first
(:mod:`tokenlake.engines.kernels.inputs`) and raises :class:`~tokenlake.errors.InvalidArgumentError`
naming the bad one.
"""

from __future__ import annotations

import torch

from tokenlake.engines.kernels import cpu, reference
from tokenlake.engines.kernels.inputs import MergeInputs, PagedAttentionInputs, SelfAttentionInputs
from tokenlake.errors import InvalidArgumentError

__all__ = [
    "partial_attention",
    "merge",
    "self_attention",
    "BACKENDS",
    "PagedAttentionInputs",
    "MergeInputs",
    "SelfAttentionInputs",
]

BACKENDS = ("torch", "cpu", "flashinfer")


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
    logit_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each request's query rows over its pages of one layer's pool.

    Args:
        q: ``[num_rows, H_q, D]``, same dtype as ``pool_layer`` (float32 or bfloat16); ``H_q``
            a positive multiple of ``H_kv``.
        q_indptr: int32 ``[batch_size + 1]``; request ``b`` owns rows ``q_indptr[b]:q_indptr[b+1]``
            (from 0 to ``num_rows``, non-decreasing).
        pool_layer: ``[num_slots, 2, C, H_kv, D]`` contiguous; ``[:, 0]`` is K, ``[:, 1]`` is V.
        kv_indptr: int32 ``[batch_size + 1]``; request ``b`` owns ``kv_indices[kv_indptr[b]:
            kv_indptr[b+1]]`` (from 0 to ``nnz_pages``, non-decreasing).
        kv_indices: int32 ``[nnz_pages]`` slot ids in ``[0, num_slots)``, in key order.
        last_len: int32 ``[batch_size]``, valid tokens in each request's last page, ``1..C``
            (ignored for a request with no pages).
        causal: a bool; if true, row ``i`` of a request with ``n`` rows and ``kv_len`` keys sees
            only keys ``j <= kv_len - n + i`` (bottom-right aligned); prefix attention uses
            ``False``.
        sm_scale: softmax scale, a finite number in the normal float32 range; default
            ``1 / sqrt(D)``.
        backend: ``"torch"``, ``"cpu"``, ``"flashinfer"`` or ``None`` (by device).
        logit_cap: soft cap of the scaled scores: 0 (none) or a finite number in
            :data:`~tokenlake.config.LOGIT_CAP_RANGE`.
    Returns:
        ``o`` ``[num_rows, H_q, D]`` float32 and ``lse`` ``[num_rows, H_q]`` float32, natural log;
        rows that see no keys (an empty prefix) get ``o = 0``, ``lse = -inf``.
    """
    args = PagedAttentionInputs(
        q, q_indptr, pool_layer, kv_indptr, kv_indices, last_len, causal, sm_scale, logit_cap
    )
    return _run_paged(args, _pick_backend(backend, pool_layer.device))


def merge(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial states over disjoint key sets into one.

    Args:
        o_a, o_b: ``[n, H, D]`` float32. lse_a, lse_b: ``[n, H]`` float32, natural log, each
            finite or ``-inf`` (an empty side).
    Returns:
        ``(o, lse)`` with the same shapes, new tensors. A side with ``lse = -inf`` contributes
        nothing (the other side is returned exactly); two empty sides give ``o = 0``,
        ``lse = -inf``, never NaN.
    """
    args = MergeInputs(o_a, lse_a, o_b, lse_b)
    if _pick_backend(backend, o_a.device) == "cpu":
        return cpu.merge(args)
    return reference.merge(args)


def self_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indptr: torch.Tensor,
    sm_scale: float | None = None,
    backend: str | None = None,
    kv_indptr: torch.Tensor | None = None,
    logit_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each request's new tokens over themselves.

    Args:
        q: ``[T_q, H_q, D]``; k, v: ``[T_kv, H_kv, D]`` (same dtype as ``q``, float32 or
            bfloat16; ``H_q`` a positive multiple of ``H_kv``).
        indptr: int32 ``[B + 1]`` q row offsets per request, from 0 to ``T_q``.
        kv_indptr: int32 ``[B + 1]`` key offsets, from 0 to ``T_kv`` (default ``indptr``, then
            ``T_kv == T_q``); request ``b``'s q rows are its last rows (bottom-right causal
            alignment).
        logit_cap: soft cap of the scaled scores (0: none), as in :func:`partial_attention`.
    Returns:
        ``o`` ``[T_q, H_q, D]`` float32 and ``lse`` ``[T_q, H_q]`` float32 (natural log).
    """
    args = SelfAttentionInputs(q, k, v, indptr, kv_indptr, sm_scale, logit_cap)
    backend = _pick_backend(backend, q.device)
    if backend == "torch":
        return reference.self_attention(args)
    # other backends take paged KV: one page per request, as long as the longest request
    bounds = args.kv_indptr.tolist()
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    pages = q.new_zeros((len(lens), 2, max(lens, default=0) or 1, k.shape[1], k.shape[2]))
    for b, (s, n) in enumerate(zip(bounds[:-1], lens, strict=True)):
        pages[b, 0, :n] = k[s : s + n]
        pages[b, 1, :n] = v[s : s + n]
    has_kv = [b for b, n in enumerate(lens) if n]
    i32 = dict(dtype=torch.int32, device=q.device)
    page_indptr = [0]
    for n in lens:
        page_indptr.append(page_indptr[-1] + (1 if n else 0))
    paged = PagedAttentionInputs(
        q,
        args.indptr,
        pages,
        torch.tensor(page_indptr, **i32),
        torch.tensor(has_kv, **i32),
        torch.tensor([max(n, 1) for n in lens], **i32),
        causal=True,
        sm_scale=args.sm_scale,
        logit_cap=args.logit_cap,
    )
    return _run_paged(paged, backend)


def _run_paged(args: PagedAttentionInputs, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "torch":
        return reference.partial_attention(args)
    if backend == "cpu":
        return cpu.partial_attention(args)
    from tokenlake.engines.kernels import flashinfer_backend

    return flashinfer_backend.partial_attention(args)


def _pick_backend(backend: str | None, device: torch.device) -> str:
    if backend is None:
        return "flashinfer" if device.type == "cuda" else "cpu"
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise InvalidArgumentError(f"backend: expected one of {BACKENDS} or None, got {backend!r}")
    need = {"cpu": "cpu", "flashinfer": "cuda"}.get(backend, device.type)
    if device.type != need:
        raise InvalidArgumentError(f"backend: {backend!r} needs {need} tensors, got {device}")
    return backend
