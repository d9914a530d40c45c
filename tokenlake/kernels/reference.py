"""Torch reference kernels: the test oracle for every other backend (any device).

LSE is the natural log of the softmax normaliser, per query row and head. A request with no
keys (empty prefix, or a causal row that sees nothing) has ``o = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

import math

import torch


def _gather_kv(
    pool_layer: torch.Tensor, pages: torch.Tensor, last_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate the K and V of ``pages`` ([n] slot ids) → two ``[kv_len, H_kv, D]`` tensors."""
    num_pages = pages.numel()
    page_len = pool_layer.shape[2]
    kv = pool_layer.index_select(0, pages.long())  # [n, 2, C, H_kv, D]
    k = kv[:, 0].reshape(num_pages * page_len, *kv.shape[3:])
    v = kv[:, 1].reshape(num_pages * page_len, *kv.shape[3:])
    kv_len = (num_pages - 1) * page_len + last_len
    return k[:kv_len], v[:kv_len]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of one request in fp32.

    Args:
        q: ``[n, H_q, D]``; k, v: ``[kv_len, H_kv, D]`` with ``H_q % H_kv == 0``.
        causal: bottom-right aligned mask (row ``i`` sees keys ``j <= kv_len - n + i``).
    Returns:
        ``o`` ``[n, H_q, D]`` float32 and ``lse`` ``[n, H_q]`` float32 (natural log).
    """
    n, num_q_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[0], k.shape[1]
    if kv_len == 0:
        return (
            q.new_zeros((n, num_q_heads, head_dim), dtype=torch.float32),
            torch.full((n, num_q_heads), -math.inf, dtype=torch.float32, device=q.device),
        )
    group = num_q_heads // num_kv_heads
    qf = q.float().transpose(0, 1)  # [H_q, n, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H_q, kv_len, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * sm_scale  # [H_q, n, kv_len]
    if causal:
        rows = torch.arange(n, device=q.device).unsqueeze(1)
        cols = torch.arange(kv_len, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(cols > rows + (kv_len - n), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [H_q, n]
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, torch.zeros_like(lse)).unsqueeze(-1))
    probs = torch.where(finite.unsqueeze(-1), probs, torch.zeros_like(probs))
    o = torch.matmul(probs, vf)  # [H_q, n, D]
    return o.transpose(0, 1).contiguous(), lse.transpose(0, 1).contiguous()


def partial_attention(
    q: torch.Tensor,
    q_indptr: torch.Tensor,
    pool_layer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    last_len: torch.Tensor,
    causal: bool = False,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference paged attention; see :func:`tokenlake.kernels.partial_attention` for shapes."""
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    qi = q_indptr.tolist()
    ki = kv_indptr.tolist()
    lens = last_len.tolist()
    for b in range(len(qi) - 1):
        if qi[b] == qi[b + 1] or ki[b] == ki[b + 1]:
            continue
        k, v = _gather_kv(pool_layer, kv_indices[ki[b] : ki[b + 1]], lens[b])
        o[qi[b] : qi[b + 1]], lse[qi[b] : qi[b + 1]] = attend(
            q[qi[b] : qi[b + 1]], k, v, causal, scale
        )
    return o, lse


def merge(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention states over disjoint key sets.

    Args:
        o_a, o_b: ``[n, H, D]`` float32; lse_a, lse_b: ``[n, H]`` float32 (natural log).
    Returns:
        ``(o, lse)``; where both sides are empty (``lse = -inf``) the result is ``o = 0``,
        ``lse = -inf`` (never NaN).
    """
    m = torch.maximum(lse_a, lse_b)
    empty = torch.isneginf(m)
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    w_a = torch.exp(lse_a - m_safe)
    w_b = torch.exp(lse_b - m_safe)
    total = w_a + w_b
    total_safe = torch.where(empty, torch.ones_like(total), total)
    o = (o_a * w_a.unsqueeze(-1) + o_b * w_b.unsqueeze(-1)) / total_safe.unsqueeze(-1)
    lse = torch.where(empty, m, m_safe + torch.log(total_safe))
    return o, lse


def self_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indptr: torch.Tensor,
    sm_scale: float | None = None,
    kv_indptr: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each request's new tokens over themselves (the compute engine's part).

    Args:
        q: ``[T_q, H_q, D]``; k, v: ``[T_kv, H_kv, D]``; indptr: int ``[B + 1]`` q row offsets.
        kv_indptr: int ``[B + 1]`` key offsets (default ``indptr``); a request's q rows are its
            *last* rows (bottom-right causal alignment), as for one piece of a split chunk.
    Returns:
        ``o`` ``[T_q, H_q, D]`` float32 and ``lse`` ``[T_q, H_q]`` float32.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    q_bounds = indptr.tolist()
    kv_bounds = q_bounds if kv_indptr is None else kv_indptr.tolist()
    for b in range(len(q_bounds) - 1):
        s, e = q_bounds[b], q_bounds[b + 1]
        ks, ke = kv_bounds[b], kv_bounds[b + 1]
        if s < e:
            o[s:e], lse[s:e] = attend(q[s:e], k[ks:ke], v[ks:ke], True, scale)
    return o, lse
