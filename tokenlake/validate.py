"""One helper that checks tensors and produces uniform error text (FlashInfer style)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenlake.errors import InvalidArgumentError


def check_tensor(
    name: str,
    tensor: object,
    *,
    shape: Sequence[int | None] | None = None,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    device: torch.device | str | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Validate ``tensor`` and return it; raise :class:`InvalidArgumentError` naming ``name``.

    ``shape`` entries that are ``None`` match any size. ``dtype`` may be one dtype or several.
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if shape is not None:
        ok = tensor.dim() == len(shape) and all(
            want is None or got == want for got, want in zip(tensor.shape, shape, strict=True)
        )
        if not ok:
            pretty = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise InvalidArgumentError(f"{name}: expected shape {pretty}, got {list(tensor.shape)}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if tensor.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise InvalidArgumentError(f"{name}: expected dtype {want}, got {tensor.dtype}")
    if device is not None and tensor.device != torch.device(device):
        raise InvalidArgumentError(
            f"{name}: expected a tensor on {torch.device(device)}, got one on {tensor.device}"
        )
    if contiguous and not tensor.is_contiguous():
        raise InvalidArgumentError(f"{name}: expected a contiguous tensor")
    return tensor


def check_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """Validate an integer in ``[low, high)``; bools are rejected."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name}: expected an int, got {type(value).__name__}")
    if low is not None and value < low:
        raise InvalidArgumentError(f"{name}: expected >= {low}, got {value}")
    if high is not None and value >= high:
        raise InvalidArgumentError(f"{name}: expected < {high}, got {value}")
    return value
