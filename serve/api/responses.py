"""What a response carries besides the text: the ``n`` best of ``best_of``, ``usage``
(also per chunk with ``continuous_usage_stats``), the end of a stream, and vLLM's
``prompt_logprobs`` (a dense forward of the prompt on a worker thread)."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from tokenlake.engines.model.prompt_logprobs import prompt_logprobs as compute_prompt_logprobs
from tokenlake.serve.api.errors import sse
from tokenlake.serve.api.generation import Body, Choice, num_samples
from tokenlake.serve.api.logprobs import prompt_logprobs_json
from tokenlake.serve.api.state import APIState


def best(choices: list[Choice], n: int) -> list[Choice]:
    """Per prompt, the ``n`` generations of highest cumulative log-probability (ties in
    generation order), renumbered ``prompt_index * n + rank``."""
    chosen = []
    for i in sorted({c.prompt_index for c in choices}):
        group = [c for c in choices if c.prompt_index == i]
        group.sort(key=lambda c: (-c.cumulative_logprob, c.sample))
        for rank, c in enumerate(group[:n]):
            c.index = i * n + rank
            chosen.append(c)
    return chosen


def usage(choices: list[Choice]) -> dict:
    """Token counts of a request: each prompt once, every generation (``best_of`` too)."""
    prompt = sum(len(c.prompt_ids) for c in choices if c.sample == 0)
    completion = sum(len(c.text.token_ids) for c in choices)
    cached = sum(c.num_cached for c in choices if c.sample == 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def prompt_positions(state: APIState, ids: list[int], num_top: int) -> list:
    """Each prompt position's logprobs (a dense forward of the prompt on a worker thread)."""
    model = state.runtime.engine.model
    return await run_in_threadpool(compute_prompt_logprobs, model, ids, num_top)


async def prompt_logprobs(state: APIState, body: Body, ids: list[int]) -> list | None:
    """vLLM's ``prompt_logprobs`` of one prompt when the request asks for them, else
    ``None``."""
    if body.prompt_logprobs is None:
        return None
    positions = await prompt_positions(state, ids, body.prompt_logprobs)
    as_ids = bool(body.return_tokens_as_token_ids)
    return await run_in_threadpool(prompt_logprobs_json, state.tokenizer, positions, as_ids)


def returned(body: Body, choices: list[Choice]) -> list[Choice]:
    """The choices a response carries: all of them, or the ``n`` best of ``best_of``."""
    return best(choices, body.n) if num_samples(body) > body.n else choices


def stream_usage(body: Body, choices: list[Choice]) -> dict:
    """``{"usage": ...}`` so far for every chunk when the request asked for
    ``stream_options.continuous_usage_stats`` (with ``include_usage``, as vLLM), else ``{}``."""
    options = body.stream_options
    if options is None or not options.include_usage or not options.continuous_usage_stats:
        return {}
    return {"usage": usage(choices)}


def final_chunks(body: Body, head: dict, choices: list[Choice]) -> list[str]:
    """The end of a stream: the usage chunk when ``stream_options.include_usage``, then
    ``[DONE]``."""
    chunks = []
    if body.stream_options is not None and body.stream_options.include_usage:
        chunks.append(sse({**head, "choices": [], "usage": usage(choices)}))
    return [*chunks, "data: [DONE]\n\n"]
