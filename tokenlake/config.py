"""Frozen, validated configuration dataclasses. Derived values are properties, never stored.

Sizes have upper bounds as well as lower ones: plans carry slot ids, offsets and instance
ids as int32, and byte counts must stay exact in int64, so ``2**63`` slots is bad input, not
a pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenlake.errors import InvalidArgumentError
from tokenlake.validate import check_float, check_int, check_str, fail

if TYPE_CHECKING:
    import torch

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# KV dtypes the attention kernels support, per device: the C++ kernel (and the torch
# reference) on CPU; FlashInfer (16-bit) or the torch reference (float32) on CUDA
KERNEL_DTYPES = {"cpu": ("float32", "bfloat16"), "cuda": ("bfloat16", "float16", "float32")}

MAX_HEADS = 2**14  # per layer, query or KV
MAX_HEAD_DIM = 2**14
MAX_LAYERS = 2**14
MAX_INSTANCES = 2**16
MAX_SLOTS = 2**31 - 1  # slot ids are int32 in plans
MAX_SEGMENT_LEN = 2**20  # token offsets are int32 in plans
MAX_SEGMENT_BYTES = 2**40
# Attention logit soft caps besides 0 (no cap); the C++ kernel checks the same bounds.
LOGIT_CAP_RANGE = (1e-6, 1e6)


def check_logit_cap(name: str, value: object) -> float:
    """An attention logit soft cap: ``0`` (no cap, the default of SGLang's ``logit_cap`` and
    FlashInfer's ``logits_soft_cap``) or a finite number in :data:`LOGIT_CAP_RANGE`; scores
    ``s`` then become ``cap * tanh(s / cap)`` before the softmax. Returns a Python float."""
    allowed = f"0 (no cap) or a finite number in [{LOGIT_CAP_RANGE[0]:g}, {LOGIT_CAP_RANGE[1]:g}]"
    try:
        cap = check_float(name, value, low=0.0, high=LOGIT_CAP_RANGE[1])
    except InvalidArgumentError:
        raise fail(name, allowed, value) from None
    if 0.0 < cap < LOGIT_CAP_RANGE[0]:
        raise fail(name, allowed, value)
    return cap if cap else 0.0  # -0.0 too


def _ints(owner: str, obj: object, bounds: dict[str, int]) -> None:
    """``obj.<name>`` must be an int in ``[1, bound]``; numpy ints become Python ints."""
    for name, bound in bounds.items():
        value = check_int(f"{owner}.{name}", getattr(obj, name), low=1, high=bound + 1)
        object.__setattr__(obj, name, value)


@dataclass(frozen=True)
class ModelShape:
    """The attention shape of a model, i.e. what one token's KV looks like.

    ``dtype`` is the KV storage dtype name: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
    ``logit_cap`` soft-caps the attention scores (:func:`check_logit_cap`; 0: no cap), a
    per-model constant every partial of the pool applies (Gemma-2, Grok).
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    logit_cap: float = 0.0

    def __post_init__(self) -> None:
        _ints(
            "ModelShape",
            self,
            {
                "num_layers": MAX_LAYERS,
                "num_q_heads": MAX_HEADS,
                "num_kv_heads": MAX_HEADS,
                "head_dim": MAX_HEAD_DIM,
            },
        )
        if self.num_q_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"ModelShape.num_q_heads: expected a multiple of num_kv_heads={self.num_kv_heads}, "
                f"got {self.num_q_heads}"
            )
        if type(self.dtype) is not str or self.dtype not in _DTYPE_BYTES:
            raise fail("ModelShape.dtype", f"one of {sorted(_DTYPE_BYTES)}", self.dtype)
        object.__setattr__(
            self, "logit_cap", check_logit_cap("ModelShape.logit_cap", self.logit_cap)
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # the data plane's concern; the control plane never needs torch

        return getattr(torch, self.dtype)

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """Bytes of K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers."""
        return self.num_layers * self.kv_bytes_per_token_layer

    @property
    def q_bytes_per_token_layer(self) -> int:
        return self.num_q_heads * self.head_dim * self.dtype_bytes


# tokens per segment unless a config says otherwise: the pool's, the server's and the SGLang
# backend's one default (a segment is the unit of sharing, placement and eviction)
DEFAULT_SEGMENT_LEN = 64


@dataclass(frozen=True)
class PoolConfig:
    """Control-plane configuration of a pool of ``num_instances`` instances.

    Args:
        model: attention shape of the served model.
        num_instances: instances (ranks ``0..num_instances-1``).
        num_slots: slots per instance; one slot holds one segment of all layers.
        segment_len: tokens per segment (``C``).
        namespace: hash namespace (model id, salt); pools with different namespaces never share keys.
        device: where the instances' KV lives (``"cpu"`` or ``"cuda"``); ``model.dtype`` must
            be one the kernels support there (:data:`KERNEL_DTYPES`).
        num_tier_blocks: blocks of the host tier below the pool, one segment each (``0``: no
            tier; a segment evicted from the pool is forgotten). See
            :mod:`tokenlake.tree.host_tier`.
    """

    model: ModelShape
    num_instances: int
    num_slots: int
    segment_len: int = DEFAULT_SEGMENT_LEN
    namespace: str = "default"
    device: str = "cpu"
    num_tier_blocks: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelShape):
            raise InvalidArgumentError(
                f"PoolConfig.model: expected a ModelShape, got {type(self.model).__name__}"
            )
        _ints(
            "PoolConfig",
            self,
            {
                "num_instances": MAX_INSTANCES,
                "num_slots": MAX_SLOTS,
                "segment_len": MAX_SEGMENT_LEN,
            },
        )
        check_str("PoolConfig.namespace", self.namespace)
        object.__setattr__(
            self,
            "num_tier_blocks",
            check_int(
                "PoolConfig.num_tier_blocks", self.num_tier_blocks, low=0, high=MAX_SLOTS + 1
            ),
        )
        if not isinstance(self.device, str) or self.device not in KERNEL_DTYPES:
            raise InvalidArgumentError(
                f"PoolConfig.device: expected one of {sorted(KERNEL_DTYPES)}, got {self.device!r}"
            )
        if self.model.dtype not in KERNEL_DTYPES[self.device]:
            raise InvalidArgumentError(
                f"PoolConfig.model.dtype: the {self.device} kernels support "
                f"{KERNEL_DTYPES[self.device]}, got {self.model.dtype!r}"
            )
        if self.segment_bytes > MAX_SEGMENT_BYTES:
            raise InvalidArgumentError(
                f"PoolConfig.segment_len: a segment of {self.segment_len} tokens of this model "
                f"takes {self.segment_bytes} bytes; expected at most {MAX_SEGMENT_BYTES}"
            )

    @property
    def segment_bytes(self) -> int:
        """Bytes of one segment over all layers."""
        return self.segment_len * self.model.kv_bytes_per_token

    @property
    def capacity_tokens(self) -> int:
        return self.num_instances * self.num_slots * self.segment_len
