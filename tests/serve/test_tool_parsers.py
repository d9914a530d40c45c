"""The tool-call parsers on the outputs vLLM's own parsers document: ``hermes`` (calls in
``<tool_call>`` tags, the text before them is content) and ``llama3_json`` (JSON objects
with ``parameters``, ``;``-separated, optionally after ``<|python_tag|>``); malformed
calls stay content. Streaming the same text cut at every point gives the same content and
calls as the whole text."""

from __future__ import annotations

import json

import pytest

from tokenlake.serve.api.tools.parsers import ToolCallStream, extract, make_parser

HERMES = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
    "</tool_call>"
)
LLAMA = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "nested": '
    '{"a": [1, {"b": 2}]}}}; {"name": "get_time", "parameters": {}}'
)
EXPECTED = [
    ("get_weather", {"city": "Paris", "unit": "c"}),
    ("get_time", {}),
]


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_extracts_calls_and_the_content_before_them():
    content, calls = extract(make_parser("hermes"), HERMES)
    assert content == "Let me check."
    assert calls_of(calls) == EXPECTED
    assert len({c.id for c in calls}) == 2 and calls[0].id.startswith("chatcmpl-tool-")
    assert extract(make_parser("hermes"), "no tools here") == ("no tools here", [])
    broken = '<tool_call>{"name": "f", "arguments": {</tool_call>'
    assert extract(make_parser("hermes"), broken) == (broken, [])


def test_llama3_json_extracts_semicolon_separated_calls():
    content, calls = extract(make_parser("llama3_json"), LLAMA)
    assert content is None
    assert calls_of(calls) == [
        ("get_weather", {"city": "Paris", "nested": {"a": [1, {"b": 2}]}}),
        ("get_time", {}),
    ]
    plain = ' {"name": "f", "arguments": {"x": 1}}'  # "arguments" is read too, as vLLM
    assert calls_of(extract(make_parser("llama3_json"), plain)[1]) == [("f", {"x": 1})]
    assert extract(make_parser("llama3_json"), "Hello {") == ("Hello {", [])
    assert extract(make_parser("llama3_json"), '{"x": 1}') == ('{"x": 1}', [])


@pytest.mark.parametrize("name,text", [("hermes", HERMES), ("llama3_json", LLAMA),
                                       ("hermes", "plain <tool text"), ("llama3_json", "  plain")])  # fmt: skip
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_add_up_to_the_whole(name, text, step):
    stream = ToolCallStream(make_parser(name))
    content, items = "", []
    cuts = list(range(step, len(text), step)) + [len(text)]
    for cut in cuts:
        for delta in stream.feed(text[:cut], final=cut == len(text)):
            content += delta.get("content", "")
            items += delta.get("tool_calls", [])
    whole_content, whole_calls = extract(make_parser(name), text)
    assert content == (whole_content or "")
    assert [i["index"] for i in items] == list(range(len(whole_calls)))
    assert [(i["function"]["name"], json.loads(i["function"]["arguments"])) for i in items] == (
        calls_of(whole_calls)
    )
    assert all(i["type"] == "function" and i["id"] for i in items)


def test_every_parser_name_the_flag_takes_has_a_parser():
    from tokenlake.serve.config import TOOL_CALL_PARSERS

    for name in TOOL_CALL_PARSERS:
        assert make_parser(name) is not None
    with pytest.raises(ValueError, match="tool_call_parser"):
        make_parser("mistral")
