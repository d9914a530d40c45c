"""The kernels' boundary: the checked inputs of each kernel call, one class per kernel.

Constructing one checks everything before any kernel work: tensor types, shapes, dtypes,
devices (``cpu`` or ``cuda``, all on one) and contiguity where a kernel needs it; CSR offsets
that start at 0, never decrease and cover exactly the rows and pages given; slot ids within the
pool; ``last_len`` within the page size where a request has pages; a ``causal`` that is a bool
(not an int or a tensor); an ``sm_scale`` that is a finite number in the normal float32 range;
a ``logit_cap`` that is 0 (no cap) or a finite number in
:data:`~tokenlake.config.LOGIT_CAP_RANGE`; LSE values that are finite or ``-inf``. A failed check raises :class:`~tokenlake.errors.InvalidArgumentError`
naming the argument, its value and what was allowed. Index arrays are checked in one C++ pass
(the checks the C++ kernel itself runs; on a host copy for CUDA tensors). The values of ``q``,
the KV pool and ``o`` are not inspected: that would cost as much as the kernel.

Every backend takes these objects, so no backend sees unchecked input.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from tokenlake import _C
from tokenlake.config import check_logit_cap
from tokenlake.errors import InvalidArgumentError
from tokenlake.validate import check_bool, check_float, check_tensor

__all__ = [
    "PagedAttentionInputs",
    "MergeInputs",
    "SelfAttentionInputs",
    "check_dense",
    "call_core",
    "core_array",
]

KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEVICE_TYPES = ("cpu", "cuda")
# float16 runs on CUDA only (FlashInfer and torch there); the CPU kernels take these
CPU_DTYPES = (torch.float32, torch.bfloat16)
# Kernels scale scores in float32, so a scale must be a normal float32.
SCALE_RANGE = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)


class PagedCSR(NamedTuple):
    """One paged batch, the four arrays every paged kernel reads: request ``b``'s query rows
    are ``q_indptr[b]:q_indptr[b + 1]``, its pages ``kv_indices[kv_indptr[b]:kv_indptr[b +
    1]]``, the last of them ``last_len[b]`` tokens full. int32 ``[B + 1]``, ``[B + 1]``,
    ``[P]``, ``[B]`` (tensors, or the arrays the C++ kernel reads)."""

    q_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_len: torch.Tensor

    def map(self, fn: Callable) -> PagedCSR:
        """The same batch with ``fn`` applied to each array (a device move, a conversion)."""
        return PagedCSR(*(fn(a) for a in self))


@dataclass(frozen=True)
class PagedAttentionInputs:
    """The arguments of one :func:`tokenlake.engines.kernels.partial_attention` call (shapes there),
    checked on construction; ``sm_scale=None`` becomes ``1 / sqrt(D)``, ``logit_cap`` a float
    (0: no soft cap)."""

    q: torch.Tensor
    q_indptr: torch.Tensor
    pool_layer: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_len: torch.Tensor
    causal: bool = False
    sm_scale: float | None = None
    logit_cap: float = 0.0

    @property
    def csr(self) -> PagedCSR:
        return PagedCSR(self.q_indptr, self.kv_indptr, self.kv_indices, self.last_len)

    def __post_init__(self) -> None:
        object.__setattr__(self, "causal", check_bool("causal", self.causal))
        object.__setattr__(self, "logit_cap", check_logit_cap("logit_cap", self.logit_cap))
        pool = check_tensor(
            "pool_layer",
            self.pool_layer,
            shape=(None, 2, None, None, None),
            dtype=KV_DTYPES,
            contiguous=True,
        )
        _check_device_type("pool_layer", pool)
        num_slots, _, page_len, num_kv_heads, head_dim = pool.shape
        if min(page_len, num_kv_heads, head_dim) < 1:
            raise InvalidArgumentError(
                "pool_layer: expected C, H_kv and D >= 1 in [num_slots, 2, C, H_kv, D], got "
                f"{list(pool.shape)}"
            )
        object.__setattr__(self, "sm_scale", _check_scale(self.sm_scale, head_dim))
        q = check_tensor(
            "q", self.q, shape=(None, None, head_dim), dtype=pool.dtype, device=pool.device
        )
        _check_heads(q.shape[1], num_kv_heads)
        batch_size = _check_indptr_shape("q_indptr", self.q_indptr, None, pool.device)
        _check_indptr_shape("kv_indptr", self.kv_indptr, batch_size, pool.device)
        i32 = dict(dtype=torch.int32, device=pool.device)
        check_tensor("kv_indices", self.kv_indices, shape=(None,), **i32)
        check_tensor("last_len", self.last_len, shape=(batch_size,), **i32)
        call_core(
            _C.check_paged_indices,
            core_array(self.q_indptr),
            core_array(self.kv_indptr),
            core_array(self.kv_indices),
            core_array(self.last_len),
            q.shape[0],
            num_slots,
            page_len,
        )


@dataclass(frozen=True)
class MergeInputs:
    """Two partial states over disjoint key sets, as :func:`tokenlake.engines.kernels.merge` takes
    them: ``o_*`` ``[n, H, D]`` float32 and ``lse_*`` ``[n, H]`` float32, natural log, finite
    or ``-inf``; checked on construction."""

    o_a: torch.Tensor
    lse_a: torch.Tensor
    o_b: torch.Tensor
    lse_b: torch.Tensor

    def __post_init__(self) -> None:
        o_a = check_tensor("o_a", self.o_a, shape=(None, None, None), dtype=torch.float32)
        _check_device_type("o_a", o_a)
        n, h, d = o_a.shape
        same = dict(dtype=torch.float32, device=o_a.device)
        check_tensor("lse_a", self.lse_a, shape=(n, h), **same)
        check_tensor("o_b", self.o_b, shape=(n, h, d), **same)
        check_tensor("lse_b", self.lse_b, shape=(n, h), **same)
        _check_lse("lse_a", self.lse_a)
        _check_lse("lse_b", self.lse_b)


@dataclass(frozen=True)
class SelfAttentionInputs:
    """The arguments of one :func:`tokenlake.engines.kernels.self_attention` call (shapes there),
    checked on construction; ``kv_indptr=None`` becomes ``indptr``, ``sm_scale=None``
    becomes ``1 / sqrt(D)`` and ``logit_cap`` a float (0: no soft cap)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    indptr: torch.Tensor
    kv_indptr: torch.Tensor | None = None
    sm_scale: float | None = None
    logit_cap: float = 0.0

    def __post_init__(self) -> None:
        q, k, _ = check_dense(self.q, self.k, self.v)
        object.__setattr__(self, "sm_scale", _check_scale(self.sm_scale, q.shape[2]))
        object.__setattr__(self, "logit_cap", check_logit_cap("logit_cap", self.logit_cap))
        batch_size = _check_indptr_shape("indptr", self.indptr, None, q.device)
        call_core(_C.check_indptr, "indptr", core_array(self.indptr), q.shape[0], "the rows of q")
        if self.kv_indptr is None:
            if k.shape[0] != q.shape[0]:
                raise InvalidArgumentError(
                    f"k: expected {q.shape[0]} rows (those of q) when kv_indptr is not given, "
                    f"got {k.shape[0]}"
                )
            object.__setattr__(self, "kv_indptr", self.indptr)
            return
        _check_indptr_shape("kv_indptr", self.kv_indptr, batch_size, q.device)
        call_core(
            _C.check_indptr, "kv_indptr", core_array(self.kv_indptr), k.shape[0], "the rows of k"
        )


