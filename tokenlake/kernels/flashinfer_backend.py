"""FlashInfer backend of :func:`tokenlake.kernels.partial_attention` (CUDA).

NOT RUN ON A GPU: no GPU is available to this project; written against FlashInfer's
documented wrapper API (``BatchPrefillWithPagedKVCacheWrapper`` /
``BatchDecodeWithPagedKVCacheWrapper``: ``plan(...)`` then ``run(q, paged_kv_cache,
return_lse=True)``) and tested only where a GPU exists (``@pytest.mark.gpu``).

Edges handled here, so every backend returns the same thing:

* FlashInfer's LSE is base 2; TokenLake's is natural log: ``lse_ln = lse_2 * ln 2``.
* Requests without pages (empty prefix) never reach FlashInfer: their rows get ``o = 0``,
  ``lse = -inf``; so do causal rows that see no key.
* Outputs are float32 whatever the KV dtype.
* FlashInfer has no float32 attention; float32 pools use the torch reference instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended split-k workspace
_wrappers: dict[tuple[torch.device, str], object] = {}


@dataclass(frozen=True)
class _Batch:
    """The requests that have pages, renumbered (host tensors, int32 unless noted)."""

    rows: torch.Tensor  # int64 [num_sub_rows]: their rows of q
    q_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_len: torch.Tensor
    visible: torch.Tensor  # bool [num_sub_rows]: the row sees at least one key


def nonempty_batch(
    q_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    last_len: torch.Tensor,
    page_size: int,
    causal: bool,
) -> _Batch:
    """Drop requests with no pages or no rows (FlashInfer needs ``last_len`` in ``1..C`` and at
    least one page per request); for causal attention (bottom-right aligned) also mark the
    rows that see no key. All inputs on the host."""
    q_lens = (q_indptr[1:] - q_indptr[:-1]).long()
    pages = (kv_indptr[1:] - kv_indptr[:-1]).long()
    keep = torch.nonzero((pages > 0) & (q_lens > 0)).flatten()
    zero = torch.zeros(1, dtype=torch.int32)
    if keep.numel() == 0:
        empty = torch.zeros(0, dtype=torch.int32)
        return _Batch(empty.long(), zero, zero, empty, empty, torch.zeros(0, dtype=torch.bool))
    rows, indices, visible = [], [], []
    for b in keep.tolist():
        lo, n = int(q_indptr[b]), int(q_lens[b])
        rows.append(torch.arange(lo, lo + n))
        indices.append(kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])])
        kv_len = (int(pages[b]) - 1) * page_size + int(last_len[b])
        i = torch.arange(n)
        visible.append(kv_len - n + i >= 0 if causal else torch.ones(n, dtype=torch.bool))
    sub_q, sub_pages = q_lens[keep], pages[keep]
    return _Batch(
        rows=torch.cat(rows),
        q_indptr=torch.cat([zero, torch.cumsum(sub_q, 0).int()]),
        kv_indptr=torch.cat([zero, torch.cumsum(sub_pages, 0).int()]),
        kv_indices=torch.cat(indices).int(),
        last_len=last_len[keep].int(),
        visible=torch.cat(visible),
    )


def to_natural_lse(lse_base2: torch.Tensor) -> torch.Tensor:
    """FlashInfer's base-2 log-sum-exp in natural log (``-inf`` stays ``-inf``)."""
    return lse_base2.float() * math.log(2.0)


def _wrapper(device: torch.device, kind: str):
    key = (device, kind)
    if key not in _wrappers:
        import flashinfer

        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        cls = (
            flashinfer.BatchDecodeWithPagedKVCacheWrapper
            if kind == "decode"
            else flashinfer.BatchPrefillWithPagedKVCacheWrapper
        )
        _wrappers[key] = cls(workspace, "NHD")
    return _wrappers[key]


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
    """See :func:`tokenlake.kernels.partial_attention` (inputs already validated): ``q``
    ``[num_rows, H_q, D]``, ``pool_layer`` ``[num_slots, 2, C, H_kv, D]`` (NHD pages of
    ``C`` tokens), int32 CSR ``q_indptr``/``kv_indptr``/``kv_indices``/``last_len``.
    Returns float32 ``o`` ``[num_rows, H_q, D]`` and natural-log ``lse`` ``[num_rows, H_q]``."""
    if pool_layer.dtype == torch.float32:
        from tokenlake.kernels import reference

        return reference.partial_attention(
            q, q_indptr, pool_layer, kv_indptr, kv_indices, last_len, causal, sm_scale
        )
    device = q.device
    num_rows, num_q_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = pool_layer.shape
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    o = torch.zeros((num_rows, num_q_heads, head_dim), dtype=torch.float32, device=device)
    lse = torch.full((num_rows, num_q_heads), -math.inf, dtype=torch.float32, device=device)
    batch = nonempty_batch(
        q_indptr.cpu(), kv_indptr.cpu(), kv_indices.cpu(), last_len.cpu(), page_size, causal
    )
    if batch.rows.numel() == 0:
        return o, lse
    rows = batch.rows.to(device)
    q_sub = q.index_select(0, rows).contiguous()
    kv_args = (
        batch.kv_indptr.to(device),
        batch.kv_indices.to(device),
        batch.last_len.to(device),
    )
    dtypes = dict(q_data_type=q.dtype, kv_data_type=pool_layer.dtype)
    one_row_each = bool((batch.q_indptr[1:] - batch.q_indptr[:-1]).eq(1).all())
    if one_row_each and not causal:
        wrapper = _wrapper(device, "decode")
        wrapper.plan(
            *kv_args, num_q_heads, num_kv_heads, head_dim, page_size, sm_scale=scale, **dtypes
        )
    else:
        wrapper = _wrapper(device, "prefill")
        wrapper.plan(
            batch.q_indptr.to(device),
            *kv_args,
            num_q_heads,
            num_kv_heads,
            head_dim,
            page_size,
            causal=causal,
            sm_scale=scale,
            **dtypes,
        )
    o_sub, lse_sub = wrapper.run(q_sub, pool_layer, return_lse=True)
    o_sub, lse_sub = o_sub.float(), to_natural_lse(lse_sub)
    hidden = ~batch.visible.to(device)
    if bool(hidden.any()):  # causal rows that see no key: exactly empty, never NaN
        o_sub[hidden] = 0.0
        lse_sub[hidden] = -math.inf
    o.index_copy_(0, rows, o_sub)
    lse.index_copy_(0, rows, lse_sub)
    return o, lse
