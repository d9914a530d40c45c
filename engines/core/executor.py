"""The query side of plans in kernel-ready form: a holder's part on the device, and the merge
of all of a query's parts into its ``(o, lse)``. Used by the engine client (its own part) and
by the query engine (peers' parts), whichever transport carries the requests; the put side is
:mod:`tokenlake.engines.core.puts`.

A plan is converted into these forms once, where it is bound, never per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenlake.engines import kernels
from tokenlake.engines.core.page_groups import group_shared_pages
from tokenlake.engines.core.state_merge import StateMerge
from tokenlake.engines.kernels.cpu import CpuPart
from tokenlake.engines.kernels.inputs import PagedCSR
from tokenlake.errors import InvalidArgumentError
from tokenlake.plans import HolderPart


def _i32(arr: np.ndarray, device) -> torch.Tensor:
    return torch.tensor(arr, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class BoundPart:
    """A :class:`HolderPart` as device tensors, built once per bound plan, used every layer.

    ``rows`` (int64 ``[num_part_rows]``) are the part's rows of the origin's ``q_buf``;
    ``q_index`` (int64) the rows of ``q`` the kernel reads, one per kernel row; ``state_rows`` (int64 ``[num_states]``, or ``None``)
    which part row each kernel row belongs to when pages read by several requests run as
    shared groups (:mod:`tokenlake.engines.core.page_groups`): the rows' states are then merged;
    ``identity`` is true when ``rows`` are ``0..n-1`` in order; ``logit_cap`` is the model's
    attention soft cap (0: none). The CSR is the kernel's.
    """

    instance_id: int
    rows: torch.Tensor
    q_indptr: torch.Tensor  # int32 [num_kernel_reqs + 1]
    kv_indptr: torch.Tensor  # int32 [num_kernel_reqs + 1]
    kv_indices: torch.Tensor  # int32 [nnz]
    last_len: torch.Tensor  # int32 [num_kernel_reqs]
    q_index: torch.Tensor
    identity: bool  # rows are 0..num_part_rows-1 in order (results need no scatter)
    state_rows: torch.Tensor | None = None
    planned: object | None = None  # a FlashInferPart, planned once at bind (CUDA)
    logit_cap: float = 0.0
    cpu_part: CpuPart | None = None  # the C++ kernel's form, checked once (CPU)
    num_kernel_rows: int = 0  # rows the kernel reads (states when grouped), known at bind
    # the part rows of its states on the host (rows, or rows[state_rows] when grouped): the
    # query's merge is laid out from these once (StateMerge), and a grouped part's own
    group_merge: StateMerge | None = None
    host_rows: np.ndarray | None = None
    host_state_rows: np.ndarray | None = None

    @classmethod
    def from_part(
        cls,
        part: HolderPart,
        device,
        packed: bool = False,
        planner=None,
        logit_cap: float = 0.0,
        page_len: int | None = None,
    ) -> BoundPart:
        """``packed``: the part's rows arrive as rows ``0..n-1`` (from another host).
        ``planner`` (a :class:`~tokenlake.engines.kernels.flashinfer_backend.FlashInferPlanner`, made
        with the same ``logit_cap``) plans the part's kernel once, here. ``page_len`` (the
        pool's segment length) turns on shared-page groups; ``None`` runs the part as it is."""
        n = len(part.rows)
        rows = np.arange(n) if packed else np.asarray(part.rows, dtype=np.int64)
        csr = PagedCSR(part.q_indptr, part.kv_indptr, part.kv_indices, part.last_len)
        groups = None
        if page_len is not None:
            groups = group_shared_pages(*csr, page_len)
        q_index, state_rows, group_merge, host_state_rows = rows, None, None, rows
        if groups is not None:
            csr = PagedCSR(groups.q_indptr, groups.kv_indptr, groups.kv_indices, groups.last_len)
            q_index = rows[groups.state_rows]
            state_rows = torch.tensor(groups.state_rows, dtype=torch.int64, device=device)
            group_merge = StateMerge.build(groups.state_rows, n, device, planner)
            host_state_rows = rows[groups.state_rows]
        num_kernel_rows = int(csr[0][-1]) if groups is not None else n  # on the host here
        csr = csr.map(lambda a: _i32(a, device))
        planned = planner.plan(csr) if planner is not None else None
        cpu_part = None
        if planned is None and torch.device(device).type == "cpu":
            cpu_part = CpuPart(csr, causal=False, logit_cap=logit_cap)
        return cls(
            part.instance_id,
            torch.tensor(rows, dtype=torch.int64, device=device),
            *csr,
            torch.tensor(q_index, dtype=torch.int64, device=device),
            bool(np.array_equal(rows, np.arange(n))),
            state_rows,
            planned,
            logit_cap,
            cpu_part,
            num_kernel_rows,
            group_merge,
            np.asarray(rows, dtype=np.int64),
            np.asarray(host_state_rows, dtype=np.int64),
        )

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])

    def attend(
        self, q: torch.Tensor, pool_layer: torch.Tensor, backend: str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial attention of this part's rows of ``q`` ``[>= num_rows, H_q, D]`` over
        ``pool_layer``. Returns ``o`` ``[num_part_rows, H_q, D]``, ``lse``
        ``[num_part_rows, H_q]`` float32 (natural log)."""
        o, lse = self.kernel_states(q, pool_layer, backend)
        if self.group_merge is None:
            return o, lse
        return self.group_merge.run(o, lse)

    def kernel_states(
        self, q: torch.Tensor, pool_layer: torch.Tensor, backend: str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's own states, unmerged: one per kernel row (``num_kernel_rows``), state
        ``s`` belonging to part row ``state_rows[s]`` (to row ``s`` when ungrouped). Every
        size is the bound one: no value of a tensor is read on the host."""
        # one gather even when the rows are 0..n-1 in order: the same ops for every plan
        q_kernel = q.index_select(0, self.q_index)
        if self.planned is not None:
            return self.planned.run(q_kernel, pool_layer)
        if self.cpu_part is not None and backend in (None, "cpu"):
            return self.cpu_part.run(q_kernel, pool_layer)
        return kernels.partial_attention(
            q_kernel,
            self.q_indptr,
            pool_layer,
            self.kv_indptr,
            self.kv_indices,
            self.last_len,
            causal=False,
            backend=backend,
            logit_cap=self.logit_cap,
        )


def merge_states(
    o: torch.Tensor, lse: torch.Tensor, state_rows: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial states over disjoint key sets by row: state ``s`` (``o`` ``[S, H, D]``,
    ``lse`` ``[S, H]`` float32, natural log) belongs to row ``state_rows[s]`` (int64 ``[S]``).
    Returns ``o`` ``[num_rows, H, D]``, ``lse`` ``[num_rows, H]``; a row without a finite
    state gets ``o = 0``, ``lse = -inf``, like a row that sees no keys. (Reads
    ``state_rows`` on the host; a bound plan lays its merge out once: :class:`StateMerge`.)"""
    return StateMerge.build(state_rows.cpu().numpy(), num_rows, o.device).run(o, lse)


@dataclass(frozen=True)
class MergeLayout:
    """How one bound query's parts become its ``(o, lse)``, built once per bound plan.

    Every part's states go into one merge (:func:`merge_states`), whatever the number of
    parts, requests or shared-page groups: the origin's own part's kernel states (rows
    ``own_rows``) and the holders' results in the origin's output region, gathered by one
    ``index_select`` on the region's flat rows (``remote_index``, rows ``remote_rows``). One
    own part that covers every row in order, ungrouped, is the answer as it is (no merge).
    """

    num_rows: int
    own: BoundPart | None
    own_rows: torch.Tensor | None  # int64 [own states]: the query row of each own state
    remote_index: torch.Tensor | None  # int64 [R]: flat rows of out_o[h, offset + i]
    state_merge: StateMerge  # own states then the R remote ones, by query row
    passthrough: bool

    @classmethod
    def build(
        cls, parts: list[BoundPart], own_id: int, offset: int, region_rows: int, num_rows: int
    ) -> MergeLayout:
        """``parts`` of a query plan bound at ``offset`` of the origin's buffers, whose output
        region holds ``region_rows`` rows per instance (``out_o`` ``[N, region_rows, H, D]``)."""
        own = next((p for p in parts if p.instance_id == own_id), None)
        own_rows = None
        pieces, flat = [], []
        if own is not None:
            own_rows = own.rows if own.state_rows is None else own.rows[own.state_rows]
            pieces.append(own.host_state_rows)
        for p in parts:
            if p.instance_id != own_id:
                base = p.instance_id * region_rows + offset
                flat.append(torch.arange(base, base + p.num_rows, device=p.rows.device))
                pieces.append(p.host_rows)  # a peer returns one merged state per row
        device = parts[0].rows.device if parts else torch.device("cpu")
        remote_index = torch.cat(flat) if flat else None
        state_rows = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        passthrough = (
            len(parts) == 1
            and own is not None
            and own.identity
            and own.state_rows is None
            and own.num_rows == num_rows
        )
        # the own part's FlashInfer (CUDA) merges with merge_states; else torch ops
        planner = getattr(own.planned, "planner", None) if own is not None else None
        merge = StateMerge.build(state_rows, num_rows, device, planner)
        return cls(num_rows, own, own_rows, remote_index, merge, passthrough)

    def attend_own(
        self, q_buf: torch.Tensor, pool_layer: torch.Tensor, backend: str | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The own part's kernel states (``None`` without an own part)."""
        if self.own is None:
            return None
        return self.own.kernel_states(q_buf, pool_layer, backend)

    def merge(
        self,
        own: tuple[torch.Tensor, torch.Tensor] | None,
        out_o: torch.Tensor,
        out_lse: torch.Tensor,
        like: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(o [num_rows, H_q, D], lse [num_rows, H_q])`` float32 from the own states and the
        holders' results in ``out_o`` ``[N, region_rows, H_q, D]`` / ``out_lse``; ``like``
        (the q buffer) gives the shape and device when no part has states."""
        if self.passthrough:
            return own
        o_states, lse_states = [], []
        if own is not None:
            o_states.append(own[0])
            lse_states.append(own[1])
        if self.remote_index is not None:
            h_q, dim = out_o.shape[-2:]
            o_states.append(out_o.reshape(-1, h_q, dim).index_select(0, self.remote_index))
            lse_states.append(out_lse.reshape(-1, h_q).index_select(0, self.remote_index))
        if not o_states:
            o = like.new_zeros((self.num_rows, *like.shape[1:]), dtype=torch.float32)
            return o, like.new_full(like.shape[:2], -torch.inf, dtype=torch.float32)
        o = o_states[0] if len(o_states) == 1 else torch.cat(o_states)
        lse = lse_states[0] if len(lse_states) == 1 else torch.cat(lse_states)
        return self.state_merge.run(o, lse)


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


def check_plan(name: str, plan, kind: type, instance_id: int) -> None:
    """A data-plane call's plan must be of ``kind`` and for this instance."""
    if not isinstance(plan, kind):
        raise InvalidArgumentError(f"{name}: expected a {kind.__name__}, got {type(plan).__name__}")
    if plan.origin != instance_id:
        raise InvalidArgumentError(
            f"{name}: planned for instance {plan.origin}, not this engine ({instance_id})"
        )
