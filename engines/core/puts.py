"""Executes the put side of transfer plans against KV pools: a destination's put runs, the
rows of a put gathered or scattered, segment copies. Used by the engine client (puts and copies
inside one host) and by the transfer engine (between-host puts and copies).

A plan is converted into these forms once, where it is bound, never per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenlake import _C
from tokenlake.engines.core.kv_pool import KVPool
from tokenlake.plans import TransferPlan


@dataclass(frozen=True)
class PutRuns:
    """The put runs of one destination: ``kv_buf`` rows ``src_row[i] : src_row[i] + length[i]``
    land in slot ``dst_slot[i]`` from token ``dst_offset[i]`` (all int32 ``[num_runs]``)."""

    src_row: np.ndarray
    length: np.ndarray
    dst_slot: np.ndarray
    dst_offset: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(np.asarray(self.length, dtype=np.int64).sum())

    def packed(self) -> PutRuns:
        """The same runs reading rows ``0..num_rows-1`` in run order, as after
        :func:`gather_runs` (what a destination on another host receives)."""
        lens = np.asarray(self.length, dtype=np.int64)
        starts = np.cumsum(lens) - lens
        return PutRuns(starts.astype(np.int32), self.length, self.dst_slot, self.dst_offset)

    def as_array(self) -> np.ndarray:
        """int32 ``[num_runs, 4]`` of ``(src_row, length, dst_slot, dst_offset)``, what
        :func:`write_runs` takes."""
        columns = (self.src_row, self.length, self.dst_slot, self.dst_offset)
        return np.ascontiguousarray(np.stack(columns, axis=1), dtype=np.int32).reshape(-1, 4)

    def as_lists(self) -> list[tuple[int, int, int, int]]:
        """``(src_row, length, dst_slot, dst_offset)`` per run, as Python ints (converted once
        per bound plan, so a put of one layer is only the copies)."""
        return list(
            zip(
                self.src_row.tolist(),
                self.length.tolist(),
                self.dst_slot.tolist(),
                self.dst_offset.tolist(),
                strict=True,
            )
        )


def put_runs(plan: TransferPlan, d: int) -> PutRuns:
    """Runs of destination ``plan.dst_ids[d]``, without expanding them to rows."""
    lo, hi = int(plan.dst_indptr[d]), int(plan.dst_indptr[d + 1])
    return PutRuns(
        plan.run_src_row[lo:hi],
        plan.run_len[lo:hi],
        plan.run_dst_slot[lo:hi],
        plan.run_dst_offset[lo:hi],
    )


def gather_runs(kv_layer: torch.Tensor, runs: list[tuple[int, int, int, int]]) -> torch.Tensor:
    """The rows of ``kv_layer`` ``[num_rows, 2, H_kv, D]`` that ``runs`` (from
    :meth:`PutRuns.as_lists`) read, packed in run order into a new contiguous tensor."""
    pieces = [kv_layer[s : s + n] for s, n, _, _ in runs]
    if not pieces:
        return kv_layer.new_empty((0, *kv_layer.shape[1:]))
    return torch.cat(pieces).contiguous()


PUT_PARALLEL_MIN_BYTES: int = _C.PUT_PARALLEL_MIN_BYTES
"""By default a CPU put is split over the kernels' threads from this many bytes per call on:
never (csrc/put_runs.h says why); ``DataPlaneConfig.put_parallel_min_bytes`` sets it."""


def write_runs(
    pool: KVPool,
    runs: np.ndarray,
    kv_layer: torch.Tensor | np.ndarray,
    layer: int,
    min_parallel_bytes: int = PUT_PARALLEL_MIN_BYTES,
) -> None:
    """Store ``kv_layer`` ``[num_rows, 2, H_kv, D]`` into one layer's pages by ``runs``
    (int32 ``[num_runs, 4]``, :meth:`PutRuns.as_array`), so a put moves each byte once. On
    CPU one C++ call copies every run (row by row, reading the rows in order: at about
    memcpy speed, where a strided numpy or torch copy runs at half of it), split over the
    kernels' thread pool from ``min_parallel_bytes`` on (below about 1 MiB handing work to
    another thread costs more than it saves);
    ``kv_layer`` may already be the rows' bytes (:func:`host_rows`, made once per bound
    plan, not per put)."""
    if isinstance(kv_layer, np.ndarray) or kv_layer.device.type == "cpu":
        rows = kv_layer if isinstance(kv_layer, np.ndarray) else host_rows(kv_layer)
        _C.write_runs(pool.host_bytes[layer], rows, runs, min_parallel_bytes)
        return
    pages = pool.layer(layer)
    for s, n, slot, off in runs.tolist():
        pages[slot, :, off : off + n].copy_(kv_layer[s : s + n].transpose(0, 1))


@dataclass(frozen=True)
class LocalPut:
    """The put runs of one destination pool in this host, bound once per transfer plan.

    On CPU a put is one C++ call over the runs (:func:`write_runs`). On CUDA it is one
    scatter: ``scatter_index`` (int64 ``[2 * num_rows]``, built here once) names, for K then
    V of each ``kv_buf`` row ``src_index`` reads, its flat row of the pool layer viewed as
    ``[num_slots * 2 * C, H_kv, D]`` (:func:`scatter_rows`), so a layer's put is one
    ``index_copy_`` whatever the number of runs and requests.
    """

    pool: KVPool
    runs: np.ndarray  # int32 [num_runs, 4], PutRuns.as_array()
    src_index: torch.Tensor | None  # int64 [num_rows]: kv_buf rows in run order (None: CPU)
    scatter_index: torch.Tensor | None  # int64 [2 * num_rows] (None: CPU)

    @classmethod
    def bind(cls, pool: KVPool, runs: np.ndarray, scatter: bool | None = None) -> LocalPut:
        """``scatter`` forces the scatter form (default: on a non-CPU pool)."""
        device = pool.data.device
        if scatter is None:
            scatter = device.type != "cpu"
        if not scatter:
            return cls(pool, runs, None, None)
        src, dst = scatter_indices(runs, pool.data.shape[3])
        return cls(pool, runs, torch.from_numpy(src).to(device), torch.from_numpy(dst).to(device))

    def write(self, rows: torch.Tensor | np.ndarray, layer: int, min_parallel_bytes: int) -> None:
        """Store the destination's rows of ``rows`` (``kv_buf[layer]``, or its bytes on CPU)."""
        if self.scatter_index is None:
            write_runs(self.pool, self.runs, rows, layer, min_parallel_bytes)
            return
        scatter_rows(self.pool.layer(layer), rows, self.src_index, self.scatter_index)


