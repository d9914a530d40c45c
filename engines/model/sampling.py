"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenlake.errors import InvalidArgumentError

# Below this temperature sampling is greedy, as in vLLM: the distribution is one-hot up to
# rounding anyway, and dividing by a temperature near float32's smallest value overflows.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI/vLLM conventions: ``temperature`` 0 (or below 1e-5) is greedy; ``top_k`` 0 or
    -1 means all."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, p, k = self.temperature, self.top_p, self.top_k
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 100:
            raise InvalidArgumentError(f"temperature: expected a number in [0, 100], got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise InvalidArgumentError(f"top_p: expected a number in (0, 1], got {p!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < -1:
            raise InvalidArgumentError(f"top_k: expected an int >= -1, got {k!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int)):
            raise InvalidArgumentError(f"seed: expected an int, got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from ``logits`` ``[vocab]``. Raises ``ValueError`` for logits that are
    not all finite when sampling (greedy takes the argmax of whatever it gets)."""
    if params.greedy:
        return int(torch.argmax(logits))
    # float64 with the maximum subtracted: the largest score is exactly 0, so softmax has a
    # denominator >= 1 and no inf / NaN for any temperature accepted above
    scores = logits.detach().to(torch.float64)
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("sample: logits contain inf or NaN")
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
