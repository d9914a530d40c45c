"""Tool calls in generated text, as vLLM's ``--tool-call-parser`` reads them: ``hermes``
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the text before the first
one is the message's content) and ``llama3_json`` (the output is a JSON object
``{"name": ..., "parameters": {...}}`` or several separated by ``;``, optionally after
``<|python_tag|>``; the text around them is dropped). A call that does not parse leaves
the output as plain content, as vLLM does.

:class:`ToolCallStream` turns a stream of text deltas into OpenAI's chunk deltas: content
until a call may start, then one ``tool_calls`` item per call once its JSON is complete
(``index``, ``id``, ``type`` and the whole ``function``), which the ``openai`` client and
langchain accumulate like any other."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from tokenlake.serve.config import TOOL_CALL_PARSERS


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


def _call(obj: object, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesParser:
    start = "<tool_call>"
    end = "</tool_call>"

    def section_start(self, text: str) -> int | None:
        at = text.find(self.start)
        return at if at >= 0 else None

    def calls(self, section: str) -> tuple[list[ToolCall], bool]:
        """The complete calls of ``section`` (from the first start marker on) and whether
        every marked call parsed."""
        calls, ok = [], True
        for part in section.split(self.start)[1:]:
            if self.end not in part:
                break
            body = part.split(self.end, 1)[0].strip()
            try:
                call = _call(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:
                ok = False
                break
            calls.append(call)
        return calls, ok


class Llama3JsonParser:
    python_tag = "<|python_tag|>"

    def section_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.python_tag) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def calls(self, section: str) -> tuple[list[ToolCall], bool]:
        text = section.lstrip().removeprefix(self.python_tag)
        decoder = json.JSONDecoder()
        calls, at = [], 0
        while True:
            at = len(text) - len(text[at:].lstrip())
            if at >= len(text):
                return calls, True
            try:
                obj, at = decoder.raw_decode(text, at)
            except ValueError:
                return calls, False
            call = _call(obj, "parameters")
            if call is None:
                return calls, False
            calls.append(call)
            rest = text[at:].lstrip()
            if not rest.startswith(";"):
                return calls, not rest
            at = len(text) - len(rest) + 1


def make_parser(name: str) -> HermesParser | Llama3JsonParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    raise ValueError(
        f"tool_call_parser: expected one of {', '.join(TOOL_CALL_PARSERS)}, got {name!r}"
    )


def extract(parser, text: str) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a finished output; ``(text, [])`` when no call parses."""
    at = parser.section_start(text)
    if at is None:
        return text, []
    calls, ok = parser.calls(text[at:])
    if not calls or not ok:
        return text, []
    content = text[:at] if isinstance(parser, HermesParser) else ""
    return (content or None), calls


class ToolCallStream:
    """One streamed choice: :meth:`feed` the text so far (and whether it is final); it
    returns the chunk deltas to send: ``{"content": ...}`` and ``{"tool_calls": [...]}``."""

    def __init__(self, parser) -> None:
        self._parser = parser
        self._content_sent = 0
        self._calls_sent = 0
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool) -> list[dict]:
        deltas = []
        at = self._parser.section_start(text)
        if at is None:  # hold back what may be the start of a marker
            safe = len(text) if final else _safe_end(text, self._parser)
            if safe > self._content_sent:
                deltas.append({"content": text[self._content_sent : safe]})
                self._content_sent = safe
            return deltas
        if at > self._content_sent and isinstance(self._parser, HermesParser):
            deltas.append({"content": text[self._content_sent : at]})
        self._content_sent = max(self._content_sent, at)
        calls, ok = self._parser.calls(text[at:])
        for call in calls[self._calls_sent :]:
            item = {"index": len(self.calls), **call.as_dict()}
            deltas.append({"tool_calls": [item]})
            self.calls.append(call)
        self._calls_sent = len(calls)
        if final and not self.calls:  # nothing parsed: it was content after all
            deltas.append({"content": text[self._content_sent :]})
            self._content_sent = len(text)
        return deltas


def _safe_end(text: str, parser) -> int:
    """Where the text that cannot begin a tool call ends (a partial ``<tool_call>``, or
    leading whitespace before a possible JSON call, waits)."""
    if isinstance(parser, Llama3JsonParser):
        if not text.strip():
            return 0
        stripped = text.lstrip()
        if parser.python_tag.startswith(stripped):
            return 0
        return len(text)
    for keep in range(min(len(parser.start) - 1, len(text)), 0, -1):
        if parser.start.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)