def check_dense(q: object, k: object, v: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check dense attention operands: ``q`` ``[n, H_q, D]``, ``k`` and ``v`` ``[kv_len, H_kv,
    D]`` with ``H_q`` a positive multiple of ``H_kv``, one float32 or bfloat16 dtype and one
    device. Returns them."""
    q = check_tensor("q", q, shape=(None, None, None), dtype=KV_DTYPES)
    _check_device_type("q", q)
    head_dim = q.shape[2]
    if head_dim < 1:
        raise InvalidArgumentError(f"q: expected D >= 1 in [n, H_q, D], got {list(q.shape)}")
    same = dict(dtype=q.dtype, device=q.device)
    k = check_tensor("k", k, shape=(None, None, head_dim), **same)
    if k.shape[1] < 1:
        raise InvalidArgumentError(
            f"k: expected H_kv >= 1 in [kv_len, H_kv, D], got {list(k.shape)}"
        )
    _check_heads(q.shape[1], k.shape[1])
    v = check_tensor("v", v, shape=tuple(k.shape), **same)
    return q, k, v


def _check_scale(sm_scale: object, head_dim: int) -> float:
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    return check_float("sm_scale", sm_scale, low=SCALE_RANGE[0], high=SCALE_RANGE[1])


def _check_device_type(name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type not in DEVICE_TYPES:
        raise InvalidArgumentError(
            f"{name}: expected a tensor on {' or '.join(DEVICE_TYPES)}, got one on {tensor.device}"
        )
    check_dtype_on(name, tensor.dtype, tensor.device)


def check_dtype_on(name: str, dtype: torch.dtype, device: torch.device) -> None:
    """float16 only on CUDA: the CPU kernels take float32 and bfloat16."""
    if device.type == "cpu" and dtype not in CPU_DTYPES:
        raise InvalidArgumentError(
            f"{name}: expected float32 or bfloat16 on the CPU (float16 runs on CUDA), got {dtype}"
        )


def _check_heads(num_q_heads: int, num_kv_heads: int) -> None:
    if num_q_heads < 1 or num_q_heads % num_kv_heads != 0:
        raise InvalidArgumentError(
            f"q: expected H_q to be a positive multiple of H_kv={num_kv_heads}, got "
            f"H_q={num_q_heads}"
        )


def _check_indptr_shape(
    name: str, indptr: object, batch_size: int | None, device: torch.device
) -> int:
    """An int32 ``[batch_size + 1]`` tensor (any size >= 1 when ``batch_size`` is None);
    returns its batch size."""
    size = None if batch_size is None else batch_size + 1
    indptr = check_tensor(name, indptr, shape=(size,), dtype=torch.int32, device=device)
    if indptr.shape[0] == 0:
        raise InvalidArgumentError(f"{name}: expected shape [batch_size + 1], got [0]")
    return indptr.shape[0] - 1


def _check_lse(name: str, lse: torch.Tensor) -> None:
    # One reduction: max propagates NaN, and catches +inf.
    if lse.numel() == 0 or float(lse.max()) < math.inf:
        return
    bad = (lse.isnan() | lse.isposinf()).nonzero()[0].tolist()
    raise InvalidArgumentError(
        f"{name}: expected values in [-inf, inf), got {float(lse[tuple(bad)])} at {bad}"
    )


def core_array(tensor: torch.Tensor) -> torch.Tensor | np.ndarray:
    """What the C++ core reads: the tensor's values as a C-contiguous host array, without a copy
    when the tensor already is one; a NumPy view where NumPy has the dtype (it crosses the
    binding several times faster than a tensor's DLPack capsule), else the tensor (bfloat16)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    tensor = tensor.contiguous().cpu()
    return tensor if tensor.dtype == torch.bfloat16 else tensor.numpy()


def call_core(check: Callable[..., None], *args: object) -> None:
    """Call a function of the C++ core; its ``ValueError`` (whose message names the argument,
    its value and what was allowed) becomes :class:`InvalidArgumentError`."""
    try:
        check(*args)
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from None
