"""Structured outputs and tools in a request, as vLLM reads them: ``response_format``
(``json_object``, ``json_schema``), ``structured_outputs`` (``json``, ``regex``,
``choice``, ``grammar``, ``json_object``) and the older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar``; ``tools`` with ``tool_choice``
``required`` (a JSON array of ``{"name", "parameters"}`` calls, vLLM's schema) or a named
function (its parameters' schema) become the grammar the output must match, so the call
always parses. At most one of them per request."""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenlake.engines.model.grammar import GrammarCompiler, GrammarSpec
from tokenlake.engines.model.tokenizer import Tokenizer
from tokenlake.serve.api.errors import APIError
from tokenlake.serve.api.tools.parsers import ToolCall

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}  # fmt: skip
MAX_TOOLS = 128


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``,
    ``grammar``, ``json_object``; ``disable_any_whitespace`` (JSON without whitespace);
    its other options are refused unless at their defaults."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: Literal[False] = False
    disable_any_whitespace: bool = False
    disable_additional_properties: Literal[False] = False
    whitespace_pattern: None = None
    structural_tag: None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class Grammars:
    """The server's grammar compiler, made at the first structured request (reading a large
    vocabulary takes a second); ``compile`` is called from worker threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids) -> None:
        self._args = (tokenizer, vocab_size, tuple(stop_token_ids))
        self._lock = threading.Lock()
        self._compiler: GrammarCompiler | None = None

    def compile(self, spec: GrammarSpec):
        with self._lock:
            if self._compiler is None:
                tokenizer, vocab_size, stop = self._args
                self._compiler = GrammarCompiler(tokenizer.for_transformers(), vocab_size, stop)
            return self._compiler.compile(spec)


def grammar_spec(body) -> GrammarSpec | None:
    """The grammar a request's output must match, or ``None``; a 400 naming the field when
    it asks for two, or for a tool its ``tools`` lack."""
    found: list[GrammarSpec] = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        found.append(GrammarSpec("json_object", field="response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError(400, "response_format: json_schema needs a schema",
                           param="response_format")  # fmt: skip
        found.append(_json_spec(fmt.json_schema.json_schema, "response_format"))
    outputs = getattr(body, "structured_outputs", None)
    if outputs is not None:
        found += _structured_specs(outputs)
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(body, name, None)
        if value is None:
            continue
        if kind == "json":
            found.append(_json_spec(value, name))
        elif kind == "choice":
            found.append(GrammarSpec("choice", json.dumps(value), name))
        else:
            found.append(GrammarSpec(kind, value, name))
    tool_spec = _tool_choice_spec(body)
    if tool_spec is not None:
        found.append(tool_spec)
    if len(found) > 1:
        raise APIError(400, f"{found[1].field}: only one kind of structured output per request "
                       f"(also got {found[0].field})", param=found[1].field)  # fmt: skip
    return found[0] if found else None


def _json_spec(schema: str | dict, field: str) -> GrammarSpec:
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except ValueError as e:
            raise APIError(400, f"{field}: not a JSON schema ({e})", param=field) from None
        return GrammarSpec("json", schema, field)
    return GrammarSpec("json", json.dumps(schema), field)


def _structured_specs(outputs: StructuredOutputs) -> list[GrammarSpec]:
    field = "structured_outputs"
    specs = []
    if outputs.json_schema is not None:
        spec = _json_spec(outputs.json_schema, field)
        specs.append(dataclasses.replace(spec, any_whitespace=not outputs.disable_any_whitespace))
    if outputs.regex is not None:
        specs.append(GrammarSpec("regex", outputs.regex, field))
    if outputs.choice is not None:
        specs.append(GrammarSpec("choice", json.dumps(outputs.choice), field))
    if outputs.grammar is not None:
        specs.append(GrammarSpec("grammar", outputs.grammar, field))
    if outputs.json_object:
        specs.append(GrammarSpec("json_object", field=field))
    if len(specs) != 1:
        raise APIError(400, f"{field}: expected exactly one of json, regex, choice, grammar, "
                       f"json_object, got {len(specs)}", param=field)  # fmt: skip
    return specs


def named_tool(body) -> FunctionDefinition | None:
    choice = getattr(body, "tool_choice", None)
    if not isinstance(choice, NamedToolChoice):
        return None
    for tool in body.tools or ():
        if tool.function.name == choice.function.name:
            return tool.function
    raise APIError(400, f"tool_choice: the function {choice.function.name!r} is not in tools",
                   param="tool_choice")  # fmt: skip


def _parameters(function: FunctionDefinition) -> dict:
    return function.parameters or {"type": "object", "properties": {}}


def _tool_choice_spec(body) -> GrammarSpec | None:
    function = named_tool(body)
    if function is not None:
        return GrammarSpec("json", json.dumps(_parameters(function)), "tool_choice")
    if getattr(body, "tool_choice", None) != "required" or not body.tools:
        return None
    calls = [{"properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": _parameters(t.function)},
              "required": ["name", "parameters"]} for t in body.tools]  # fmt: skip
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    return GrammarSpec("json", json.dumps(schema), "tool_choice")


def forced_calls(body, text: str) -> list[ToolCall]:
    """The calls of an output generated under ``tool_choice`` ``required`` or a named
    function (the grammar made it parse; a cut-off output gives none)."""
    function = named_tool(body)
    if function is not None:
        return [ToolCall(function.name, text)] if _parses(text) else []
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
