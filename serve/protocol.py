"""Request bodies of the OpenAI-compatible API (pydantic), with vLLM's extensions
(``top_k``, ``ignore_eos``, ``stop_token_ids``, ``return_token_ids``). Unknown fields are
ignored, as vLLM and SGLang do.

Integers are strict: a JSON ``true`` is not the token id (or count) 1, and ``2.0`` or
``"2"`` is not 2. ``seed`` is a signed 64-bit integer, as vLLM's. A prompt is never
empty (vLLM answers an empty one 400 too)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1

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
    n: StrictInt = Field(1, ge=1)
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

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: StrictInt | None = Field(16, ge=1)
    echo: bool = False
    logprobs: StrictInt | None = None

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
