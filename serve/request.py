"""What flows through the runtime: a generation request in, token events out."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenlake.engines.model.sampling import SamplingParams

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class GenerationRequest:
    """Generate up to ``max_tokens`` after ``prompt_ids``; stop early at an end-of-sequence
    token (unless ``ignore_eos``) or at any of ``stop_token_ids``."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False


@dataclass(frozen=True)
class TokenEvent:
    """One generated token (``token_id``), or the end of a request (``finish_reason`` set;
    ``token_id`` is the last token, or ``None`` when it ended without one).
    ``num_cached_tokens``: prompt tokens the pool already held (on the first event)."""

    request_id: str
    token_id: int | None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
