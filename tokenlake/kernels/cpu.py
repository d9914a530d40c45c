"""C++ CPU backend: allocates outputs and calls ``tokenlake._C`` (inputs already validated).

The kernels run on a persistent pool of ``std::thread`` workers (not OpenMP, so they do not
compete with torch's own runtime); :func:`set_num_threads` sizes it, by default to
``std::thread::hardware_concurrency()``. Calls release the GIL.
"""

from __future__ import annotations

import math

import torch

from tokenlake import _C
from tokenlake.errors import InvalidArgumentError

__all__ = ["partial_attention", "merge", "set_num_threads", "get_num_threads"]


def partial_attention(
    q: torch.Tensor,
    q_indptr: torch.Tensor,
    pool_layer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    last_len: torch.Tensor,
    causal: bool = False,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged prefix attention; see :func:`tokenlake.kernels.partial_attention` for shapes.

    Returns ``o`` ``[num_rows, H_q, D]`` float32 and ``lse`` ``[num_rows, H_q]`` float32 (natural
    log), newly allocated.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    o = torch.empty(q.shape, dtype=torch.float32)
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    try:
        _C.partial_attention(
            q.contiguous(),
            q_indptr.contiguous(),
            pool_layer,
            kv_indptr.contiguous(),
            kv_indices.contiguous(),
            last_len.contiguous(),
            o,
            lse,
            bool(causal),
            scale,
        )
    except ValueError as e:  # the core names the argument
        raise InvalidArgumentError(str(e)) from None
    return o, lse


def merge(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial states: ``o_*`` ``[n, H, D]`` float32, ``lse_*`` ``[n, H]`` float32.

    Returns new ``(o, lse)`` tensors; see :func:`tokenlake.kernels.merge`.
    """
    o = torch.empty(o_a.shape, dtype=torch.float32)
    lse = torch.empty(lse_a.shape, dtype=torch.float32)
    try:
        _C.merge(o_a.contiguous(), lse_a.contiguous(), o_b.contiguous(), lse_b.contiguous(), o, lse)
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from None
    return o, lse


def set_num_threads(num_threads: int) -> None:
    """Size the kernels' thread pool (``num_threads >= 1``); takes effect on the next call."""
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise InvalidArgumentError(f"num_threads: expected an int >= 1, got {num_threads!r}")
    _C.set_num_threads(num_threads)


def get_num_threads() -> int:
    """Threads the kernels use (the calling thread counts as one)."""
    return _C.get_num_threads()
