"""Running one HTTP request's prompts through the runtime: checks of the body, tokenization
(on a worker thread, so a large prompt never blocks the event loop), submission, and the
stream of text deltas as tokens arrive (detokenized on a worker thread too)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from tokenlake.engines.model.sampling import SamplingParams
from tokenlake.errors import InvalidArgumentError
from tokenlake.serve.api_errors import APIError, shown
from tokenlake.serve.api_state import APIState
from tokenlake.serve.protocol import ChatCompletionRequest, CompletionRequest
from tokenlake.serve.request import GenerationRequest, TokenEvent
from tokenlake.serve.text import TextStream

DISCONNECT_POLL_S = 0.5

Body = CompletionRequest | ChatCompletionRequest


@dataclass(eq=False)
class Choice:
    """One prompt's generation inside an HTTP request."""

    index: int
    request_id: str
    prompt_ids: list[int]
    text: TextStream
    finish_reason: str | None = None
    num_cached: int = 0


def check_body(state: APIState, body: Body) -> None:
    """What the runtime cannot serve: another model's name, ``n`` > 1."""
    if body.model is not None and body.model != state.model_name:
        raise APIError(404, f"The model `{shown(body.model)}` does not exist.", "NotFoundError")
    if body.n != 1:
        raise APIError(400, f"n: only 1 is supported, got {body.n}")


async def encode(state: APIState, prompt: str | list[int]) -> list[int]:
    """The token ids of one prompt (text is tokenized on a worker thread)."""
    if not isinstance(prompt, str):
        return list(prompt)
    if state.tokenizer is None:
        raise APIError(400, "prompt: this model has no tokenizer; send token ids")
    return await run_in_threadpool(state.tokenizer.encode, prompt)


async def encode_chat(state: APIState, body: ChatCompletionRequest) -> list[int]:
    """The chat's prompt ids: the template rendered and tokenized on a worker thread."""
    tokenizer = state.tokenizer
    if tokenizer is None:
        raise APIError(400, "messages: this model has no tokenizer; use /v1/completions")
    messages = [m.as_dict() for m in body.messages]

    def render_and_encode() -> list[int]:
        text = tokenizer.render_chat(messages, body.add_generation_prompt)
        # the template writes the special tokens itself (as transformers' apply_chat_template)
        return tokenizer.encode(text, add_special_tokens=False)

    return await run_in_threadpool(render_and_encode)


async def decode(state: APIState, ids: list[int]) -> str:
    if state.tokenizer is None:
        return ""
    return await run_in_threadpool(state.tokenizer.decode, ids)


def start(
    state: APIState, body: Body, prompts: list[list[int]], max_tokens: int | None, prefix: str
) -> tuple[str, list[Choice], asyncio.Queue[TokenEvent]]:
    """Submit one runtime request per prompt; returns the id, the choices and their queue.
    Nothing stays submitted when one prompt is refused."""
    runtime = state.runtime
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

    def sink(event: TokenEvent) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, event)

    base = f"{prefix}-{uuid.uuid4().hex}"
    choices: list[Choice] = []
    params = SamplingParams(body.temperature, body.top_p, body.top_k, body.seed)
    for i, ids in enumerate(prompts):
        budget = max_tokens if max_tokens is not None else runtime.max_model_len - len(ids)
        rid = f"{base}-{i}"
        req = GenerationRequest(
            rid, tuple(ids), budget, params, frozenset(body.stop_token_ids or ()),
            body.ignore_eos,
        )  # fmt: skip
        try:
            runtime.submit(req, sink)
        except (InvalidArgumentError, RuntimeError) as e:
            for c in choices:
                runtime.cancel(c.request_id)
            if isinstance(e, InvalidArgumentError):
                raise
            raise APIError(503, str(e), "ServiceUnavailableError") from None
        choices.append(Choice(i, rid, ids, TextStream(state.tokenizer, body.stop_strings)))
    return base, choices, queue


async def events(
    state: APIState, choices: list[Choice], queue: asyncio.Queue[TokenEvent], request: Request
) -> AsyncIterator[tuple[Choice, str]]:
    """``(choice, text delta)`` as tokens arrive, until every choice finished; cancels
    whatever is unfinished if the client goes away or the caller stops early."""
    runtime = state.runtime
    by_id = {c.request_id: c for c in choices}
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_POLL_S
    try:
        while any(c.finish_reason is None for c in choices):
            try:
                event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if loop.time() >= next_check:  # tokens may never pause: check on a clock
                next_check = loop.time() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    return
            if event is None:
                continue
            c = by_id[event.request_id]
            if c.finish_reason is not None:
                continue
            c.num_cached = event.num_cached_tokens
            final = event.finish_reason is not None
            if state.tokenizer is None:
                delta = c.text.add(event.token_id, final=final)
            else:  # detokenizing re-decodes the output so far: off the event loop
                delta = await run_in_threadpool(c.text.add, event.token_id, final)
            if final:
                c.finish_reason = event.finish_reason
            elif c.text.stopped:
                c.finish_reason = "stop"
                runtime.cancel(c.request_id)
            if event.finish_reason == "error":
                raise APIError(500, event.error or "generation failed", "InternalServerError")
            yield c, delta
    finally:
        for c in choices:
            if c.finish_reason is None:
                runtime.cancel(c.request_id)


def usage(choices: list[Choice]) -> dict:
    prompt = sum(len(c.prompt_ids) for c in choices)
    completion = sum(len(c.text.token_ids) for c in choices)
    cached = sum(c.num_cached for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
