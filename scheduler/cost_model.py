"""Roofline cost of forwards on simulated hardware (profiles in :mod:`tokenlake.cluster.profiles`).

Each forward takes ``max(FLOPs / peak_flops, bytes / mem_bandwidth)``: one instance reads its
weights once per iteration, writes the new tokens' KV, and does the matmuls of every new token
plus causal attention among a chunk's new tokens. Attention over a cached prefix is the query
engines' work on the segments' holders (:meth:`CostModel.query_time`). The scheduler fits its
latency model to :meth:`CostModel.profile_rows`; the cluster simulator can call the same
methods for ground-truth kernel time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenlake.cluster.profiles import HardwareProfile, ModelProfile
from tokenlake.errors import InvalidArgumentError
from tokenlake.scheduler.latency_model import (
    DECODE,
    PREFILL,
    LatencyModel,
    ProfileRow,
    fit_latency_model,
)

Piece = tuple[int, int]  # rows first:end of one chunk, offsets from the chunk's first new token


def split_rows(lengths: Sequence[int], dop: int) -> list[list[Piece]]:
    """Split a batch's rows into ``dop`` contiguous near-equal sub-batches, as the planner does
    (sub-batch ``j`` gets rows ``round(total·j/dop) : round(total·(j+1)/dop)``)."""
    total = sum(lengths)
    bounds = [round(total * j / dop) for j in range(dop + 1)]
    subs = []
    for j in range(dop):
        pieces, base = [], 0
        for size in lengths:
            a, b = max(bounds[j], base), min(bounds[j + 1], base + size)
            if a < b:
                pieces.append((a - base, b - base))
            base += size
        subs.append(pieces)
    return subs


class CostModel:
    """Roofline time of forwards, prefix-attention queries and transfers on one instance."""

    def __init__(self, hardware: HardwareProfile, model: ModelProfile) -> None:
        if not isinstance(hardware, HardwareProfile):
            raise InvalidArgumentError("hardware: expected a HardwareProfile")
        if not isinstance(model, ModelProfile):
            raise InvalidArgumentError("model: expected a ModelProfile")
        self.hardware = hardware
        self.model = model
        m = model
        embed = m.vocab_size * m.hidden_size
        self._matmul_params = m.num_params - 2 * embed  # per-token matmuls (no embed, no head)
        self._head_params = embed
        # the input embedding is a gather, not a read of the whole table
        self._weight_bytes = (m.num_params - embed) * m.shape.dtype_bytes
        self._attn = 4.0 * m.num_layers * m.num_q_heads * m.head_dim  # FLOPs per (row, key)
        self._kv_bytes = m.shape.kv_bytes_per_token
        self._q_and_o_bytes = 2 * m.num_layers * m.shape.q_bytes_per_token_layer  # per row

    def _roofline(self, flops: float, num_bytes: float) -> float:
        return max(flops / self.hardware.peak_flops, num_bytes / self.hardware.mem_bandwidth)

    def forward_time(self, pieces: Sequence[Piece]) -> float:
        """Seconds of one instance's forward over ``pieces`` (one per chunk, see :data:`Piece`);
        the LM head runs once per piece."""
        rows = sum(end - first for first, end in pieces)
        # causal attention of rows first..end-1 over the chunk's new tokens 0..row
        pairs = sum((end * (end + 1) - first * (first + 1)) / 2 for first, end in pieces)
        flops = 2.0 * (self._matmul_params * rows + self._head_params * len(pieces))
        flops += self._attn * pairs
        return self._roofline(flops, self._weight_bytes + rows * self._kv_bytes)

    def batch_time(self, lengths: Sequence[int], dop: int = 1) -> float:
        """Seconds of a batch (new tokens per request) split over ``dop`` instances running in
        parallel: the slowest sub-batch."""
        if not lengths or min(lengths) < 1:
            raise InvalidArgumentError(f"lengths: expected positive token counts, got {lengths}")
        if isinstance(dop, bool) or not isinstance(dop, int) or not 1 <= dop <= sum(lengths):
            raise InvalidArgumentError(f"dop: expected an int in 1..{sum(lengths)}, got {dop!r}")
        return max(self.forward_time(p) for p in split_rows(lengths, dop))

    def query_time(
        self, num_rows: int, num_kv_tokens: int, num_read_tokens: int | None = None
    ) -> float:
        """Seconds a holder spends on prefix attention of ``num_rows`` query rows over
        ``num_kv_tokens`` of its cached tokens (all layers). ``num_read_tokens`` (default
        ``num_kv_tokens``) is how many of those tokens' KV it reads from memory: fewer when
        rows of different requests that read the same segment run as one group (the segment
        is read once for all of them)."""
        flops = self._attn * num_rows * num_kv_tokens
        q_and_o = num_rows * self._q_and_o_bytes
        read = num_kv_tokens if num_read_tokens is None else num_read_tokens
        return self._roofline(flops, read * self._kv_bytes + q_and_o)

    def transfer_time(self, num_bytes: float, same_node: bool = True) -> float:
        """Seconds to send ``num_bytes`` to one peer."""
        hw = self.hardware
        bandwidth = hw.intra_node_bandwidth if same_node else hw.inter_node_bandwidth
        return hw.net_latency_s + num_bytes / bandwidth

    def profile_rows(
        self,
        dops: Sequence[int] = (1, 2, 4, 8),
        rows_per_dop: int = 48,
        max_len: int = 32768,
        max_batch: int = 8,
        max_decode_batch: int = 256,
        seed: int = 0,
    ) -> list[ProfileRow]:
        """Modelled profile rows: random prefill batches (1..``max_batch`` requests of
        1..``max_len`` new tokens, log-uniform) at each DoP, and decode batches at DoP 1."""
        rng = np.random.default_rng(seed)
        rows = []
        for dop in dops:
            for _ in range(rows_per_dop):
                n = int(rng.integers(1, max_batch + 1))
                lengths = np.exp(rng.uniform(0, np.log(max_len), n)).astype(int) + 1
                lengths = tuple(int(x) for x in lengths)
                if sum(lengths) < dop:
                    continue
                rows.append(ProfileRow(PREFILL, dop, lengths, self.batch_time(lengths, dop)))
        for bs in np.unique(np.geomspace(1, max_decode_batch, rows_per_dop).astype(int)):
            lengths = (1,) * int(bs)
            rows.append(ProfileRow(DECODE, 1, lengths, self.batch_time(lengths, 1)))
        return rows

    def fit(self, dops: Sequence[int] = (1, 2, 4, 8), **kwargs) -> LatencyModel:
        """A :class:`LatencyModel` fitted to :meth:`profile_rows` (same keyword arguments)."""
        return fit_latency_model(self.profile_rows(dops, **kwargs))
