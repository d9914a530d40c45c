"""C++ CPU backend: allocates outputs and calls ``tokenlake._C`` on checked inputs.

The kernels run on a persistent pool of ``std::thread`` workers (not OpenMP, so they do not
compete with torch's own runtime); :func:`set_num_threads` sizes it, by default to
``std::thread::hardware_concurrency()``. Calls release the GIL. The C++ core repeats the index
checks (it trusts no caller), in one pass before it writes anything.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenlake import _C
from tokenlake.engines.kernels.inputs import (
    MergeInputs,
    PagedAttentionInputs,
    PagedCSR,
    call_core,
    core_array,
)
from tokenlake.errors import InvalidArgumentError
from tokenlake.validate import check_int

__all__ = ["CpuPart", "partial_attention", "merge", "set_num_threads", "get_num_threads"]


def partial_attention(args: PagedAttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged prefix attention; see :func:`tokenlake.engines.kernels.partial_attention` for shapes.

    Returns ``o`` ``[num_rows, H_q, D]`` float32 and ``lse`` ``[num_rows, H_q]`` float32 (natural
    log), newly allocated.
    """
    return _run_partial(
        core_array(args.q), core_array(args.pool_layer), args.csr.map(core_array),
        args.causal, args.sm_scale, args.logit_cap,
    )  # fmt: skip


def _run_partial(
    q: np.ndarray, pool: np.ndarray, csr: PagedCSR, causal: bool, scale: float, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate ``o``/``lse`` and run the kernel on arrays it reads directly."""
    o = np.empty(q.shape, dtype=np.float32)
    lse = np.empty(q.shape[:2], dtype=np.float32)
    call_core(
        _C.partial_attention, q, csr.q_indptr, pool, csr.kv_indptr, csr.kv_indices,
        csr.last_len, o, lse, causal, scale, cap,
    )  # fmt: skip
    return torch.from_numpy(o), torch.from_numpy(lse)


class CpuPart:
    """One batch's CSR (int32 tensors as in :func:`tokenlake.engines.kernels.partial_attention`) bound
    once, run every layer (the CPU form of a planned part, like ``FlashInferPart``).

    :meth:`run` checks its arguments in full (:class:`PagedAttentionInputs`) on the first call
    and whenever the geometry of ``q`` or ``pool_layer`` (shape, dtype, device, contiguity)
    differs from the one last checked; otherwise only that geometry is compared, since the CSR
    is this object's own and the C++ kernel repeats its index checks anyway. The CSR is
    converted to the arrays the kernel reads once, at the first check.
    """

    def __init__(
        self,
        csr: PagedCSR,
        causal: bool = False,
        sm_scale: float | None = None,
        logit_cap: float = 0.0,
    ) -> None:
        self._csr = PagedCSR(*csr)
        self._options = (causal, sm_scale, logit_cap)
        self._checked: tuple | None = None  # (geometry, kernel arrays, causal, scale, cap)

    def run(self, q: torch.Tensor, pool_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial attention of ``q`` ``[num_rows, H_q, D]`` over ``pool_layer``; returns new
        ``o`` ``[num_rows, H_q, D]`` and ``lse`` ``[num_rows, H_q]`` float32 (natural log)."""
        geometry = _geometry(q, pool_layer)
        checked = self._checked
        if checked is None or checked[0] != geometry:
            c = self._csr
            args = PagedAttentionInputs(
                q, c.q_indptr, pool_layer, c.kv_indptr, c.kv_indices, c.last_len, *self._options
            )
            if pool_layer.device.type != "cpu":
                raise InvalidArgumentError(
                    f"pool_layer: the CPU kernel needs CPU tensors, got {pool_layer.device}"
                )
            arrays = self._csr.map(core_array)
            # float32, contiguous, no grad: the tensors' own NumPy views are what the kernel reads
            direct = (
                geometry[1] == torch.float32
                and geometry[3]
                and geometry[7]
                and not any((geometry[8], geometry[9]))
            )
            checked = (geometry, arrays, args.causal, args.sm_scale, args.logit_cap, direct)
            self._checked = checked
        _, csr, causal, scale, cap, direct = checked
        q_arr, pool_arr = (
            (q.numpy(), pool_layer.numpy()) if direct else (core_array(q), core_array(pool_layer))
        )
        return _run_partial(q_arr, pool_arr, csr, causal, scale, cap)


def _geometry(q: object, pool_layer: object) -> tuple:
    """What a checked call fixed about ``q`` and ``pool_layer`` (``None`` for a non-tensor)."""
    if not (isinstance(q, torch.Tensor) and isinstance(pool_layer, torch.Tensor)):
        return (None,)
    return (
        q.shape, q.dtype, q.device, q.is_contiguous(),
        pool_layer.shape, pool_layer.dtype, pool_layer.device, pool_layer.is_contiguous(),
        q.requires_grad, pool_layer.requires_grad,
    )  # fmt: skip


def merge(args: MergeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial states (shapes in :class:`~tokenlake.engines.kernels.inputs.MergeInputs`).

    Returns new ``(o, lse)`` tensors; see :func:`tokenlake.engines.kernels.merge`.
    """
    o = torch.empty(args.o_a.shape, dtype=torch.float32)
    lse = torch.empty(args.lse_a.shape, dtype=torch.float32)
    inputs = (args.o_a, args.lse_a, args.o_b, args.lse_b)
    call_core(_C.merge, *(core_array(t) for t in inputs), o.numpy(), lse.numpy())
    return o, lse


def set_num_threads(num_threads: int) -> None:
    """Size the kernels' thread pool (``num_threads >= 1``); takes effect on the next call."""
    _C.set_num_threads(check_int("num_threads", num_threads, low=1))


def get_num_threads() -> int:
    """Threads the kernels use (the calling thread counts as one)."""
    return _C.get_num_threads()
