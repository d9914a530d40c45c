"""The API's endpoints, one module-level handler each on an :class:`APIRouter`; what they
share (runtime, tokenizer, model name, metrics) arrives as the :data:`State` dependency."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenlake.serve import metrics
from tokenlake.serve.api_errors import APIError, error_response, guarded, sse
from tokenlake.serve.api_generation import (
    Choice,
    check_body,
    decode,
    encode,
    encode_chat,
    events,
    start,
    usage,
)
from tokenlake.serve.api_state import State
from tokenlake.serve.protocol import ChatCompletionRequest, CompletionRequest

router = APIRouter()


@router.get("/health")
async def health(state: State):
    if not state.runtime.alive:
        return error_response(503, "the runtime loop is not running", "ServiceUnavailableError")
    return JSONResponse({})


@router.get("/v1/models")
async def models(state: State):
    card = {
        "id": state.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "tokenlake",
        "root": str(state.model_path),
        "max_model_len": state.runtime.max_model_len,
    }
    return {"object": "list", "data": [card]}


@router.get("/metrics")
async def prometheus(state: State):
    return Response(metrics.render(state.registry), media_type=metrics.CONTENT_TYPE)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: State):
    check_body(state, body)
    if body.logprobs is not None:
        raise APIError(400, "logprobs: not supported")
    raw = body.prompt
    batch = raw if isinstance(raw, list) and raw and isinstance(raw[0], str | list) else [raw]
    prompts = [await encode(state, p) for p in batch]
    base, choices, queue = start(state, body, prompts, body.max_tokens, "cmpl")
    head = {"id": base, "object": "text_completion", "created": int(time.time()),
            "model": state.model_name}  # fmt: skip
    if body.stream:
        return StreamingResponse(
            guarded(_completion_chunks(state, body, request, head, choices, queue)),
            media_type="text/event-stream",
        )
    async for _ in events(state, choices, queue, request):
        pass
    out = []
    for c in choices:
        echo = await decode(state, c.prompt_ids) if body.echo else ""
        choice = {"index": c.index, "text": echo + c.text.text, "logprobs": None,
                  "finish_reason": c.finish_reason}  # fmt: skip
        if body.return_token_ids:
            choice["prompt_token_ids"] = c.prompt_ids
            choice["token_ids"] = list(c.text.token_ids)
        out.append(choice)
    return {**head, "choices": out, "usage": usage(choices)}


async def _completion_chunks(state, body: CompletionRequest, request, head, choices, queue):
    async for c, delta in events(state, choices, queue, request):
        choice = {"index": c.index, "text": delta, "logprobs": None,
                  "finish_reason": c.finish_reason}  # fmt: skip
        if body.return_token_ids and c.text.token_ids:
            choice["token_ids"] = c.text.token_ids[-1:]
        yield sse({**head, "choices": [choice]})
    if body.stream_options and body.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": usage(choices)})
    yield "data: [DONE]\n\n"


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State):
    check_body(state, body)
    if body.logprobs:
        raise APIError(400, "logprobs: not supported")
    prompt = await encode_chat(state, body)
    max_tokens = body.max_completion_tokens or body.max_tokens
    base, choices, queue = start(state, body, [prompt], max_tokens, "chatcmpl")
    head = {"id": base, "object": "chat.completion", "created": int(time.time()),
            "model": state.model_name}  # fmt: skip
    if body.stream:
        head["object"] = "chat.completion.chunk"
        return StreamingResponse(
            guarded(_chat_chunks(state, body, request, head, choices, queue)),
            media_type="text/event-stream",
        )
    async for _ in events(state, choices, queue, request):
        pass
    c = choices[0]
    message = {"role": "assistant", "content": c.text.text}
    choice = {"index": 0, "message": message, "logprobs": None,
              "finish_reason": c.finish_reason}  # fmt: skip
    if body.return_token_ids:
        choice["prompt_token_ids"] = c.prompt_ids
        choice["token_ids"] = list(c.text.token_ids)
    return {**head, "choices": [choice], "usage": usage(choices)}


async def _chat_chunks(state, body: ChatCompletionRequest, request, head, choices, queue):
    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    yield sse({**head, "choices": [first]})
    c: Choice = choices[0]
    async for _, delta in events(state, choices, queue, request):
        reason = c.finish_reason
        content = {"content": delta} if delta or reason is None else {}
        yield sse({**head, "choices": [{"index": 0, "delta": content, "finish_reason": reason}]})
    if body.stream_options and body.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": usage(choices)})
    yield "data: [DONE]\n\n"
