"""What flows through the runtime: a generation request in, token events out."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenlake.engines.model.sampling import SamplingParams
from tokenlake.errors import InvalidArgumentError

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class GenerationRequest:
    """Generate up to ``max_tokens`` after ``prompt_ids``; stop early at an end-of-sequence
    token (unless ``ignore_eos``) or at any of ``stop_token_ids``. ``grammar``: an
    ``xgrammar.CompiledGrammar`` the output must match (it stops when the grammar is
    complete), or ``None``."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    grammar: object | None = None

    def check(self, max_model_len: int, vocab_size: int) -> None:
        """Raise ``InvalidArgumentError`` for an empty or over-long prompt, a token id
        outside the vocabulary, a bad ``max_tokens``, or sampling the geometry rules out."""
        n = len(self.prompt_ids)
        if n == 0:
            raise InvalidArgumentError("prompt: expected at least one token")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidArgumentError(f"max_tokens: expected an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens: expected >= 1, got {self.max_tokens}")
        if n + self.max_tokens > max_model_len:
            raise InvalidArgumentError(
                f"prompt: this model's maximum context length is {max_model_len} tokens; "
                f"the request has {n} prompt tokens and max_tokens={self.max_tokens} "
                f"({n + self.max_tokens} in total)"
            )
        bad = [t for t in self.prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgumentError(
                f"prompt: token ids must be in [0, {vocab_size}), got {bad[:3]}"
            )
        self._check_sampling(vocab_size)

    def _check_sampling(self, vocab_size: int) -> None:
        """Raise ``InvalidArgumentError`` for what only the model's geometry rules out: a
        token outside the vocabulary (a ``stop_token_ids`` one too: it could never stop the
        request), ``min_tokens`` over ``max_tokens``."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", [t for t, _ in self.sampling.logit_bias]),
            ("allowed_token_ids", self.sampling.allowed_token_ids or ()),
            ("bad_words", [t for w in self.sampling.bad_words_token_ids for t in w]),
        ):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidArgumentError(
                    f"{name}: token ids must be in [0, {vocab_size}), got {bad[:3]}"
                )
        if self.sampling.min_tokens > self.max_tokens:
            raise InvalidArgumentError(
                f"min_tokens: expected at most max_tokens={self.max_tokens}, "
                f"got {self.sampling.min_tokens}"
            )

    def end_token_ids(self, eos_token_ids: frozenset[int]) -> frozenset[int]:
        """The tokens that end this request (masked until ``min_tokens``)."""
        if self.ignore_eos:
            return self.stop_token_ids
        return self.stop_token_ids | eos_token_ids

    def stop_reason(self, token_id: int, eos_token_ids: frozenset[int]) -> int | None:
        """vLLM's ``stop_reason`` for a request that stopped at ``token_id``: the stop
        token id, or ``None`` for an end-of-sequence token."""
        if not self.ignore_eos and token_id in eos_token_ids:
            return None
        return token_id if token_id in self.stop_token_ids else None


@dataclass(frozen=True)
class TokenEvent:
    """One generated token (``token_id``), or the end of a request (``finish_reason`` set;
    ``token_id`` is the last token, or ``None`` when it ended without one).
    ``num_cached_tokens``: prompt tokens the pool already held (on the first event).
    ``logprob`` / ``top_logprobs``: the token's raw log-probability and the most likely
    ``(token_id, logprob)`` pairs, when the request asked for them. ``stop_reason``: the
    stop token id that ended it (``None`` for EOS, length, or no end yet)."""

    request_id: str
    token_id: int | None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    stop_reason: int | None = None
