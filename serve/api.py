"""The OpenAI-compatible HTTP API (FastAPI): ``/v1/completions``, ``/v1/chat/completions``
(both with ``stream``), ``/v1/models``, ``/health``, ``/metrics``.

Errors follow vLLM: a JSON body ``{"object": "error", "message", "type", "param", "code"}``;
bad JSON, a bad field or an over-long prompt is a 400 naming what was wrong, an unknown
model a 404. A client that disconnects has its requests cancelled (their pins released).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenlake.engines.model.sampling import SamplingParams
from tokenlake.errors import InvalidArgumentError
from tokenlake.serve import metrics
from tokenlake.serve.api_errors import (
    APIError,
    error_response,
    guarded,
    install_error_handlers,
    sse,
)
from tokenlake.serve.build import Served
from tokenlake.serve.protocol import ChatCompletionRequest, CompletionRequest
from tokenlake.serve.request import GenerationRequest, TokenEvent
from tokenlake.serve.text import TextStream

DISCONNECT_POLL_S = 0.5


@dataclass(eq=False)
class _Choice:
    """One prompt's generation inside an HTTP request."""

    index: int
    request_id: str
    prompt_ids: list[int]
    text: TextStream
    finish_reason: str | None = None
    num_cached: int = 0


def create_app(served: Served) -> FastAPI:
    """The app serving ``served`` (its runtime must be running)."""
    app = FastAPI(title="TokenLake", version="0.1.0")
    runtime, tokenizer, name = served.runtime, served.tokenizer, served.config.model_name
    install_error_handlers(app)

    @app.get("/health")
    async def health():
        if not runtime.alive:
            return error_response(503, "the runtime loop is not running", "ServiceUnavailableError")
        return JSONResponse({})

    @app.get("/v1/models")
    async def models():
        card = {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "tokenlake",
            "root": str(served.model_path),
            "max_model_len": runtime.max_model_len,
        }
        return {"object": "list", "data": [card]}

    registry = metrics.server_registry(runtime, name)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(registry), media_type=metrics.CONTENT_TYPE)

    def check_model(body) -> None:
        if body.model is not None and body.model != name:
            raise APIError(404, f"The model `{body.model}` does not exist.", "NotFoundError")
        if body.n != 1:
            raise APIError(400, f"n: only 1 is supported, got {body.n}")

    def sampling(body) -> SamplingParams:
        return SamplingParams(body.temperature, body.top_p, body.top_k, body.seed)

    def encode(prompt) -> list[int]:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise APIError(400, "prompt: this model has no tokenizer; send token ids")
            return tokenizer.encode(prompt)
        return list(prompt)

    def start(body, prompts: list[list[int]], max_tokens: int | None, prefix: str):
        """Submit one runtime request per prompt; returns the choices and their queue."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def sink(event: TokenEvent) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        base = f"{prefix}-{uuid.uuid4().hex}"
        choices = []
        params = sampling(body)
        for i, ids in enumerate(prompts):
            budget = max_tokens if max_tokens is not None else runtime.max_model_len - len(ids)
            rid = f"{base}-{i}"
            req = GenerationRequest(
                rid, tuple(ids), budget, params, frozenset(body.stop_token_ids or ()),
                body.ignore_eos,
            )  # fmt: skip
            try:
                runtime.submit(req, sink)
            except InvalidArgumentError:
                for c in choices:
                    runtime.cancel(c.request_id)
                raise
            choices.append(_Choice(i, rid, ids, TextStream(tokenizer, body.stop_strings)))
        return base, choices, queue

    async def events(choices, queue, request: Request) -> AsyncIterator[tuple[_Choice, str]]:
        """``(choice, text delta)`` as tokens arrive, until every choice finished; cancels
        whatever is unfinished if the client goes away or the caller stops early."""
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
                delta = c.text.add(event.token_id, final=event.finish_reason is not None)
                if event.finish_reason is not None:
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

    def usage(choices) -> dict:
        prompt = sum(len(c.prompt_ids) for c in choices)
        completion = sum(len(c.text.token_ids) for c in choices)
        cached = sum(c.num_cached for c in choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        if body.logprobs is not None:
            raise APIError(400, "logprobs: not supported")
        raw = body.prompt
        batch = raw if isinstance(raw, list) and raw and isinstance(raw[0], (str, list)) else [raw]
        prompts = [encode(p) for p in batch]
        base, choices, queue = start(body, prompts, body.max_tokens, "cmpl")
        created = int(time.time())

        def choice_body(c: _Choice, text: str, reason) -> dict:
            out = {"index": c.index, "text": text, "logprobs": None, "finish_reason": reason}
            if body.return_token_ids:
                out["prompt_token_ids"] = c.prompt_ids
                out["token_ids"] = list(c.text.token_ids)
            return out

        if body.stream:

            async def stream():
                async for c, delta in events(choices, queue, request):
                    reason = c.finish_reason
                    choice = {
                        "index": c.index,
                        "text": delta,
                        "logprobs": None,
                        "finish_reason": reason,
                    }
                    if body.return_token_ids and c.text.token_ids:
                        choice["token_ids"] = c.text.token_ids[-1:]
                    yield sse({"id": base, "object": "text_completion", "created": created,
                                "model": name, "choices": [choice]})  # fmt: skip
                if body.stream_options and body.stream_options.include_usage:
                    yield sse({"id": base, "object": "text_completion", "created": created,
                                "model": name, "choices": [], "usage": usage(choices)})  # fmt: skip
                yield "data: [DONE]\n\n"

            return StreamingResponse(guarded(stream()), media_type="text/event-stream")
        async for _ in events(choices, queue, request):
            pass
        echo = [tokenizer.decode(c.prompt_ids) if body.echo and tokenizer else "" for c in choices]
        return {
            "id": base,
            "object": "text_completion",
            "created": created,
            "model": name,
            "choices": [
                choice_body(c, e + c.text.text, c.finish_reason)
                for c, e in zip(choices, echo, strict=True)
            ],
            "usage": usage(choices),
        }

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body)
        if body.logprobs:
            raise APIError(400, "logprobs: not supported")
        if tokenizer is None:
            raise APIError(400, "messages: this model has no tokenizer; use /v1/completions")
        text = tokenizer.render_chat(
            [m.as_dict() for m in body.messages], body.add_generation_prompt
        )
        # the template writes the special tokens itself (as transformers' apply_chat_template)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        max_tokens = body.max_completion_tokens or body.max_tokens
        base, choices, queue = start(body, [prompt], max_tokens, "chatcmpl")
        created = int(time.time())
        c = choices[0]
        if body.stream:

            async def stream():
                head = {
                    "id": base,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": name,
                }
                first = {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "finish_reason": None,
                }
                yield sse({**head, "choices": [first]})
                async for _, delta in events(choices, queue, request):
                    reason = c.finish_reason
                    content = {"content": delta} if delta or reason is None else {}
                    yield sse(
                        {
                            **head,
                            "choices": [{"index": 0, "delta": content, "finish_reason": reason}],
                        }
                    )
                if body.stream_options and body.stream_options.include_usage:
                    yield sse({**head, "choices": [], "usage": usage(choices)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(guarded(stream()), media_type="text/event-stream")
        async for _ in events(choices, queue, request):
            pass
        message = {"role": "assistant", "content": c.text.text}
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": c.finish_reason,
        }
        if body.return_token_ids:
            choice["prompt_token_ids"] = c.prompt_ids
            choice["token_ids"] = list(c.text.token_ids)
        return {
            "id": base,
            "object": "chat.completion",
            "created": created,
            "model": name,
            "choices": [choice],
            "usage": usage(choices),
        }

    return app
