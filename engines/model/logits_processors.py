"""What vLLM's sampler does to one request's logits before temperature / min-p / top-k /
top-p, in vLLM V1's order: every token outside ``allowed_token_ids`` masked, then the last
token of each bad word whose other tokens end the output, the end tokens masked until
``min_tokens`` (``MinTokensLogitsProcessor``), ``logit_bias`` added, then the penalties: repetition over prompt + output (divide a positive
logit by it, multiply a negative one), frequency (times each token's count in the output)
and presence (once per token in the output) subtracted.

Log-probabilities handed to clients are those of the raw logits (a log-softmax before any
of the above), as vLLM V1 returns them by default (``logprobs_mode="raw_logprobs"``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tokenlake.engines.model.sampling import SamplingParams

Sampler = Callable[[torch.Tensor, SamplingParams, torch.Generator | None], int]
LOGPROB_FLOOR = -9999.0  # vLLM's stand-in for -inf: JSON has no infinity


@dataclass(frozen=True)
class Pick:
    """The chosen token and, when asked for, its raw log-probability and the
    ``params.logprobs`` most likely tokens as ``((token_id, logprob), ...)``."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    end_ids: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """``logits`` ``[vocab]`` after min_tokens, logit_bias and the penalties (a float32
    copy; ``logits`` itself unchanged when nothing applies). ``end_ids``: the tokens that
    would end the request (EOS unless ignored, stop token ids)."""
    if not params.processes_logits:
        return logits
    scores = logits.detach().to(torch.float32).clone()
    vocab = scores.numel()
    if params.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[torch.tensor([t for t in params.allowed_token_ids if t < vocab], dtype=torch.long)] = (
            True
        )
        scores = scores.masked_fill(~keep, float("-inf"))
    for word in params.bad_words_token_ids:
        *head, last = word
        if last < vocab and (not head or tuple(output_ids[-len(head) :]) == tuple(head)):
            scores[last] = float("-inf")
    if len(output_ids) < params.min_tokens and end_ids:
        masked = torch.tensor(sorted(t for t in end_ids if t < vocab), dtype=torch.long)
        scores[masked] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        scores[ids] += torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
    out = torch.tensor(list(output_ids), dtype=torch.long)
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(list(prompt_ids), dtype=torch.long)] = True
        seen[out] = True
        # in float64, capped at float32's largest: any penalty > 0 is accepted, and one near
        # 0 would overflow a positive logit to inf in float32 (and turn -inf * 0 into NaN)
        wide, penalty = scores.to(torch.float64), params.repetition_penalty
        penalized = torch.where(wide > 0, wide / penalty, wide * penalty)
        penalized = penalized.clamp(max=torch.finfo(torch.float32).max).to(torch.float32)
        scores = torch.where(seen, penalized, scores)
    if params.frequency_penalty or params.presence_penalty:
        counts = torch.bincount(out, minlength=vocab).to(torch.float32)
        scores -= params.frequency_penalty * counts
        scores -= params.presence_penalty * (counts > 0).to(torch.float32)
    return scores


def raw_logprobs(
    logits: torch.Tensor, token_id: int, num_top: int
) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of ``token_id`` under ``logits`` and the ``num_top`` most likely
    tokens, each at least :data:`LOGPROB_FLOOR`."""
    logprobs = torch.log_softmax(logits.detach().to(torch.float32), dim=-1)
    chosen = max(float(logprobs[token_id]), LOGPROB_FLOOR)
    if num_top == 0:
        return chosen, ()
    values, ids = torch.topk(logprobs, min(num_top, logprobs.numel()))
    top = tuple((int(i), max(float(v), LOGPROB_FLOOR)) for v, i in zip(values, ids, strict=True))
    return chosen, top


def pick(
    sampler: Sampler,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    end_ids: frozenset[int] = frozenset(),
) -> Pick:
    """Process ``logits``, let ``sampler`` choose, attach the raw log-probabilities."""
    processed = process_logits(logits, params, prompt_ids, output_ids, end_ids)
    token_id = sampler(processed, params, generator)
    if params.logprobs is None:
        return Pick(token_id)
    return Pick(token_id, *raw_logprobs(logits, token_id, params.logprobs))
