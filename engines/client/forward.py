"""The iteration driver: one planned iteration of a model whose only attention over the past
is the pool's prefix attention (docs/architecture.md#one-iterations-life), for any model that splits at its attention
(:class:`LayerModel`: the real Llama-family model, the synthetic K/V model).

Every row of the iteration (all sub-batches, prefill chunks and decode steps alike) goes
through the model's dense layers in one ragged forward; per layer its new K/V are ``put``
and its q rows ``query``'d on the sub-batches' origin engines, and the prefix partials are
merged with causal attention over the chunks' new tokens (:class:`PrefixAttention`). A
chunk split over several instances (DoP > 1) sees its earlier pieces' keys exactly.

This module is the compute side's only touch of the data plane (:class:`_SubBatch`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tokenlake.engines.client.prefix_attention import PrefixAttention
from tokenlake.errors import InvalidArgumentError
from tokenlake.plans import Chunk, Plans, QueryPlan, TransferPlan


@dataclass(frozen=True)
class RowBatch:
    """The new tokens of one iteration, chunk after chunk.

    Chunk ``b`` (request ``request_ids[b]``) owns rows ``indptr[b]:indptr[b+1]``: its tokens
    ``chunk.start:chunk.end`` at those positions.
    """

    request_ids: tuple
    chunks: tuple[Chunk, ...]
    indptr: np.ndarray  # int64 [B + 1]
    token_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]

    @classmethod
    def from_chunks(cls, chunks: list[Chunk]) -> RowBatch:
        lens = [c.end - c.start for c in chunks]
        return cls(
            tuple(c.request_id for c in chunks),
            tuple(chunks),
            np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            np.concatenate([c.token_ids[c.start : c.end] for c in chunks]).astype(np.int64),
            np.concatenate([np.arange(c.start, c.end) for c in chunks]).astype(np.int64),
        )

    @property
    def num_rows(self) -> int:
        return int(self.indptr[-1])

    @property
    def last_rows(self) -> np.ndarray:
        """int64 ``[B]``: the row of each chunk's last token."""
        return self.indptr[1:] - 1


class LayerModel(Protocol):
    """A model split at its attention, as the driver runs it."""

    num_layers: int

    def begin(self, batch: RowBatch) -> object:
        """Start a forward of ``batch``'s rows; returns the model's state."""

    def project(self, state: object, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q`` ``[T, H_q, D]``, ``k`` / ``v`` ``[T, H_kv, D]`` of every row (model dtype)."""

    def absorb(self, state: object, layer: int, o: torch.Tensor, lse: torch.Tensor) -> None:
        """Continue from layer ``layer``'s attention: ``o`` ``[T, H_q, D]``, ``lse``
        ``[T, H_q]``, both float32, each row over its whole sequence."""


@dataclass(eq=False)
class _SubBatch:
    """One sub-batch bound on its origin engine; ``rows`` are its rows in the iteration's
    :class:`RowBatch` (a slice when they are consecutive, ``None`` when they are all of them
    in order); ``kv_layers`` are ``kv_buf``'s layers ``[num_rows, 2, H_kv, D]``."""

    engine: object
    q_buf: torch.Tensor
    kv_buf: torch.Tensor
    rows: slice | torch.Tensor | None
    kv_layers: tuple[torch.Tensor, ...]

    @classmethod
    def bind(cls, cluster, qp: QueryPlan, tp: TransferPlan, batch: RowBatch, where: dict):
        engine = cluster.engine(qp.origin)
        q_buf = engine.init_query(qp)
        kv_buf = engine.init_transfer(tp)
        pieces = []
        for r, rid in enumerate(qp.request_ids):
            b = where.get(rid)
            if b is None:
                raise InvalidArgumentError(f"chunks: no chunk for request {rid!r} of the plans")
            first = int(batch.indptr[b]) + int(qp.positions[r]) - batch.chunks[b].start
            pieces.append(np.arange(first, first + int(qp.q_indptr[r + 1] - qp.q_indptr[r])))
        rows = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        layers = kv_buf.unbind(0)
        if len(rows) and np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows))):
            if rows[0] == 0 and len(rows) == batch.num_rows:
                return cls(engine, q_buf, kv_buf, None, layers)
            rows = slice(int(rows[0]), int(rows[0]) + len(rows))
            return cls(engine, q_buf, kv_buf, rows, layers)
        return cls(engine, q_buf, kv_buf, torch.from_numpy(rows), layers)

    def put(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> None:
        if self.rows is not None:
            k, v = k[self.rows], v[self.rows]
        torch.stack((k, v), 1, out=self.kv_layers[layer])
        self.engine.put(self.kv_buf, layer)

    def query(self, q: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefix partial ``(o, lse)`` of this sub-batch's rows of ``q``."""
        self.q_buf.copy_(q if self.rows is None else q[self.rows])
        return self.engine.query(self.q_buf, layer)


def _prefix_partial(subs: list[_SubBatch], q: torch.Tensor, layer: int):
    """Every row's prefix partial ``(o [T, H_q, D], lse [T, H_q])`` float32, gathered from the
    sub-batches' queries (one sub-batch holding every row in order: its result as is)."""
    n = q.shape[0]
    if len(subs) == 1 and subs[0].rows is None:
        return subs[0].query(q, layer)
    o = q.new_zeros((n, q.shape[1], q.shape[2]), dtype=torch.float32)
    lse = q.new_full((n, q.shape[1]), -math.inf, dtype=torch.float32)
    for sub in subs:
        rows = slice(None) if sub.rows is None else sub.rows
        o[rows], lse[rows] = sub.query(q, layer)
    return o, lse


def run_forward(cluster, plans: Plans, chunks: Mapping, model: LayerModel) -> tuple:
    """Execute ``plans`` for ``chunks`` (by request id) with ``model``, layer by layer.

    ``cluster.engine(i)`` gives instance ``i``'s engine; ``cluster.backend`` the kernel
    backend, ``cluster.logit_cap`` the pool's attention soft cap. Returns ``(batch, state)``: the iteration's :class:`RowBatch` (chunks in the
    order of ``chunks``, those the plans run) and the model's state after the last layer.
    """
    planned = {rid for qp in plans.query_plans for rid in qp.request_ids}
    batch = RowBatch.from_chunks([c for rid, c in chunks.items() if rid in planned])
    where = {rid: b for b, rid in enumerate(batch.request_ids)}
    subs = [
        _SubBatch.bind(cluster, qp, tp, batch, where)
        for qp, tp in zip(plans.query_plans, plans.transfer_plans, strict=True)
    ]
    indptr = torch.from_numpy(batch.indptr.astype(np.int32))
    state = model.begin(batch)
    attention = None  # bound at the first layer, from its shapes (the same every layer)
    for layer in range(model.num_layers):
        q, k, v = model.project(state, layer)
        for sub in subs:
            sub.put(k, v, layer)
        prefix_o, prefix_lse = _prefix_partial(subs, q, layer)
        if attention is None:
            attention = PrefixAttention.bind(
                indptr, tuple(q.shape), k.shape[1], q.dtype, backend=cluster.backend,
                logit_cap=cluster.logit_cap, device=q.device,
            )  # fmt: skip
        o, lse = attention(q, k, v, prefix_o, prefix_lse)
        model.absorb(state, layer, o, lse)
    sync = getattr(cluster, "synchronize", None)
    if sync is not None:  # an asynchronous data plane: every put lands before commit
        sync()
    return batch, state
