"""Request bodies of the OpenAI-compatible API (pydantic) with every field vLLM's
OpenAI server accepts: what this server implements, and what it refuses by name (parsed
so that :mod:`tokenlake.serve.api.fields` can answer a 400 naming it; docs/serving.md has
the table). A field vLLM does not know either is ignored with a warning naming it, as
vLLM logs one.

Integers are strict: a JSON ``true`` is not the token id (or count) 1, and ``2.0`` or
``"2"`` is not 2. ``seed`` is a signed 64-bit integer, as vLLM's. A prompt is never
empty (vLLM answers an empty one 400 too)."""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from tokenlake.serve.api.tools.structured import (
    MAX_TOOLS,
    ResponseFormat,
    StructuredOutputs,
    Tool,
    ToolChoice,
)

log = logging.getLogger(__name__)

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
MAX_N = 64  # completions per prompt (n, best_of): each is a running request
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_TOKEN_LIST = 1 << 16  # allowed_token_ids, stop_token_ids
MAX_BAD_WORDS = 1024
MAX_TEMPLATE_CHARS = 1 << 16  # a request's chat_template

# a float field that takes ints (2 is 2.0) but not booleans or strings
Number = Annotated[float, Field(strict=True)]
TokenIds = list[StrictInt]


class _Body(BaseModel):
    """A request body: fields nobody knows are ignored, with a warning naming them (vLLM's
    ``The following fields were present in the request but ignored``)."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown(cls, data):
        if isinstance(data, dict):
            known = set(cls.model_fields) | {
                f.alias for f in cls.model_fields.values() if f.alias is not None
            }
            unknown = sorted(str(k)[:64] for k in data if k not in known)
            if unknown:
                log.warning(
                    "The following fields were present in the request but ignored: %s",
                    unknown[:20],
                )
        return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _Sampling(_Body):
    model: str | None = None
    temperature: Number = Field(1.0, ge=0.0, le=100.0)
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=-1)
    seed: StrictInt | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    best_of: StrictInt | None = Field(None, ge=1, le=MAX_N)
    presence_penalty: Number = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Number = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: Number = Field(1.0, gt=0.0, le=100.0)
    logit_bias: dict[str, Number] | None = Field(None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    min_tokens: StrictInt = Field(0, ge=0)
    min_p: Number = Field(0.0, ge=0.0, le=1.0)
    allowed_token_ids: TokenIds | None = Field(None, min_length=1, max_length=MAX_TOKEN_LIST)
    bad_words: list[str] = Field(default_factory=list, max_length=MAX_BAD_WORDS)
    response_format: ResponseFormat | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = Field(None, max_length=MAX_TOKEN_LIST)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1)
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    return_tokens_as_token_ids: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    user: str | None = None
    request_id: str | None = Field(None, min_length=1, max_length=256)
    # structured outputs (serve/api/tools/structured.py)
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # parsed to be refused by name unless at their defaults (serve/api/fields.py)
    use_beam_search: bool = False
    length_penalty: Number = 1.0
    priority: StrictInt = 0
    logits_processors: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None

    @field_validator("seed")
    @classmethod
    def _seed_in_range(cls, seed: int | None) -> int | None:
        if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
            raise ValueError(
                f"expected a signed 64-bit int in [{SEED_MIN}, {SEED_MAX}], got {seed}"
            )
        return seed

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) < 10):
                raise ValueError(f"expected token ids as keys, got {key[:40]!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"expected biases in [-100, 100], got {value} for {key}")
        return bias

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: StrictInt | None = Field(16, ge=1)
    echo: bool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    add_special_tokens: bool = True
    suffix: Any = None
    prompt_embeds: Any = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, prompt):
        if len(prompt) == 0:
            raise ValueError("expected a non-empty prompt (text or token ids)")
        if isinstance(prompt, list) and any(isinstance(p, str | list) and not p for p in prompt):
            raise ValueError("expected every prompt of the batch to be non-empty")
        return prompt


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message as the chat template sees it: text parts joined with ``"\n"`` (as
    vLLM joins them); an assistant's ``tool_calls`` with their JSON ``arguments`` parsed
    into objects (as vLLM hands them to templates), a tool result's ``tool_call_id``."""

    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""

    def as_dict(self) -> dict:
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        if self.tool_calls is not None:
            message["tool_calls"] = [_parsed_arguments(c) for c in self.tool_calls]
        return message


def _parsed_arguments(call: dict) -> dict:
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            return call
        return {**call, "function": {**function, "arguments": arguments}}
    return call


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    echo: bool = False
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = Field(None, max_length=MAX_TEMPLATE_CHARS)
    chat_template_kwargs: dict[str, Any] | None = None
    # refused unless absent
    reasoning_effort: Any = None
    structural_tag: Any = None
    mm_processor_kwargs: Any = None


class TokenizeRequest(_Body):
    """vLLM's ``/tokenize``: a ``prompt`` (special tokens added unless
    ``add_special_tokens`` is false) or chat ``messages`` (rendered by the template, which
    writes the special tokens itself)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds
