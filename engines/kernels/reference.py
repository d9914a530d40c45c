"""Torch reference kernels: the test oracle for every other backend (any device).

LSE is the natural log of the softmax normaliser, per query row and head. A request with no
keys (empty prefix, or a causal row that sees nothing) has ``o = 0`` and ``lse = -inf``. With
a logit soft cap the scores ``s`` are ``cap * tanh(s / cap)`` before the softmax (and so in the
LSE), which keeps partial states over disjoint keys mergeable exactly.
The kernels take checked inputs (:mod:`tokenlake.engines.kernels.inputs`); :func:`attend` checks its
own.
"""

from __future__ import annotations

import math

import torch

from tokenlake.config import check_logit_cap
from tokenlake.engines.kernels.inputs import (
    SCALE_RANGE,
    MergeInputs,
    PagedAttentionInputs,
    SelfAttentionInputs,
    check_dense,
)
from tokenlake.validate import check_bool, check_float


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
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    sm_scale: float,
    logit_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of one request in fp32.

    Args:
        q: ``[n, H_q, D]``; k, v: ``[kv_len, H_kv, D]`` with ``H_q % H_kv == 0``; float32 or
            bfloat16, one dtype and device.
        causal: bottom-right aligned mask (row ``i`` sees keys ``j <= kv_len - n + i``).
        sm_scale: finite softmax scale.
        logit_cap: soft cap of the scaled scores (0: none), see
            :func:`~tokenlake.config.check_logit_cap`.
    Returns:
        ``o`` ``[n, H_q, D]`` float32 and ``lse`` ``[n, H_q]`` float32 (natural log).
    """
    check_dense(q, k, v)
    causal = check_bool("causal", causal)
    sm_scale = check_float("sm_scale", sm_scale, low=SCALE_RANGE[0], high=SCALE_RANGE[1])
    return _attend(q, k, v, causal, sm_scale, check_logit_cap("logit_cap", logit_cap))


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    sm_scale: float,
    logit_cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
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
    if logit_cap:
        scores = logit_cap * torch.tanh(scores / logit_cap)
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


def partial_attention(args: PagedAttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference paged attention; see :func:`tokenlake.engines.kernels.partial_attention` for shapes."""
    q = args.q
    o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    qi = args.q_indptr.tolist()
    ki = args.kv_indptr.tolist()
    lens = args.last_len.tolist()
    for b in range(len(qi) - 1):
        if qi[b] == qi[b + 1] or ki[b] == ki[b + 1]:
            continue
        k, v = _gather_kv(args.pool_layer, args.kv_indices[ki[b] : ki[b + 1]], lens[b])
        o[qi[b] : qi[b + 1]], lse[qi[b] : qi[b + 1]] = _attend(
            q[qi[b] : qi[b + 1]], k, v, args.causal, args.sm_scale, args.logit_cap
        )
    return o, lse


def merge(args: MergeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention states over disjoint key sets (shapes in
    :class:`~tokenlake.engines.kernels.inputs.MergeInputs`).

    Returns:
        ``(o, lse)``; where both sides are empty (``lse = -inf``) the result is ``o = 0``,
        ``lse = -inf`` (never NaN).
    """
    return merge_pair(args.o_a, args.lse_a, args.o_b, args.lse_b)


def merge_pair(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge` on states the caller's own kernels made (shapes and LSE range already
    hold): the same few whole-tensor ops, empty sides guarded by masks, no value read on the
    host (so a GPU's stream never waits)."""
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


def self_attention(args: SelfAttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each request's new tokens over themselves (the compute engine's
    part); see :func:`tokenlake.engines.kernels.self_attention` for shapes."""
    q, k, v = args.q, args.k, args.v
    o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    q_bounds = args.indptr.tolist()
    kv_bounds = args.kv_indptr.tolist()
    for b in range(len(q_bounds) - 1):
        s, e = q_bounds[b], q_bounds[b + 1]
        ks, ke = kv_bounds[b], kv_bounds[b + 1]
        if s < e:
            o[s:e], lse[s:e] = _attend(
                q[s:e], k[ks:ke], v[ks:ke], True, args.sm_scale, args.logit_cap
            )
    return o, lse
