"""The one step every compute engine shares (DESIGN §3.1, step 4): the pool's prefix partial
plus causal self-attention over the new tokens → the merged attention output.

Used by the model engine (:mod:`tokenlake.engines.forward`) and the SGLang backend alike.
"""

from __future__ import annotations

import torch

from tokenlake import kernels
from tokenlake.config import check_logit_cap
from tokenlake.errors import InvalidArgumentError
from tokenlake.validate import check_tensor


def attend_with_prefix(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_indptr: torch.Tensor,
    prefix_o: torch.Tensor,
    prefix_lse: torch.Tensor,
    kv_indptr: torch.Tensor | None = None,
    sm_scale: float | None = None,
    backend: str | None = None,
    logit_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the prefix partial of a ragged batch with causal attention over its new tokens.

    Args:
        q: ``[T_q, H_q, D]`` queries of the new tokens (model dtype: float32 or bfloat16).
        k, v: ``[T_kv, H_kv, D]`` keys and values of the new tokens, same dtype as ``q``;
            ``H_q % H_kv == 0`` (GQA).
        q_indptr: int32 ``[B + 1]``; request ``b`` owns q rows ``q_indptr[b]:q_indptr[b+1]``.
        prefix_o: ``[T_q, H_q, D]`` float32, the prefix partial output (``engine.query``).
        prefix_lse: ``[T_q, H_q]`` float32, its log-sum-exp in natural log (``-inf`` for a
            row with an empty prefix).
        kv_indptr: int32 ``[B + 1]`` key offsets of each request in ``k``/``v`` (default
            ``q_indptr``); request ``b``'s q rows are its *last* keys (bottom-right causal),
            so a request may have more new keys than q rows (a chunk split across instances).
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        backend: kernel backend (``"torch"``, ``"cpu"``, ``"flashinfer"``; ``None`` by device).
        logit_cap: the attention soft cap (0: none; see :func:`tokenlake.kernels.partial_attention`),
            the same the prefix partial was computed with.
    Returns:
        ``(o, lse)``: ``o`` ``[T_q, H_q, D]`` float32, attention of every row over its whole
        sequence (prefix and new tokens up to itself); ``lse`` ``[T_q, H_q]`` float32, natural log.
    """
    check_tensor("q", q, shape=(None, None, None), dtype=(torch.float32, torch.bfloat16))
    t_q, h_q, d = q.shape
    check_tensor("prefix_o", prefix_o, shape=(t_q, h_q, d), dtype=torch.float32, device=q.device)
    check_tensor("prefix_lse", prefix_lse, shape=(t_q, h_q), dtype=torch.float32, device=q.device)
    check_tensor("q_indptr", q_indptr, shape=(None,), dtype=torch.int32, device=q.device)
    logit_cap = check_logit_cap("logit_cap", logit_cap)
    if kv_indptr is None and k.shape[0] == t_q and t_q == q_indptr.shape[0] - 1:
        return _one_token_each(q, k, v, prefix_o, prefix_lse, sm_scale, logit_cap)
    o_s, lse_s = kernels.self_attention(
        q, k, v, q_indptr, sm_scale=sm_scale, backend=backend, kv_indptr=kv_indptr,
        logit_cap=logit_cap,
    )  # fmt: skip
    return kernels.merge(prefix_o.contiguous(), prefix_lse.contiguous(), o_s, lse_s, backend)


def _one_token_each(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_o: torch.Tensor,
    prefix_lse: torch.Tensor,
    sm_scale: float | None,
    logit_cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request has one new token: its only key is itself, so its causal partial is
    ``o = v`` with ``lse`` the single (soft-capped) score ``s``, merged with the prefix
    partial in a few whole-batch tensor ops (all decode steps: otherwise per-call overhead)."""
    check_tensor("k", k, shape=(q.shape[0], None, q.shape[2]), dtype=q.dtype, device=q.device)
    check_tensor("v", v, shape=tuple(k.shape), dtype=q.dtype, device=q.device)
    t, h_q, h_kv, d = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    if h_q % h_kv:
        raise InvalidArgumentError(f"k: expected H_kv dividing H_q={h_q}, got {h_kv}")
    group = h_q // h_kv
    scale = d**-0.5 if sm_scale is None else sm_scale
    qf = q.float().view(t, h_kv, group, d)
    score = (qf * k.float().unsqueeze(2)).sum(-1).mul_(scale)  # [T, H_kv, group]
    if logit_cap:
        score = logit_cap * torch.tanh(score / logit_cap)
    lse = torch.logaddexp(prefix_lse.reshape(t, h_kv, group), score)
    # exp(-inf) = 0: a row without a prefix keeps exactly v
    o = (
        prefix_o.reshape(t, h_kv, group, d)
        * (prefix_lse.reshape(t, h_kv, group) - lse).exp_()[..., None]
    )
    o.addcmul_(v.float().unsqueeze(2), (score - lse).exp_()[..., None])
    return o.view(t, h_q, d), lse.view(t, h_q)
