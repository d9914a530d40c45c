"""Merging partial attention states by row, planned once per bound plan.

Several states (holder parts, shared-page groups) belong to one query row; their merge is an
LSE-weighted sum. Which state goes to which row is known on the host when a plan is bound, so
:class:`StateMerge` lays the states out once as a dense ``[num_rows, K]`` table (``K``: the
most states of any row; missing ones point at an empty state), and every layer then runs dense
ops only: two gathers, a max, an exp and two sums. On CUDA with a FlashInfer planner, the
gathered states go to FlashInfer's ``merge_states`` instead (one kernel for the max, the exps
and the sums: :func:`~tokenlake.engines.kernels.flashinfer_merge.merge_states_ln`). Scatter-adds (``index_add_``) would do the
same work but on CPU start a parallel region per call, which on a busy machine cost
milliseconds per layer for a few kilobytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenlake.engines.kernels.flashinfer_merge import merge_states_ln


@dataclass(frozen=True)
class StateMerge:
    """States ``s`` of rows ``state_rows[s]``, laid out for :meth:`run`."""

    num_rows: int
    num_states: int
    width: int  # K: the most states of one row
    index: torch.Tensor  # int64 [num_rows * K]: a state (any, where ``empty`` says none)
    empty: torch.Tensor  # bool [num_rows, K, 1]: no state there
    planner: object | None = None  # a FlashInferPlanner: merge with its merge_states (CUDA)

    @classmethod
    def build(cls, state_rows: np.ndarray, num_rows: int, device, planner=None) -> StateMerge:
        """``state_rows`` (host, int ``[S]``): the row of each state, each in ``[0, num_rows)``.
        ``planner``: a :class:`~tokenlake.engines.kernels.flashinfer_backend.FlashInferPlanner`
        whose FlashInfer (and model dtype) merge the states; ``None``: torch ops."""
        rows = np.asarray(state_rows, dtype=np.int64)
        num_states = len(rows)
        counts = np.bincount(rows, minlength=num_rows) if num_states else np.zeros(num_rows, int)
        width = max(1, int(counts.max()) if num_rows else 1)
        order = np.argsort(rows, kind="stable")
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]) if num_rows else np.zeros(0, int)
        rank = np.arange(num_states) - starts[rows[order]]  # position of each state in its row
        table = np.full((num_rows, width), -1, dtype=np.int64)
        table[rows[order], rank] = order
        empty = table < 0
        index = torch.from_numpy(np.where(empty, 0, table).reshape(-1)).to(device)
        mask = torch.from_numpy(empty[..., None]).to(device)
        return cls(num_rows, num_states, width, index, mask, planner)

    def run(self, o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``o`` ``[S, H, D]``, ``lse`` ``[S, H]`` float32 (natural log) → ``o``
        ``[num_rows, H, D]``, ``lse`` ``[num_rows, H]``; a row without a finite state gets
        ``o = 0``, ``lse = -inf``, like a row that sees no keys."""
        if self.num_states == 0:  # nothing to read: every row sees no keys
            o_none = o.new_zeros((self.num_rows, *o.shape[1:]))
            return o_none, lse.new_full((self.num_rows, lse.shape[1]), -torch.inf)
        shape = (self.num_rows, self.width)
        lse_k = lse.index_select(0, self.index).view(*shape, lse.shape[1])
        o_k = o.index_select(0, self.index).view(*shape, *o.shape[1:])
        # a padding entry weighs nothing (its o is finite); masked always, so that a layer
        # runs the same ops whatever the batch
        lse_k = lse_k.masked_fill(self.empty, -torch.inf)
        if self.planner is not None:
            return merge_states_ln(self.planner.flashinfer, o_k, lse_k, self.planner.dtype)
        top = lse_k.amax(dim=1)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        weight = torch.exp(lse_k - top[:, None])  # 0 for an lse of -inf
        total = weight.sum(dim=1)
        out = (o_k * weight[..., None]).sum(dim=1)
        seen = total > 0
        out = torch.where(seen[..., None], out / torch.where(seen, total, 1.0)[..., None], 0.0)
        return out, torch.where(seen, top + torch.log(total), -torch.inf)
