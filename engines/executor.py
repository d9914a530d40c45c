"""Executes plan pieces against KV pools. Shared by the in-process LocalCluster and the
multi-process engines, so both run exactly the same data-plane code."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenlake import kernels
from tokenlake.engines.kv_pool import KVPool
from tokenlake.errors import InvalidArgumentError, StalePlanError
from tokenlake.plans import HolderPart, QueryPlan, TransferPlan


def _i32(arr: np.ndarray, device) -> torch.Tensor:
    return torch.tensor(arr, dtype=torch.int32, device=device)


def _i64(arr: np.ndarray, device) -> torch.Tensor:
    return torch.tensor(arr, dtype=torch.int64, device=device)


@dataclass(frozen=True)
class PreparedPart:
    """A :class:`HolderPart` as device tensors (built once per plan, used every layer)."""

    instance_id: int
    rows: torch.Tensor  # int64 [num_part_rows]
    q_indptr: torch.Tensor  # int32
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_len: torch.Tensor

    @classmethod
    def from_part(cls, part: HolderPart, device) -> PreparedPart:
        return cls(
            part.instance_id,
            _i64(part.rows, device),
            _i32(part.q_indptr, device),
            _i32(part.kv_indptr, device),
            _i32(part.kv_indices, device),
            _i32(part.last_len, device),
        )


def prepare_query(plan: QueryPlan, device) -> list[PreparedPart]:
    return [PreparedPart.from_part(part, device) for part in plan.parts]


def holder_attention(
    pool_layer: torch.Tensor, part: PreparedPart, q: torch.Tensor, backend: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A holder's partial attention for its rows of ``q`` ``[num_rows, H_q, D]``.

    Returns ``o`` ``[num_part_rows, H_q, D]`` and ``lse`` ``[num_part_rows, H_q]`` float32.
    """
    q_part = q.index_select(0, part.rows)
    return kernels.partial_attention(
        q_part,
        part.q_indptr,
        pool_layer,
        part.kv_indptr,
        part.kv_indices,
        part.last_len,
        causal=False,
        backend=backend,
    )


def merge_rows(
    o: torch.Tensor,
    lse: torch.Tensor,
    rows: torch.Tensor,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    backend: str | None,
) -> None:
    """Merge a holder's result into rows ``rows`` of the running ``(o, lse)`` in place."""
    merged_o, merged_lse = kernels.merge(
        o.index_select(0, rows), lse.index_select(0, rows), o_part, lse_part, backend=backend
    )
    o.index_copy_(0, rows, merged_o)
    lse.index_copy_(0, rows, merged_lse)


@dataclass(frozen=True)
class PreparedPut:
    """Per destination instance: the kv_buf rows and their flat page-row targets."""

    instance_id: int
    src_rows: torch.Tensor  # int64 [n]
    flat_rows: torch.Tensor  # int64 [2n]: K then V target of each row in a [S*2*C, H*D] view


def prepare_put(plan: TransferPlan, segment_len: int, device) -> list[PreparedPut]:
    out = []
    for d, instance_id in enumerate(plan.dst_ids.tolist()):
        src, slot, offset = plan.rows_to(d)
        k_rows = slot * 2 * segment_len + offset
        flat = np.stack([k_rows, k_rows + segment_len], axis=1).reshape(-1)
        out.append(PreparedPut(instance_id, _i64(src, device), _i64(flat, device)))
    return out


def write_rows(pool: KVPool, put: PreparedPut, kv_layer: torch.Tensor, layer: int) -> None:
    """Store ``kv_layer`` ``[num_rows, 2, H_kv, D]`` rows into one destination's layer pages."""
    pages = pool.layer(layer)
    flat_pages = pages.view(-1, pages.shape[-2] * pages.shape[-1])
    rows = kv_layer.index_select(0, put.src_rows).view(-1, flat_pages.shape[1])
    flat_pages.index_copy_(0, put.flat_rows, rows)


def copy_segments(pools: Sequence[KVPool], plan: TransferPlan) -> None:
    """Copy-on-extend / replication: the first ``copy_len`` tokens of each source slot, all
    layers. Source and destination ranges never overlap a put of the same iteration."""
    for i in range(plan.num_copies):
        n = int(plan.copy_len[i])
        src = pools[int(plan.copy_src_instance[i])].data[:, int(plan.copy_src_slot[i]), :, :n]
        dst = pools[int(plan.copy_dst_instance[i])].data[:, int(plan.copy_dst_slot[i]), :, :n]
        dst.copy_(src)


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
        :func:`gather_runs` (what a remote destination receives)."""
        lens = np.asarray(self.length, dtype=np.int64)
        starts = np.cumsum(lens) - lens
        return PutRuns(starts.astype(np.int32), self.length, self.dst_slot, self.dst_offset)


def put_runs(plan: TransferPlan, d: int) -> PutRuns:
    """Runs of destination ``plan.dst_ids[d]``, without expanding them to rows."""
    lo, hi = int(plan.dst_indptr[d]), int(plan.dst_indptr[d + 1])
    return PutRuns(
        plan.run_src_row[lo:hi],
        plan.run_len[lo:hi],
        plan.run_dst_slot[lo:hi],
        plan.run_dst_offset[lo:hi],
    )


def gather_runs(kv_layer: torch.Tensor, runs: PutRuns) -> torch.Tensor:
    """The rows of ``kv_layer`` ``[num_rows, 2, H_kv, D]`` that ``runs`` read, packed in run
    order into a new contiguous ``[runs.num_rows, 2, H_kv, D]`` tensor."""
    pieces = [
        kv_layer[s : s + n]
        for s, n in zip(runs.src_row.tolist(), runs.length.tolist(), strict=True)
    ]
    if not pieces:
        return kv_layer.new_empty((0, *kv_layer.shape[1:]))
    return torch.cat(pieces).contiguous()


def write_runs(pool: KVPool, runs: PutRuns, kv_layer: torch.Tensor, layer: int) -> None:
    """Store ``kv_layer`` ``[num_rows, 2, H_kv, D]`` runs into one layer's pages: one strided
    copy per run and no temporary, so a put moves each byte once."""
    pages = pool.layer(layer)
    for s, n, slot, off in zip(
        runs.src_row.tolist(),
        runs.length.tolist(),
        runs.dst_slot.tolist(),
        runs.dst_offset.tolist(),
        strict=True,
    ):
        pages[slot, :, off : off + n].copy_(kv_layer[s : s + n].transpose(0, 1))


def segment_view(pool: KVPool, slot: int, length: int) -> torch.Tensor:
    """The first ``length`` tokens of ``slot``, all layers: a ``[L, 2, length, H_kv, D]`` view."""
    return pool.data[:, slot, :, :length]


def copy_segment(src: KVPool, src_slot: int, dst: KVPool, dst_slot: int, length: int) -> None:
    """One copy-on-extend or replication order (see :func:`copy_segments`)."""
    segment_view(dst, dst_slot, length).copy_(segment_view(src, src_slot, length))


def check_plan(name: str, plan, kind: type, instance_id: int, active_epoch: int | None) -> None:
    """A data-plane call's plan must be of ``kind``, for this instance, and current."""
    if not isinstance(plan, kind):
        raise InvalidArgumentError(f"{name}: expected a {kind.__name__}, got {type(plan).__name__}")
    if plan.origin != instance_id:
        raise InvalidArgumentError(
            f"{name}: planned for instance {plan.origin}, not this engine ({instance_id})"
        )
    if plan.epoch != active_epoch:
        raise StalePlanError(
            f"{name}: from iteration {plan.epoch}; the active one is {active_epoch}"
        )
