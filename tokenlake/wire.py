"""A versioned msgpack codec for frozen dataclasses: plans on their way to compute
processes, control messages between engines. Never pickle.

Wire form of an object: ``{"v": version, "t": class name, "f": {field: value}}``; nested
dataclasses of the same codec are encoded the same way (without ``"v"``). Numpy arrays
travel as msgpack extension types holding raw little-endian bytes (int32, int64, float32).
Decoding is a whitelist: only the codec's classes, only their declared fields (a field
added to a class is accepted automatically, an unknown one is not), every value checked
against the field's annotation (``bool`` is not an ``int``), arrays 1-D of the declared
kind. Anything else raises :class:`WireError` naming the field, its value and what was
allowed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence

import msgpack
import numpy as np

from tokenlake.errors import InvalidArgumentError

_EXT_DTYPES = {1: np.dtype("<i4"), 2: np.dtype("<i8"), 3: np.dtype("<f4")}
_EXT_CODES = {dt.kind + str(dt.itemsize): code for code, dt in _EXT_DTYPES.items()}


class WireError(InvalidArgumentError):
    """Bytes that are not a valid encoding of one of the codec's classes."""


def _default(value: object) -> object:
    if isinstance(value, np.ndarray):
        code = _EXT_CODES.get(value.dtype.kind + str(value.dtype.itemsize))
        if code is None or value.ndim != 1:
            raise WireError(f"array: cannot send {value.dtype} {list(value.shape)}")
        return msgpack.ExtType(code, value.astype(_EXT_DTYPES[code], copy=False).tobytes())
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    raise WireError(f"value: cannot encode a {type(value).__name__}")


def _ext_hook(code: int, data: bytes) -> object:
    dtype = _EXT_DTYPES.get(code)
    if dtype is None or len(data) % dtype.itemsize:
        raise WireError(f"array: unknown extension type {code} or ragged length {len(data)}")
    return np.frombuffer(data, dtype=dtype)  # read-only, like every plan array


def packb(value: object) -> bytes:
    """Plain values (ints, floats, str, bytes, lists, str-keyed maps, 1-D arrays) as bytes."""
    return msgpack.packb(value, default=_default, use_bin_type=True)


def unpackb(data: bytes, max_bytes: int) -> object:
    """The inverse of :func:`packb`; :class:`WireError` on anything else."""
    if not isinstance(data, bytes | bytearray | memoryview) or len(data) > max_bytes:
        raise WireError(f"payload: expected at most {max_bytes} bytes")
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=True)
    except WireError:
        raise
    except Exception as e:
        raise WireError(f"payload: not valid msgpack ({type(e).__name__})") from None


class Codec:
    """Encodes and decodes instances of ``classes`` under protocol ``version``."""

    def __init__(self, name: str, version: int, classes: Sequence[type], max_bytes: int) -> None:
        self.name, self.version, self.max_bytes = name, version, max_bytes
        self._classes = {cls.__name__: cls for cls in classes}
        self._hints = {cls: typing.get_type_hints(cls) for cls in classes}
        self._fields = {cls: {f.name: f for f in dataclasses.fields(cls)} for cls in classes}

    def encode(self, obj: object) -> bytes:
        payload = self._pack(obj)
        payload["v"] = self.version
        return msgpack.packb(payload, default=_default, use_bin_type=True)

    def _pack(self, obj: object) -> dict:
        cls = type(obj)
        if self._classes.get(cls.__name__) is not cls:
            raise WireError(f"{self.name}: {cls.__name__} is not a {self.name} type")
        return {
            "t": cls.__name__,
            "f": {k: self._value(getattr(obj, k)) for k in self._fields[cls]},
        }

    def _value(self, value: object) -> object:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return self._pack(value)
        if isinstance(value, list | tuple):
            return [self._value(v) for v in value]
        return value

    def decode(self, data: object) -> object:
        """The object encoded in ``data``; :class:`WireError` if it is not one."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise WireError(f"{self.name}: expected bytes, got {type(data).__name__}")
        if len(data) > self.max_bytes:
            raise WireError(f"{self.name}: {len(data)} bytes, at most {self.max_bytes} allowed")
        try:
            payload = msgpack.unpackb(
                data, ext_hook=_ext_hook, raw=False, strict_map_key=True, use_list=True
            )
        except WireError:
            raise
        except Exception as e:
            raise WireError(f"{self.name}: not valid msgpack ({type(e).__name__})") from None
        if not isinstance(payload, dict) or payload.get("v") != self.version:
            got = payload.get("v") if isinstance(payload, dict) else type(payload).__name__
            raise WireError(f"{self.name}: expected version {self.version}, got {got!r}")
        return self._build(payload, self.name)

    def _build(self, payload: object, where: str) -> object:
        if not isinstance(payload, dict) or not isinstance(payload.get("t"), str):
            raise WireError(f"{where}: expected an encoded object, got {_show(payload)}")
        cls = self._classes.get(payload["t"])
        fields = payload.get("f")
        if cls is None:
            raise WireError(
                f"{where}: unknown type {payload['t']!r}; allowed {sorted(self._classes)}"
            )
        if not isinstance(fields, dict):
            raise WireError(f"{where}.{cls.__name__}: expected a field map")
        known = self._fields[cls]
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise WireError(f"{cls.__name__}: unknown fields {unknown[:4]}")
        kwargs = {}
        for name, f in known.items():
            if name not in fields:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise WireError(f"{cls.__name__}.{name}: missing")
                continue
            kwargs[name] = self._check(
                fields[name], self._hints[cls][name], f"{cls.__name__}.{name}"
            )
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise WireError(f"{cls.__name__}: {e}") from None

    def _check(self, value: object, hint: object, where: str) -> object:
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin in (typing.Union, types.UnionType):
            for option in args:
                try:
                    return self._check(value, option, where)
                except WireError:
                    continue
            raise WireError(f"{where}: expected {hint}, got {_show(value)}")
        if hint is type(None):
            if value is None:
                return None
        elif hint is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif hint is float:
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
        elif hint in (str, bool, bytes):
            if type(value) is hint:
                return value
        elif hint is np.ndarray:
            if isinstance(value, np.ndarray):
                return value
        elif hint is tuple or origin is tuple:
            if isinstance(value, list):
                if not args or args[-1] is Ellipsis:
                    item = args[0] if args else int | str
                    return tuple(self._check(v, item, f"{where}[{i}]") for i, v in enumerate(value))
                if len(value) == len(args):
                    return tuple(
                        self._check(v, a, f"{where}[{i}]")
                        for i, (v, a) in enumerate(zip(value, args, strict=True))
                    )
        elif origin is dict:
            if isinstance(value, dict):
                k_hint, v_hint = args or (str, int)
                return {
                    self._check(k, k_hint, where): self._check(v, v_hint, f"{where}[{k!r}]")
                    for k, v in value.items()
                }
        elif isinstance(hint, type) and hint in self._hints:
            return self._build(value, where)
        raise WireError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {_show(value)}")


def _show(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
