"""Exception types raised by TokenLake.

Expected misses are values (a short prefix match, ``None``); these are raised for programmer
and user errors and for conditions the caller must handle (a full pool, a stale plan).
"""

from __future__ import annotations


class TokenLakeError(Exception):
    """Base class of every error TokenLake raises on purpose."""


class InvalidArgumentError(TokenLakeError, ValueError):
    """An argument has the wrong value, shape, dtype or device; the message names it."""


class StalePlanError(TokenLakeError):
    """A plan (or a buffer bound to one) from an iteration that is no longer active was used."""


class UnknownRequestError(TokenLakeError, KeyError):
    """A request id the pool does not know (never admitted, or already finished)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class PoolFullError(TokenLakeError):
    """Not enough free or evictable slots for an iteration; nothing was changed."""


class IterationStateError(TokenLakeError):
    """An operation that needs no iteration in flight was called while one is (or vice versa)."""
