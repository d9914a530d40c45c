"""Request bodies of the OpenAI-compatible API (pydantic), with vLLM's extensions
(``top_k``, ``ignore_eos``, ``stop_token_ids``, ``return_token_ids``). Unknown fields are
ignored, as vLLM and SGLang do."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = None
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    user: str | None = None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = None


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
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    logprobs: bool = False
