"""Choosing the next token from logits: greedy, or temperature / min-p / top-k / top-p sampling.
What vLLM's sampler does before that (min_tokens, logit_bias, penalties) is in
``logits_processors``; :class:`SamplingParams` carries both."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokenlake.errors import InvalidArgumentError

# Below this temperature sampling is greedy, as in vLLM: the distribution is one-hot up to
# rounding anyway, and dividing by a temperature near float32's smallest value overflows.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs, OpenAI's top_logprobs limit
MAX_PENALTY = 2.0  # presence / frequency, as OpenAI and vLLM bound them
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI/vLLM conventions: ``temperature`` 0 (or below 1e-5) is greedy; ``top_k`` 0 or
    -1 means all. ``presence_penalty`` / ``frequency_penalty`` in [-2, 2] act on the output
    so far, ``repetition_penalty`` (> 0, 1 = none) on prompt and output; ``logit_bias`` is
    ``((token_id, bias), ...)`` with bias in [-100, 100]; the end tokens are masked until
    ``min_tokens`` tokens were generated; ``logprobs`` (0..20) asks for the chosen token's
    log-probability and that many of the most likely ones. ``min_p`` in [0, 1] drops the
    tokens less likely than ``min_p`` times the most likely one (after temperature);
    ``allowed_token_ids`` (if not ``None``) are the only tokens that may be sampled;
    ``bad_words_token_ids`` are token sequences never generated (a sequence's last token is
    masked whenever the output so far ends with the rest of it), as vLLM's."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    min_p: float = 0.0
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature, 0, 100)
        _check_number("top_p", self.top_p, 0, 1, low_open=True)
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < -1:
            raise InvalidArgumentError(f"top_k: expected an int >= -1, got {k!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int)):
            raise InvalidArgumentError(f"seed: expected an int, got {s!r}")
        _check_number("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_number("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_number(
            "repetition_penalty", self.repetition_penalty, 0, MAX_REPETITION_PENALTY, True
        )
        if not isinstance(self.logit_bias, tuple):
            raise InvalidArgumentError(
                f"logit_bias: expected ((token_id, bias), ...), got {type(self.logit_bias)}"
            )
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise InvalidArgumentError(f"logit_bias: expected (token_id, bias), got {pair!r}")
            _check_int("logit_bias token id", pair[0], 0, None)
            _check_number(f"logit_bias[{pair[0]}]", pair[1], -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidArgumentError("logit_bias: a token id appears twice")
        _check_int("min_tokens", self.min_tokens, 0, None)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _check_number("min_p", self.min_p, 0, 1)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, tuple) or not self.allowed_token_ids:
                raise InvalidArgumentError(
                    f"allowed_token_ids: expected a non-empty tuple, got {self.allowed_token_ids!r}"
                )
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, 0, None)
        for word in self.bad_words_token_ids:
            if not isinstance(word, tuple) or not word:
                raise InvalidArgumentError(f"bad_words: expected token id tuples, got {word!r}")
            for t in word:
                _check_int("bad_words token id", t, 0, None)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the logits before temperature / top-k / top-p."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.allowed_token_ids is not None
            or self.bad_words_token_ids
        )


def _check_number(name: str, value: object, low: float, high: float, low_open=False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok:
        ok = (low < value if low_open else low <= value) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise InvalidArgumentError(
            f"{name}: expected a number in {bracket}{low:g}, {high:g}], got {value!r}"
        )


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name}: expected an int, got {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidArgumentError(f"{name}: expected an int {allowed}, got {value}")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from ``logits`` ``[vocab]``. Raises ``ValueError`` for logits that are
    not all finite when sampling (greedy takes the argmax of whatever it gets); ``-inf``
    entries (tokens masked by ``logit_bias`` or ``min_tokens``) are allowed."""
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, params), 1, generator=generator))


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution :func:`sample` draws from (float64): temperature, then min-p,
    top-k and top-p, in vLLM's order."""
    # float64 with the maximum subtracted: the largest score is exactly 0, so softmax has a
    # denominator >= 1 and no inf / NaN for any temperature accepted above
    scores = logits.detach().to(torch.float64)
    if bool(torch.isnan(scores).any()) or bool(torch.isposinf(scores).any()):
        raise ValueError("sample: logits contain inf or NaN")
    if not bool(torch.isfinite(scores).any()):
        raise ValueError("sample: every token is masked (-inf)")
    scores = (scores - scores.max()) / float(params.temperature)
    if params.min_p > 0:
        # the largest score is 0: a token's probability over the top one's is exp(score)
        scores = scores.masked_fill(scores < math.log(params.min_p), float("-inf"))
    if params.top_k > 0:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < params.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
    return probs