def scatter_indices(runs: np.ndarray, page_len: int) -> tuple[np.ndarray, np.ndarray]:
    """For runs (int32 ``[num_runs, 4]`` of ``(src_row, length, dst_slot, dst_offset)``):
    the ``kv_buf`` row of each stored token (int64 ``[n]``) and the flat pool rows of its K
    then V (int64 ``[2n]``: K of token ``i`` at ``2i``, V at ``2i + 1``) in a layer viewed as
    ``[num_slots * 2 * C, H_kv, D]``."""
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 4)
    lens = runs[:, 1]
    total = int(lens.sum())
    run_of = np.repeat(np.arange(len(runs)), lens)
    within = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    src = runs[run_of, 0] + within
    k_row = runs[run_of, 2] * (2 * page_len) + runs[run_of, 3] + within
    dst = np.stack((k_row, k_row + page_len), axis=1).reshape(-1)
    return src, dst


def scatter_rows(
    pool_layer: torch.Tensor,
    kv_layer: torch.Tensor,
    src_index: torch.Tensor,
    scatter_index: torch.Tensor,
) -> None:
    """One layer's put as one gather and one scatter (:func:`scatter_indices`):
    ``kv_layer`` ``[num_rows, 2, H_kv, D]`` rows ``src_index`` into ``pool_layer``
    ``[num_slots, 2, C, H_kv, D]``."""
    h_kv, dim = pool_layer.shape[-2:]
    flat = pool_layer.view(-1, h_kv, dim)
    flat.index_copy_(0, scatter_index, kv_layer.index_select(0, src_index).view(-1, h_kv, dim))


def host_rows(kv: torch.Tensor) -> np.ndarray:
    """A CPU tensor of KV rows (any leading dims, then ``[2, H_kv, D]``) as a numpy ``uint8``
    view of the same memory, the form :func:`write_runs` copies from."""
    return kv.view(torch.uint8).numpy()


def segment_view(pool: KVPool, slot: int, length: int) -> torch.Tensor:
    """The first ``length`` tokens of ``slot``, all layers: a ``[L, 2, length, H_kv, D]`` view."""
    return pool.data[:, slot, :, :length]


def copy_segment(src: KVPool, src_slot: int, dst: KVPool, dst_slot: int, length: int) -> None:
    """One copy-on-extend or replication order: the first ``length`` tokens of ``src_slot``,
    all layers, into ``dst_slot``. Never overlaps a put of the same iteration."""
    segment_view(dst, dst_slot, length).copy_(segment_view(src, src_slot, length))
