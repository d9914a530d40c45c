"""``/v1/chat/completions``, as vLLM answers it: the response's role (``assistant``, or
the last message's role without a generation prompt), ``echo`` (the last message's
content first when it has that role), and tool calls: ``tool_choice`` ``auto`` read from
the text by the server's ``--tool-call-parser``, ``required`` and a named function
generated under a grammar (so they always parse); ``finish_reason`` ``tool_calls`` when
auto or required called a tool. Streams send OpenAI's deltas: the role, content, then
``tool_calls`` items."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from tokenlake.serve.api.errors import guarded, sse
from tokenlake.serve.api.fields import tool_choice
from tokenlake.serve.api.generation import Choice, check_body, encode_chat, events, prepare, start
from tokenlake.serve.api.logprobs import chat_logprobs
from tokenlake.serve.api.protocol import ChatCompletionRequest
from tokenlake.serve.api.responses import (
    final_chunks,
    prompt_logprobs,
    returned,
    stream_usage,
    usage,
)
from tokenlake.serve.api.state import APIState, State
from tokenlake.serve.api.tools.parsers import ToolCall, ToolCallStream, extract, make_parser
from tokenlake.serve.api.tools.structured import forced_calls, named_tool

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State):
    check_body(state, body)
    prompt = await encode_chat(state, body)
    prepared = await prepare(state, body)
    max_tokens = body.max_completion_tokens or body.max_tokens
    base, choices, queue = start(state, body, [prompt], max_tokens, "chatcmpl", prepared)
    head = {"id": base, "object": "chat.completion", "created": int(time.time()),
            "model": state.model_name}  # fmt: skip
    if body.stream:
        head["object"] = "chat.completion.chunk"
        return StreamingResponse(
            guarded(_chunks(state, body, request, head, choices, queue)),
            media_type="text/event-stream",
        )
    async for _ in events(state, choices, queue, request):
        pass
    out = []
    for c in returned(body, choices):
        content, calls = _content_and_calls(state, body, c.text.text)
        if body.echo:
            content = _echo(body) + (content or "")
        message = {"role": _role(body), "content": content,
                   "tool_calls": [t.as_dict() for t in calls]}  # fmt: skip
        choice = {"index": c.index, "message": message, "logprobs": None,
                  "finish_reason": _finish_reason(body, c, calls),
                  "stop_reason": c.stop_reason}  # fmt: skip
        if body.logprobs:
            choice["logprobs"] = await run_in_threadpool(
                chat_logprobs, state.tokenizer, c.logprobs, bool(body.return_tokens_as_token_ids)
            )
        if body.return_token_ids:
            choice["prompt_token_ids"] = c.prompt_ids
            choice["token_ids"] = list(c.text.token_ids)
        out.append(choice)
    extra = {}
    if body.prompt_logprobs is not None:  # vLLM answers them beside the choices in chat
        extra["prompt_logprobs"] = await prompt_logprobs(state, body, prompt)
    return {**head, "choices": out, "usage": usage(choices), **extra}


def _role(body: ChatCompletionRequest) -> str:
    """vLLM's response role: the assistant's, or the last message's when the prompt ends
    without a generation prompt (the model continues that message)."""
    return "assistant" if body.add_generation_prompt else body.messages[-1].role


def _echo(body: ChatCompletionRequest) -> str:
    last = body.messages[-1]
    return last.text if last.role == _role(body) else ""


def _content_and_calls(
    state: APIState, body: ChatCompletionRequest, text: str
) -> tuple[str | None, list[ToolCall]]:
    mode = tool_choice(body)
    if mode == "none":
        return text, []
    if mode == "auto":
        content, calls = extract(make_parser(state.tool_parser), text)
    else:  # required or a named function: generated under their grammar
        calls = forced_calls(body, text)
        content = None if calls else text
    if body.parallel_tool_calls is False:
        calls = calls[:1]
    return content, calls


def _finish_reason(body: ChatCompletionRequest, c: Choice, calls: list[ToolCall]) -> str | None:
    if calls and c.finish_reason == "stop" and named_tool(body) is None:
        return "tool_calls"
    return c.finish_reason


async def _chunks(state: APIState, body: ChatCompletionRequest, request, head, choices, queue):
    role = _role(body)
    mode = tool_choice(body)
    tool_streams = {}
    for c in choices:
        first = {"index": c.index, "delta": {"role": role, "content": ""},
                 "logprobs": None, "finish_reason": None}  # fmt: skip
        yield sse({**head, "choices": [first], **stream_usage(body, choices)})
        if body.echo and _echo(body):
            echoed = {"index": c.index, "delta": {"content": _echo(body)}, "logprobs": None,
                      "finish_reason": None}  # fmt: skip
            yield sse({**head, "choices": [echoed], **stream_usage(body, choices)})
        if mode == "auto":
            tool_streams[c.index] = ToolCallStream(make_parser(state.tool_parser))
    called: dict[int, int] = {}  # tool calls sent per choice
    async for c, delta in events(state, choices, queue, request):
        final = c.finish_reason is not None
        deltas = _deltas(body, mode, tool_streams.get(c.index), c, delta, called)
        logprobs = None
        if body.logprobs:
            new, c.num_sent = c.logprobs[c.num_sent :], len(c.logprobs)
            logprobs = await run_in_threadpool(
                chat_logprobs, state.tokenizer, new, bool(body.return_tokens_as_token_ids)
            )
        if not deltas and logprobs is not None and logprobs["content"]:
            deltas = [{}]  # the token's logprobs go out even while its text is held back
        reason = c.finish_reason
        if final:
            if called.get(c.index) and mode in ("auto", "required") and reason == "stop":
                reason = "tool_calls"
            deltas = deltas or [{}]
        for i, d in enumerate(deltas):
            last = final and i == len(deltas) - 1
            choice = {"index": c.index, "delta": d, "logprobs": logprobs if i == 0 else None,
                      "finish_reason": reason if last else None,
                      "stop_reason": c.stop_reason if last else None}  # fmt: skip
            yield sse({**head, "choices": [choice], **stream_usage(body, choices)})
    for chunk in final_chunks(body, head, choices):
        yield chunk


def _deltas(body, mode, tool_stream, c: Choice, delta: str, called: dict[int, int]) -> list[dict]:
    """The deltas one text delta of choice ``c`` makes, by the request's tool choice."""
    final = c.finish_reason is not None
    if mode == "none":  # a chunk per token, as before tools (empty while text is held back)
        return [{"content": delta}] if delta or not final else []
    if mode == "auto":
        out = tool_stream.feed(c.text.text, final)
        calls = [d for d in out if "tool_calls" in d]
        if body.parallel_tool_calls is False:  # the first call only
            out = [d for d in out if "tool_calls" not in d or d["tool_calls"][0]["index"] == 0]
        called[c.index] = called.get(c.index, 0) + len(calls)
        return out
    function = named_tool(body)
    if function is not None:  # the arguments stream as they are generated
        out = []
        if not called.get(c.index):
            call = ToolCall(function.name, "")
            out.append({"tool_calls": [{"index": 0, **call.as_dict()}]})
            called[c.index] = 1
        if delta:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
        return out
    if not final:  # required: the array is read whole at the end
        return []
    calls = forced_calls(body, c.text.text)
    if body.parallel_tool_calls is False:
        calls = calls[:1]
    called[c.index] = len(calls)
    if not calls:
        return [{"content": c.text.text}] if c.text.text else []
    return [{"tool_calls": [{"index": i, **t.as_dict()}]} for i, t in enumerate(calls)]
