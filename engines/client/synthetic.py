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

from tokenlake.config import ModelShape
from tokenlake.engines.client.forward import RowBatch, run_forward
from tokenlake.engines.kernels.reference import attend
from tokenlake.plans import Chunk, Plans


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
        scale, cap = self.model.head_dim**-0.5, self.model.logit_cap
        return attend(q, kv[:, 0], kv[:, 1], causal=True, sm_scale=scale, logit_cap=cap)


@dataclass(frozen=True)
class RowResult:
    """Attention output of one request's rows ``first:end`` in one layer."""

    request_id: int | str
    first: int
    end: int
    layer: int
    o: torch.Tensor  # [end - first, H_q, D] float32
    lse: torch.Tensor  # [end - first, H_q] float32


class SyntheticLayerModel:
    """:class:`SyntheticModel` as a :class:`~tokenlake.engines.client.forward.LayerModel` for the
    iteration driver: q, K, V of every row from the tables, and every chunk's merged
    attention of every layer recorded as a :class:`RowResult`."""

    def __init__(self, model: SyntheticModel) -> None:
        self.model = model
        self.num_layers = model.model.num_layers

    def begin(self, batch: RowBatch) -> tuple[RowBatch, list[RowResult]]:
        return batch, []

    def project(self, state, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, _ = state
        kv = self.model.kv(batch.token_ids, batch.positions, layer)
        return self.model.q(batch.token_ids, batch.positions, layer), kv[:, 0], kv[:, 1]

    def absorb(self, state, layer: int, o: torch.Tensor, lse: torch.Tensor) -> None:
        batch, results = state
        for b, chunk in enumerate(batch.chunks):
            lo, hi = int(batch.indptr[b]), int(batch.indptr[b + 1])
            results.append(
                RowResult(chunk.request_id, chunk.start, chunk.end, layer, o[lo:hi], lse[lo:hi])
            )


def run_iteration(
    cluster, plans: Plans, chunks: Mapping[int | str, Chunk], model: SyntheticModel
) -> list[RowResult]:
    """Play the compute engine of one planned iteration (docs/architecture.md#one-iterations-life) with the iteration
    driver :func:`~tokenlake.engines.client.forward.run_forward`. Returns every chunk's merged
    attention of every layer; every put has landed when it returns."""
    _, (_, results) = run_forward(cluster, plans, chunks, SyntheticLayerModel(model))
    return results


class SyntheticProgram:
    """A compute process's program (see :mod:`tokenlake.engines.clusters.compute_process`): runs the
    synthetic model over its sub-batches and returns every row result as plain values
    ``[request_id, first, end, layer, o (f32, flat), lse (f32, flat)]``."""

    def __init__(self, shape: ModelShape, seed: int = 0) -> None:
        self.model = SyntheticModel(shape, seed)

    def __call__(self, cluster, plans: Plans, chunks: Mapping[int | str, Chunk]) -> list:
        return [
            [
                r.request_id,
                r.first,
                r.end,
                r.layer,
                r.o.reshape(-1).numpy(),
                r.lse.reshape(-1).numpy(),
            ]
            for r in run_iteration(cluster, plans, chunks, self.model)
        ]
