"""Deterministic chained segment keys: ``key_i = xxh64(key_{i-1} ‖ tokens_i)`` in a namespace.

Never Python's ``hash()`` (it differs per process). A key hit is always confirmed by comparing
token ids, so a collision can cost a miss but never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from tokenlake.errors import InvalidArgumentError
from tokenlake.validate import check_int, check_str

TOKEN_DTYPE = np.int32


def as_tokens(token_ids: Sequence[int] | np.ndarray, name: str = "token_ids") -> np.ndarray:
    """Return ``token_ids`` as a read-only 1-D int32 array.

    A read-only int32 array is returned as is; anything else is validated (integers in
    ``[0, 2**31)``) and copied, so later writes to the caller's buffer cannot change it.
    """
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == TOKEN_DTYPE:
        if not token_ids.flags.writeable and token_ids.ndim == 1:
            return token_ids
        arr = np.array(token_ids, copy=True)
    elif isinstance(token_ids, np.ndarray):
        arr = token_ids
    elif isinstance(token_ids, (list, tuple, range)):
        if not isinstance(token_ids, range) and any(type(t) is bool for t in token_ids):
            raise InvalidArgumentError(f"{name}: expected integer token ids, got a bool among them")
        try:
            arr = np.asarray(token_ids)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidArgumentError(f"{name}: expected a sequence of ints ({exc})") from None
        if arr.size == 0:
            arr = arr.astype(TOKEN_DTYPE)
    else:
        raise InvalidArgumentError(
            f"{name}: expected a list or 1-D numpy array of token ids, got {type(token_ids).__name__}"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgumentError(f"{name}: expected integer token ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(TOKEN_DTYPE).max):
        raise InvalidArgumentError(
            f"{name}: expected token ids in [0, 2**31), got ids from {arr.min()} to {arr.max()}"
        )
    arr = arr.astype(TOKEN_DTYPE, copy=arr.dtype != TOKEN_DTYPE)
    arr.flags.writeable = False
    return arr


class SegmentHasher:
    """Chained xxh64 keys seeded by a namespace.

    ``key_bits`` < 64 truncates keys; it exists so tests can force collisions.
    """

    def __init__(self, namespace: str, key_bits: int = 64) -> None:
        check_str("namespace", namespace)
        key_bits = check_int("key_bits", key_bits, low=1, high=65)
        self.seed = xxhash.xxh64_intdigest(namespace.encode())
        self._mask = (1 << key_bits) - 1
        self.root_key = xxhash.xxh64_intdigest(b"tokenlake/root", seed=self.seed) & self._mask

    def key(self, parent_key: int, tokens: np.ndarray) -> int:
        """Key of the segment holding ``tokens`` (int32) whose prefix has key ``parent_key``."""
        data = parent_key.to_bytes(8, "little") + tokens.astype("<i4", copy=False).tobytes()
        return xxhash.xxh64_intdigest(data, seed=self.seed) & self._mask

    def chain(
        self, tokens: np.ndarray, segment_len: int, parent_key: int | None = None
    ) -> list[int]:
        """Keys of every full segment of ``tokens`` (a trailing partial segment gets none)."""
        key = self.root_key if parent_key is None else parent_key
        keys = []
        for start in range(0, len(tokens) - segment_len + 1, segment_len):
            key = self.key(key, tokens[start : start + segment_len])
            keys.append(key)
        return keys
