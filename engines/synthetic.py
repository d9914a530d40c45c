"""A synthetic compute engine for tests, the demo and benchmarks.

K and V of a token are a deterministic function of (token id, position, layer), as in a
real model where they depend only on the prefix; so deduplicated segments hold exactly the
KV every sharer would have computed, and a monolithic reference can be recomputed at will.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from tokenlake import kernels
from tokenlake.config import ModelShape
from tokenlake.engines.iteration import run_sub_batch
from tokenlake.kernels.reference import attend
from tokenlake.plans import Chunk, Plans, QueryPlan


class SyntheticModel:
    """Per-layer random tables indexed by a hash of (token id, position)."""

    def __init__(self, model: ModelShape, seed: int = 0, table_size: int = 4096) -> None:
        gen = torch.Generator().manual_seed(seed)
        h_kv, h_q, d = model.num_kv_heads, model.num_q_heads, model.head_dim
        self.model = model
        self.table_size = table_size
        self._kv = torch.randn((model.num_layers, table_size, 2, h_kv, d), generator=gen)
        self._q = torch.randn((model.num_layers, table_size, h_q, d), generator=gen)
        self._kv = self._kv.to(model.torch_dtype)
        self._q = self._q.to(model.torch_dtype)

    def _index(self, token_ids: np.ndarray, positions: np.ndarray, salt: int) -> torch.Tensor:
        mixed = token_ids.astype(np.int64) * 1_000_003 + positions.astype(np.int64) * 7_919 + salt
        return torch.from_numpy(mixed % self.table_size)

    def kv(self, token_ids: np.ndarray, positions: np.ndarray, layer: int) -> torch.Tensor:
        """``[T, 2, H_kv, D]`` K and V of tokens at ``positions``."""
        return self._kv[layer].index_select(0, self._index(token_ids, positions, 0))

    def q(self, token_ids: np.ndarray, positions: np.ndarray, layer: int) -> torch.Tensor:
        """``[T, H_q, D]`` queries of tokens at ``positions``."""
        return self._q[layer].index_select(0, self._index(token_ids, positions, 12_345))

    def reference(self, token_ids: np.ndarray, first: int, end: int, layer: int):
        """Monolithic causal attention of rows ``first:end`` over tokens ``0:end``."""
        pos = np.arange(end)
        kv = self.kv(token_ids[:end], pos, layer)
        q = self.q(token_ids[first:end], pos[first:end], layer)
        return attend(q, kv[:, 0], kv[:, 1], causal=True, sm_scale=self.model.head_dim**-0.5)


@dataclass(frozen=True)
class RowResult:
    """Attention output of one request's rows ``first:end`` in one layer."""

    request_id: int | str
    first: int
    end: int
    layer: int
    o: torch.Tensor  # [end - first, H_q, D] float32
    lse: torch.Tensor  # [end - first, H_q] float32


class SyntheticCompute:
    """The synthetic compute engine of one sub-batch (a
    :class:`~tokenlake.engines.protocol.LayerCompute`): writes K/V and q of the chunks' new
    tokens, merges prefix attention with causal self-attention over the chunk's new tokens,
    and keeps every row's result in :attr:`results`."""

    def __init__(
        self,
        model: SyntheticModel,
        query_plan: QueryPlan,
        chunks: Mapping[int | str, Chunk],
        backend: str | None,
    ) -> None:
        self.model, self.backend = model, backend
        self.results: list[RowResult] = []
        self._pieces = []
        for r, rid in enumerate(query_plan.request_ids):
            lo, hi = int(query_plan.q_indptr[r]), int(query_plan.q_indptr[r + 1])
            first = int(query_plan.positions[r])
            self._pieces.append((rid, lo, hi, first, first + hi - lo, chunks[rid]))

    def write(self, layer: int, q_buf: torch.Tensor, kv_buf: torch.Tensor) -> None:
        self._q_buf = q_buf
        for _, lo, hi, first, end, chunk in self._pieces:
            pos = np.arange(first, end)
            kv_buf[layer, lo:hi] = self.model.kv(chunk.token_ids[first:end], pos, layer)
            q_buf[lo:hi] = self.model.q(chunk.token_ids[first:end], pos, layer)

    def attend(self, layer: int, o: torch.Tensor, lse: torch.Tensor) -> None:
        q_buf, model = self._q_buf, self.model
        for rid, lo, hi, first, end, chunk in self._pieces:
            # self-attention covers the chunk's new tokens up to this piece's end
            pos = np.arange(chunk.start, end)
            kv = model.kv(chunk.token_ids[chunk.start : end], pos, layer)
            o_s, lse_s = kernels.self_attention(
                q_buf[lo:hi],
                kv[:, 0].contiguous(),
                kv[:, 1].contiguous(),
                torch.tensor([0, hi - lo], dtype=torch.int32),
                backend=self.backend,
                kv_indptr=torch.tensor([0, end - chunk.start], dtype=torch.int32),
            )
            o_m, lse_m = kernels.merge(
                o[lo:hi].contiguous(), lse[lo:hi].contiguous(), o_s, lse_s, backend=self.backend
            )
            self.results.append(RowResult(rid, first, end, layer, o_m, lse_m))


def run_iteration(
    cluster, plans: Plans, chunks: Mapping[int | str, Chunk], model: SyntheticModel
) -> list[RowResult]:
    """Play the compute engine of every sub-batch of one planned iteration (DESIGN §3.1) with
    :func:`~tokenlake.engines.iteration.run_sub_batch`. Returns the merged attention of every
    row and layer; every put has landed when it returns."""
    results = []
    for qp, tp in zip(plans.query_plans, plans.transfer_plans, strict=True):
        compute = SyntheticCompute(model, qp, chunks, cluster.backend)
        run_sub_batch(cluster.engine(qp.origin), qp, tp, compute)
        results.extend(compute.results)
    return results
