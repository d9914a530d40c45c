"""Running one HTTP request's prompts through the runtime: checks of the body, tokenization
(on a worker thread, so a large prompt never blocks the event loop), submission (``best_of``
or ``n`` runtime requests per prompt, with the request's grammar and bad words prepared),
and the stream of text deltas as tokens arrive (detokenized on a worker thread too). What
the response carries besides the text is in :mod:`tokenlake.serve.api.responses`."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from tokenlake.engines.model.sampling import SamplingParams
from tokenlake.errors import InvalidArgumentError
from tokenlake.serve.api.errors import APIError, shown
from tokenlake.serve.api.fields import bad_words_token_ids, check_fields, truncated
from tokenlake.serve.api.limits import check_text
from tokenlake.serve.api.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from tokenlake.serve.api.state import APIState
from tokenlake.serve.api.text import TextStream
from tokenlake.serve.api.tools.structured import grammar_spec
from tokenlake.serve.request import GenerationRequest, TokenEvent

DISCONNECT_POLL_S = 0.5
MAX_SEQUENCES = 1024  # prompts x samples (best_of or n) of one request: each is a request

Body = CompletionRequest | ChatCompletionRequest


@dataclass(eq=False)
class Choice:
    """One generation inside an HTTP request: ``prompt_index`` of its prompt, ``sample`` of
    that prompt's ``best_of``. ``logprobs``: ``(token_id, logprob, top)`` per generated
    token when asked for; ``num_sent``: how many of them a stream has sent."""

    index: int
    request_id: str
    prompt_ids: list[int]
    text: TextStream
    prompt_index: int = 0
    sample: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached: int = 0
    logprobs: list[tuple[int, float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    num_sent: int = 0
    num_ids_sent: int = 0  # how many of its token ids a stream has sent

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp for _, lp, _ in self.logprobs)


def check_body(state: APIState, body: Body) -> None:
    """What the runtime cannot serve: text that is not valid Unicode or over the server's
    limit (before any of it is tokenized); more than :data:`MAX_SEQUENCES` prompts x
    samples; another model's name; ``best_of`` below ``n`` or over it while streaming;
    what is not implemented, refused by name."""
    check_text(body, state.max_text_chars)
    num_prompts, per_prompt = len(prompts_of(body)), num_samples(body)
    if num_prompts * per_prompt > MAX_SEQUENCES:
        param = "n" if per_prompt > 1 else "prompt"
        raise APIError(400, f"{param}: {num_prompts} prompts x {per_prompt} samples exceed "
                       f"{MAX_SEQUENCES} sequences per request", param=param)  # fmt: skip
    check_model(state, body.model)
    if body.best_of is not None and body.best_of < body.n:
        raise APIError(400, f"best_of: expected >= n={body.n}, got {body.best_of}", param="best_of")
    if body.stream and num_samples(body) > body.n:
        raise APIError(400, "best_of: must equal n when streaming", param="best_of")
    check_fields(body, state.runtime.max_model_len, state.tool_parser)
    if isinstance(body, CompletionRequest):
        if body.echo and body.logprobs is not None and body.stream:
            raise APIError(400, "echo: with logprobs only when not streaming", param="echo")
        return
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs true", param="top_logprobs")


def check_model(state: APIState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{shown(model)}` does not exist.", "NotFoundError",
                       param="model")  # fmt: skip


def prompts_of(body: Body) -> list:
    """A completion request's prompts (a batch, or its one prompt); a chat's messages are
    one prompt."""
    if isinstance(body, ChatCompletionRequest):
        return [body.messages]
    raw = body.prompt
    return raw if isinstance(raw, list) and raw and isinstance(raw[0], str | list) else [raw]


def num_samples(body: Body) -> int:
    """Generations per prompt: ``best_of`` when given, else ``n``."""
    return body.best_of if body.best_of is not None else body.n


def num_logprobs(body: Body) -> int | None:
    """Top log-probabilities per token the runtime computes: what the client asked for;
    0 when it asked for none but ``best_of`` must rank by cumulative log-probability."""
    if isinstance(body, CompletionRequest):
        asked = body.logprobs
    else:
        asked = (body.top_logprobs or 0) if body.logprobs else None
    if asked is None and num_samples(body) > body.n:
        return 0
    return asked


@dataclass(frozen=True)
class Prepared:
    """What a request needs besides its prompts: its compiled grammar (or ``None``) and
    the token ids of its ``bad_words``."""

    grammar: object | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()


async def prepare(state: APIState, body: Body) -> Prepared:
    """Compile the request's grammar and tokenize its bad words (on worker threads)."""
    spec = grammar_spec(body)
    grammar = None
    if spec is not None:
        if state.grammars is None:
            raise APIError(400, f"{spec.field}: this model has no tokenizer to build a grammar "
                           "over", param=spec.field)  # fmt: skip
        grammar = await run_in_threadpool(state.grammars.compile, spec)
    bad_words = await run_in_threadpool(bad_words_token_ids, state.tokenizer, body.bad_words)
    return Prepared(grammar, bad_words)


