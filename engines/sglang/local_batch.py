"""A forward the pool cannot take, attended from SGLang's own KV cache instead.

The pool may be smaller than SGLang's KV cache, and its data plane's buffers hold a bounded
number of rows per forward. When a forward's plan would need more slots than the pool has
free of pinned data (``PoolFullError``) or more rows than the buffers hold, nothing is
planned: every request of the batch attends over its whole sequence read from SGLang's KV
cache (where SGLang keeps every token it did not evict), with the same causal kernel and the
same merge as a pooled forward, so the output is the same. The batch's pool requests are
finished; the next forward starts them again from what the pool holds and backfills the
rest from SGLang's cache (:mod:`.batch_map`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenlake.engines.client.prefix_attention import PrefixAttention

from .batch_map import SeqInfo


@dataclass(eq=False)
class LocalBatch:
    """Key rows request by request (each request's whole sequence), query rows in SGLang's
    token order (each request's new tokens)."""

    kv_slots: torch.Tensor  # int64 [T_kv]: SGLang KV slot of every key row
    new_kv_rows: torch.Tensor  # int64 [T]: key row of each SGLang token row
    attention: PrefixAttention


def plan_rows(seqs: Sequence[SeqInfo], starts: Sequence[int]) -> int:
    """Rows a pooled forward needs: each request's tokens from its pool start on."""
    return sum(s.seq_len - start for s, start in zip(seqs, starts, strict=True))


def local_batch(
    seqs: Sequence[SeqInfo], req_to_token: torch.Tensor, shape, dtype: torch.dtype,
    backend: str | None, planner, device: torch.device,
) -> LocalBatch:  # fmt: skip
    """Bind the attention of ``seqs`` over SGLang's cache (``shape``: the ``ModelShape``)."""
    kv_off = np.concatenate([[0], np.cumsum([s.seq_len for s in seqs])]).astype(np.int64)
    new_off = np.concatenate([[0], np.cumsum([s.new_len for s in seqs])]).astype(np.int64)
    slots = torch.cat([req_to_token[s.row, : s.seq_len].long() for s in seqs])
    new_rows = np.concatenate(
        [np.arange(kv_off[b] + s.prefix_len, kv_off[b + 1]) for b, s in enumerate(seqs)]
    )
    attention = PrefixAttention.bind(
        new_off, (int(new_off[-1]), shape.num_q_heads, shape.head_dim), shape.num_kv_heads,
        dtype, kv_indptr=kv_off, num_kv_rows=int(kv_off[-1]), backend=backend,
        logit_cap=shape.logit_cap, device=device, planner=planner,
    )  # fmt: skip
    return LocalBatch(slots.to(device), torch.from_numpy(new_rows).to(device), attention)


def attend(
    batch: LocalBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """``o`` ``[T, H_q, D]`` float32 of the new rows ``q`` (scaled for ``1/sqrt(D)``), whose
    own keys ``k``/``v`` are used as computed; every other key is read from the cache."""
    keys, values = k_cache[batch.kv_slots], v_cache[batch.kv_slots]
    keys[batch.new_kv_rows] = k.to(keys.dtype)
    values[batch.new_kv_rows] = v.to(values.dtype)
    o_p = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse_p = torch.full(q.shape[:2], -torch.inf, dtype=torch.float32, device=q.device)
    o, _ = batch.attention(q, keys, values, o_p, lse_p)
    return o
