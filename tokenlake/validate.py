"""Argument checks with one error text: ``<name>: expected <what was allowed>, got <value>``.

Every check validates only; callers validate everything first and mutate afterwards. Types
are exact: a ``bool``, a float (``2.0``, ``np.float64``) or a tensor is never an int, and NaN
or infinity is never a number. torch is imported only when a tensor is checked, so the
control plane stays importable without it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from tokenlake.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

INT64_MAX = 2**63 - 1


def describe(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, with its type when that is not obvious."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    if isinstance(value, (int, str)) and type(value) in (int, str):
        return text
    return f"{text} ({type(value).__name__})"


def fail(name: str, allowed: str, value: object) -> InvalidArgumentError:
    """The error for ``name`` holding ``value`` where ``allowed`` was expected (raise it)."""
    return InvalidArgumentError(f"{name}: expected {allowed}, got {describe(value)}")


def is_int(value: object) -> bool:
    """True for Python and numpy integers; False for bools, floats, tensors and the rest."""
    if type(value) is int:
        return True
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _int_range(low: int | None, high: int | None) -> str:
    if low is None and high is None:
        return "an int"
    if high is None:
        return f"an int >= {low}"
    if low is None:
        return f"an int < {high}"
    return f"an int in [{low}, {high})"


def check_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """An integer in ``[low, high)`` (either bound optional), returned as a Python int.

    Numpy integers are accepted; ``bool``, floats (even integral ones), strings and tensors
    are not.
    """
    if not is_int(value):
        raise fail(name, _int_range(low, high), value)
    value = int(value)
    if (low is not None and value < low) or (high is not None and value >= high):
        raise fail(name, _int_range(low, high), value)
    return value


def check_float(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """A finite real number in the interval given (closed unless ``*_open``); ints are
    accepted, bools, NaN, infinities and non-numbers are not. Returns a Python float."""
    lo = "-inf" if low is None else f"{low:g}"
    hi = "inf" if high is None else f"{high:g}"
    allowed = f"a finite number in {'(' if low_open else '['}{lo}, {hi}{')' if high_open else ']'}"
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise fail(name, allowed, value)
    number = float(value)
    if not math.isfinite(number):
        raise fail(name, allowed, value)
    if low is not None and (number < low or (low_open and number == low)):
        raise fail(name, allowed, value)
    if high is not None and (number > high or (high_open and number == high)):
        raise fail(name, allowed, value)
    return number


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise fail(name, "a bool", value)
    return bool(value)


def check_str(name: str, value: object, *, max_len: int = 1024) -> str:
    """A non-empty ``str`` of at most ``max_len`` characters."""
    if type(value) is not str or not 0 < len(value) <= max_len:
        raise fail(name, f"a non-empty str of at most {max_len} characters", value)
    return value


def check_request_id(name: str, value: object) -> int | str:
    """A request id: an int in the int64 range or a non-empty str (at most 1024 characters).

    Numpy integers are not accepted: as dict keys they alias Python ints of equal value, and
    plans carry request ids to other processes where the two must not differ.
    """
    allowed = "an int in [-2**63, 2**63) or a non-empty str of at most 1024 characters"
    if type(value) is int:
        if -INT64_MAX - 1 <= value <= INT64_MAX:
            return value
    elif type(value) is str and 0 < len(value) <= 1024:
        return value
    raise fail(name, allowed, value)


def check_sequence(name: str, value: object, *, min_len: int = 0, length: int | None = None):
    """A list, tuple or range (not a str, array or iterator) of ``length`` or ``>= min_len``
    items."""
    if not isinstance(value, (list, tuple, range)):
        what = f"a list of {length}" if length is not None else "a list"
        raise fail(name, what, value)
    if length is not None and len(value) != length:
        raise InvalidArgumentError(f"{name}: expected {length} entries, got {len(value)}")
    if len(value) < min_len:
        raise InvalidArgumentError(f"{name}: expected at least {min_len} entries, got {len(value)}")
    return value


def canonical_device(device: torch.device | str) -> torch.device:
    """``device`` named as a tensor on it names its own, so that two names of one device
    compare equal (``torch.device("cuda") == torch.device("cuda:0")`` is False): ``cuda``
    becomes ``cuda:N`` of the current CUDA device (``cuda:0`` where CUDA is not available),
    ``cpu:N`` becomes ``cpu`` (CPU tensors carry no index); others stay as they are. Compare
    devices only through it."""
    import torch

    d = torch.device(device)
    if d.type == "cpu":
        return torch.device("cpu")
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return d


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
    import torch  # only tensor checks need it; the control plane does not

    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise InvalidArgumentError(f"{name}: expected a dense tensor, got layout {tensor.layout}")
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
    if device is not None and canonical_device(tensor.device) != canonical_device(device):
        raise InvalidArgumentError(
            f"{name}: expected a tensor on {canonical_device(device)}, got one on {tensor.device}"
        )
    if contiguous and not tensor.is_contiguous():
        raise InvalidArgumentError(f"{name}: expected a contiguous tensor")
    return tensor