def sampling_params(body: Body, sample: int, prepared: Prepared = Prepared()) -> SamplingParams:
    """The runtime's parameters for generation ``sample`` of a prompt (a seeded request's
    samples use seed + sample, as vLLM's parallel sampling does)."""
    seed = body.seed if body.seed is None or sample == 0 else body.seed + sample
    allowed = tuple(body.allowed_token_ids) if body.allowed_token_ids else None
    return SamplingParams(
        body.temperature, body.top_p, body.top_k, seed, body.presence_penalty,
        body.frequency_penalty, body.repetition_penalty, body.logit_bias_pairs,
        body.min_tokens, num_logprobs(body), body.min_p, allowed, prepared.bad_words,
    )  # fmt: skip


async def encode(
    state: APIState, prompt: str | list[int], add_special_tokens: bool = True
) -> list[int]:
    """The token ids of one prompt (text is tokenized on a worker thread)."""
    if not isinstance(prompt, str):
        return list(prompt)
    if state.tokenizer is None:
        raise APIError(400, "prompt: this model has no tokenizer; send token ids", param="prompt")
    return await run_in_threadpool(state.tokenizer.encode, prompt, add_special_tokens)


async def encode_chat(state: APIState, body: ChatCompletionRequest | TokenizeRequest) -> list[int]:
    """The chat's prompt ids: the template (the request's ``chat_template`` or the
    model's, given ``tools``, ``documents`` and ``chat_template_kwargs``) rendered and
    tokenized on a worker thread."""
    tokenizer = state.tokenizer
    if tokenizer is None:
        raise APIError(400, "messages: this model has no tokenizer; use /v1/completions")
    messages = [m.as_dict() for m in body.messages]
    variables = dict(getattr(body, "chat_template_kwargs", None) or {})
    if getattr(body, "tools", None):
        variables["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    if getattr(body, "documents", None) is not None:
        variables["documents"] = body.documents

    def render_and_encode() -> list[int]:
        text = tokenizer.render_chat(
            messages, body.add_generation_prompt,
            continue_final_message=getattr(body, "continue_final_message", False),
            chat_template=getattr(body, "chat_template", None), variables=variables,
        )  # fmt: skip
        # the template writes the special tokens itself (as transformers' apply_chat_template)
        # unless the request asks for them on top (vLLM's add_special_tokens, default false)
        special = isinstance(body, ChatCompletionRequest) and body.add_special_tokens
        return tokenizer.encode(text, add_special_tokens=special)

    ids = await run_in_threadpool(render_and_encode)
    if isinstance(body, ChatCompletionRequest):
        ids = truncated(ids, body, state.runtime.max_model_len)
    return ids


async def decode(state: APIState, ids: list[int], skip_special_tokens: bool = True) -> str:
    if state.tokenizer is None:
        return ""
    return await run_in_threadpool(state.tokenizer.decode, ids, skip_special_tokens)


def start(
    state: APIState,
    body: Body,
    prompts: list[list[int]],
    max_tokens: int | None,
    prefix: str,
    prepared: Prepared = Prepared(),
) -> tuple[str, list[Choice], asyncio.Queue[TokenEvent]]:
    """Submit one runtime request per prompt; returns the id, the choices and their queue.
    Nothing stays submitted when one prompt is refused."""
    runtime = state.runtime
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

    def sink(event: TokenEvent) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, event)

    base = f"{prefix}-{body.request_id or uuid.uuid4().hex}"
    choices: list[Choice] = []
    per_prompt = num_samples(body)
    params = [sampling_params(body, j, prepared) for j in range(per_prompt)]
    for i, ids in enumerate(prompts):
        budget = max_tokens if max_tokens is not None else runtime.max_model_len - len(ids)
        for j in range(per_prompt):
            index = i * per_prompt + j
            rid = f"{base}-{index}"
            req = GenerationRequest(
                rid, tuple(ids), budget, params[j], frozenset(body.stop_token_ids or ()),
                body.ignore_eos, prepared.grammar,
            )  # fmt: skip
            try:
                runtime.submit(req, sink)
            except (InvalidArgumentError, RuntimeError) as e:
                for c in choices:
                    runtime.cancel(c.request_id)
                if isinstance(e, InvalidArgumentError):
                    raise
                raise APIError(503, str(e), "ServiceUnavailableError") from None
            text = TextStream(
                state.tokenizer, body.stop_strings, body.min_tokens, body.skip_special_tokens,
                body.include_stop_str_in_output,
            )  # fmt: skip
            choices.append(Choice(index, rid, ids, text, i, j))
    return base, choices, queue


