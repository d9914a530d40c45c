"""Request bodies of the OpenAI-compatible API (pydantic), with vLLM's extensions
(``top_k``, ``ignore_eos``, ``stop_token_ids``, ``return_token_ids``, ``min_tokens``,
``repetition_penalty``). Unknown fields are ignored, as vLLM and SGLang do; the fields this
server knows but does not implement (``response_format`` other than text, ``tools``,
``tool_choice``, ``suffix``) are parsed so that they can be refused by name.

Integers are strict: a JSON ``true`` is not the token id (or count) 1, and ``2.0`` or
``"2"`` is not 2. ``seed`` is a signed 64-bit integer, as vLLM's. A prompt is never
empty (vLLM answers an empty one 400 too)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
MAX_N = 64  # completions per prompt (n, best_of): each is a running request
MAX_LOGIT_BIAS_ENTRIES = 1024

# a float field that takes ints (2 is 2.0) but not booleans or strings
Number = Annotated[float, Field(strict=True)]
TokenIds = list[StrictInt]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

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
    response_format: Any = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    user: str | None = None

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
    suffix: Any = None

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
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: Any = None
    tool_choice: Any = None


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a ``prompt`` (special tokens added unless
    ``add_special_tokens`` is false) or chat ``messages`` (rendered by the template, which
    writes the special tokens itself)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: TokenIds
