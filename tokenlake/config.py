"""Frozen, validated configuration dataclasses. Derived values are properties, never stored."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenlake.errors import InvalidArgumentError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidArgumentError(f"{owner}.{name}: expected a positive int, got {value!r}")


@dataclass(frozen=True)
class ModelShape:
    """The attention shape of a model, i.e. what one token's KV looks like.

    ``dtype`` is the KV storage dtype name: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _positive(
            "ModelShape",
            num_layers=self.num_layers,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )
        if self.num_q_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"ModelShape.num_q_heads: expected a multiple of num_kv_heads={self.num_kv_heads}, "
                f"got {self.num_q_heads}"
            )
        if not isinstance(self.dtype, str) or self.dtype not in _DTYPES:
            raise InvalidArgumentError(
                f"ModelShape.dtype: expected one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

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


@dataclass(frozen=True)
class PoolConfig:
    """Control-plane configuration of a pool of ``num_instances`` instances.

    Args:
        model: attention shape of the served model.
        num_instances: instances (ranks ``0..num_instances-1``).
        num_slots: slots per instance; one slot holds one segment of all layers.
        segment_len: tokens per segment (``C``).
        namespace: hash namespace (model id, salt); pools with different namespaces never share keys.
    """

    model: ModelShape
    num_instances: int
    num_slots: int
    segment_len: int = 512
    namespace: str = "default"

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelShape):
            raise InvalidArgumentError(
                f"PoolConfig.model: expected a ModelShape, got {type(self.model).__name__}"
            )
        _positive(
            "PoolConfig",
            num_instances=self.num_instances,
            num_slots=self.num_slots,
            segment_len=self.segment_len,
        )
        if not isinstance(self.namespace, str) or not self.namespace:
            raise InvalidArgumentError(
                f"PoolConfig.namespace: expected a non-empty str, got {self.namespace!r}"
            )

    @property
    def segment_bytes(self) -> int:
        """Bytes of one segment over all layers."""
        return self.segment_len * self.model.kv_bytes_per_token

    @property
    def capacity_tokens(self) -> int:
        return self.num_instances * self.num_slots * self.segment_len
