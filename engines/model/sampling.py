"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling.
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
    log-probability and that many of the most likely ones."""

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
    # float64 with the maximum subtracted: the largest score is exactly 0, so softmax has a
    # denominator >= 1 and no inf / NaN for any temperature accepted above
    scores = logits.detach().to(torch.float64)
    if bool(torch.isnan(scores).any()) or bool(torch.isposinf(scores).any()):
        raise ValueError("sample: logits contain inf or NaN")
    if not bool(torch.isfinite(scores).any()):
        raise ValueError("sample: every token is masked (-inf)")
    scores = (scores - scores.max()) / float(params.temperature)
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
    return int(torch.multinomial(probs, 1, generator=generator))
