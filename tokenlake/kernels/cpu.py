"""C++ CPU backend: allocates outputs and calls ``tokenlake._C`` on checked inputs.

The kernels run on a persistent pool of ``std::thread`` workers (not OpenMP, so they do not
compete with torch's own runtime); :func:`set_num_threads` sizes it, by default to
``std::thread::hardware_concurrency()``. Calls release the GIL. The C++ core repeats the index
checks (it trusts no caller), in one pass before it writes anything.
"""

from __future__ import annotations

import torch

from tokenlake import _C
from tokenlake.kernels.inputs import MergeInputs, PagedAttentionInputs, call_core, core_array
from tokenlake.validate import check_int

__all__ = ["partial_attention", "merge", "set_num_threads", "get_num_threads"]


def partial_attention(args: PagedAttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged prefix attention; see :func:`tokenlake.kernels.partial_attention` for shapes.

    Returns ``o`` ``[num_rows, H_q, D]`` float32 and ``lse`` ``[num_rows, H_q]`` float32 (natural
    log), newly allocated.
    """
    q = args.q
    o = torch.empty(q.shape, dtype=torch.float32)
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    call_core(
        _C.partial_attention,
        core_array(q),
        core_array(args.q_indptr),
        core_array(args.pool_layer),
        core_array(args.kv_indptr),
        core_array(args.kv_indices),
        core_array(args.last_len),
        o.numpy(),
        lse.numpy(),
        args.causal,
        args.sm_scale,
        args.logit_cap,
    )
    return o, lse


def merge(args: MergeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial states (shapes in :class:`~tokenlake.kernels.inputs.MergeInputs`).

    Returns new ``(o, lse)`` tensors; see :func:`tokenlake.kernels.merge`.
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
