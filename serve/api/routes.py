"""The API's endpoints, one module-level handler each on an :class:`APIRouter`; what they
share (runtime, tokenizer, model name, metrics) arrives as the :data:`State` dependency."""

from __future__ import annotations

import importlib.metadata
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from tokenlake.serve.api.errors import APIError, error_response, guarded, sse
from tokenlake.serve.api.fields import truncated
from tokenlake.serve.api.generation import (
    check_body,
    check_model,
    decode,
    encode,
    encode_chat,
    events,
    prepare,
    prompts_of,
    start,
)
from tokenlake.serve.api.limits import check_text
from tokenlake.serve.api.logprobs import completion_logprobs, echoed_prompt_entries, token_text
from tokenlake.serve.api.protocol import CompletionRequest, DetokenizeRequest, TokenizeRequest
from tokenlake.serve.api.responses import (
    final_chunks,
    prompt_logprobs,
    prompt_positions,
    returned,
    stream_usage,
    usage,
)
from tokenlake.serve.api.state import State
from tokenlake.serve.metrics import collector as metrics

router = APIRouter()


@router.get("/health")
async def health(state: State):
    if not state.runtime.alive:
        return error_response(503, "the runtime loop is not running", "ServiceUnavailableError")
    return JSONResponse({})


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(state: State):
    """vLLM's alias of ``/health`` (GET and POST, for SageMaker-style probes)."""
    return await health(state)


@router.get("/version")
async def version():
    return {"version": _package_version()}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: State):
    """vLLM's shape: ``{"count", "max_model_len", "tokens", "token_strs"}``; each token
    string is that token's own decoded text."""
    check_text(body, state.max_text_chars)
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "prompt: send exactly one of prompt and messages", param="prompt")
    if body.prompt is not None:
        ids = await encode(state, body.prompt, body.add_special_tokens is not False)
    elif body.add_special_tokens:
        raise APIError(400, "add_special_tokens: the chat template writes the special "
                       "tokens; true is not implemented with messages",
                       param="add_special_tokens")  # fmt: skip
    else:
        ids = await encode_chat(state, body)
    strs = None
    if body.return_token_strs:
        strs = await run_in_threadpool(lambda: [token_text(state.tokenizer, t) for t in ids])
    # a Response skips FastAPI's per-item encoding, seconds for a million ids on the loop
    return JSONResponse({"count": len(ids), "max_model_len": state.runtime.max_model_len,
                         "tokens": ids, "token_strs": strs})  # fmt: skip


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: State):
    check_text(body, state.max_text_chars)
    check_model(state, body.model)
    vocab = state.runtime.engine.model.config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"tokens: token ids must be in [0, {vocab}), got {bad[:3]}",
                       param="tokens")  # fmt: skip
    if state.tokenizer is None:
        raise APIError(400, "tokens: this model has no tokenizer", param="tokens")
    # special tokens are kept, as vLLM's /detokenize keeps them
    return {"prompt": await decode(state, body.tokens, skip_special_tokens=False)}


def _package_version() -> str:
    try:
        return importlib.metadata.version("tokenlake")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


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
    max_len = state.runtime.max_model_len
    prompts = [truncated(await encode(state, p, body.add_special_tokens), body, max_len)
               for p in prompts_of(body)]  # fmt: skip
    prepared = await prepare(state, body)
    base, choices, queue = start(state, body, prompts, body.max_tokens, "cmpl", prepared)
    head = {"id": base, "object": "text_completion", "created": int(time.time()),
            "model": state.model_name}  # fmt: skip
    if body.stream:
        return StreamingResponse(
            guarded(_completion_chunks(state, body, request, head, choices, queue)),
            media_type="text/event-stream",
        )
    async for _ in events(state, choices, queue, request):
        pass
    prompt_lps = [await prompt_logprobs(state, body, ids) for ids in prompts]
    out = []
    for c in returned(body, choices):
        echo = await decode(state, c.prompt_ids) if body.echo else ""
        choice = {"index": c.index, "text": echo + c.text.text, "logprobs": None,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}  # fmt: skip
        if body.logprobs is not None:
            entries = c.logprobs
            if body.echo:  # the prompt's tokens first, as vLLM (prompt_logprobs = logprobs)
                positions = await prompt_positions(state, c.prompt_ids, body.logprobs)
                entries = echoed_prompt_entries(c.prompt_ids, positions) + entries
            choice["logprobs"] = await run_in_threadpool(
                completion_logprobs, state.tokenizer, entries, 0,
                bool(body.return_tokens_as_token_ids),
            )  # fmt: skip
        if body.return_token_ids:
            choice["prompt_token_ids"] = c.prompt_ids
            choice["token_ids"] = list(c.text.token_ids)
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_lps[c.prompt_index]
        out.append(choice)
    return {**head, "choices": out, "usage": usage(choices)}


async def _completion_chunks(state, body: CompletionRequest, request, head, choices, queue):
    if body.echo:  # the prompt first, as its own chunk per choice
        for c in choices:
            text = await decode(state, c.prompt_ids)
            choice = {"index": c.index, "text": text, "logprobs": None, "finish_reason": None,
                      "stop_reason": None}  # fmt: skip
            yield sse({**head, "choices": [choice], **stream_usage(body, choices)})
    text_offsets = dict.fromkeys(range(len(choices)), 0)
    async for c, delta in events(state, choices, queue, request):
        choice = {"index": c.index, "text": delta, "logprobs": None,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}  # fmt: skip
        if body.logprobs is not None:
            new, c.num_sent = c.logprobs[c.num_sent :], len(c.logprobs)
            logprobs = await run_in_threadpool(
                completion_logprobs, state.tokenizer, new, text_offsets[c.index],
                bool(body.return_tokens_as_token_ids),
            )  # fmt: skip
            text_offsets[c.index] += sum(len(t) for t in logprobs["tokens"])
            choice["logprobs"] = logprobs
        if body.return_token_ids:
            # every id not sent yet: events that arrived together are detokenized together,
            # so a choice's later ids may already be in its text when its first delta is sent
            new_ids, c.num_ids_sent = c.text.token_ids[c.num_ids_sent :], len(c.text.token_ids)
            if new_ids:
                choice["token_ids"] = list(new_ids)
        yield sse({**head, "choices": [choice], **stream_usage(body, choices)})
    for chunk in final_chunks(body, head, choices):
        yield chunk