async def events(
    state: APIState, choices: list[Choice], queue: asyncio.Queue[TokenEvent], request: Request
) -> AsyncIterator[tuple[Choice, str]]:
    """``(choice, text delta)`` as tokens arrive, until every choice finished; cancels
    whatever is unfinished if the client goes away or the caller stops early. The work is
    linear in the events: those that arrived together are taken at once and detokenized in
    one worker-thread hop (detokenizing re-decodes a choice's output: off the event loop)."""
    runtime = state.runtime
    by_id = {c.request_id: c for c in choices}
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_POLL_S
    num_open = len(choices)
    try:
        while num_open:
            try:
                batch = [await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)]
            except asyncio.TimeoutError:
                batch = []
            while not queue.empty():
                batch.append(queue.get_nowait())
            if loop.time() >= next_check:  # tokens may never pause: check on a clock
                next_check = loop.time() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    return
            if not batch:
                continue
            if state.tokenizer is None:
                deltas, error = _apply(runtime, by_id, batch)
            else:
                deltas, error = await run_in_threadpool(_apply, runtime, by_id, batch)
            for c, delta, closed in deltas:
                num_open -= closed
                yield c, delta
            if error is not None:
                raise APIError(500, error, "InternalServerError")
    finally:
        for c in choices:
            if c.finish_reason is None:
                runtime.cancel(c.request_id)


def _apply(
    runtime, by_id: dict[str, Choice], batch: list[TokenEvent]
) -> tuple[list[tuple[Choice, str, bool]], str | None]:
    """Feed ``batch`` to its choices in order: ``(choice, text delta, whether it closed the
    choice)`` per event of a choice still open, and the error message of the first event
    that ended one with an error (the events after it are dropped)."""
    out = []
    for event in batch:
        c = by_id[event.request_id]
        if c.finish_reason is not None:
            continue
        c.num_cached = event.num_cached_tokens
        final = event.finish_reason is not None
        num_tokens = len(c.text.token_ids)
        stopped = event.finish_reason == "stop"  # at EOS or a stop token id
        delta = c.text.add(event.token_id, final, stopped)
        if len(c.text.token_ids) > num_tokens and event.logprob is not None:
            c.logprobs.append((event.token_id, event.logprob, event.top_logprobs))
        if final:
            c.finish_reason = event.finish_reason
            c.stop_reason = event.stop_reason
        elif c.text.stopped:
            c.finish_reason, c.stop_reason = "stop", c.text.stop_string
            runtime.cancel(c.request_id)
        if event.finish_reason == "error":
            return out, event.error or "generation failed"
        out.append((c, delta, c.finish_reason is not None))
    return out, None
