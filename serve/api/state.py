"""What the API's handlers share, kept on ``app.state`` and handed to each handler as a
FastAPI dependency (no closures, no module globals)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from prometheus_client import CollectorRegistry

from tokenlake.engines.model.tokenizer import Tokenizer
from tokenlake.serve.api.tools.structured import Grammars
from tokenlake.serve.config import MAX_TEXT_CHARS
from tokenlake.serve.runtime import Runtime


@dataclass(frozen=True)
class APIState:
    """The running runtime, its tokenizer (``None``: clients send token ids), the name
    clients pass as ``model``, where the checkpoint is and the ``/metrics`` registry;
    the grammar compiler of structured outputs (``None`` without a tokenizer) and the
    parser of ``tool_choice`` ``auto`` (``None``: auto is refused)."""

    runtime: Runtime
    tokenizer: Tokenizer | None
    model_name: str
    model_path: Path
    registry: CollectorRegistry
    grammars: Grammars | None = None
    tool_parser: str | None = None
    max_text_chars: int = MAX_TEXT_CHARS


def api_state(request: Request) -> APIState:
    return request.app.state.api


State = Annotated[APIState, Depends(api_state)]
