"""Structured outputs and tool calls on a seeded tiny-random server started with
``--enable-auto-tool-choice --tool-call-parser hermes``, driven with the official
``openai`` client: every output of every structured field (vLLM's ``structured_outputs``,
``guided_*``, ``response_format``) parses and matches its schema, regex, choices or
grammar; the server's mask at each step equals a fresh xgrammar matcher's (the top
log-probabilities hold exactly the tokens it allows); ``tool_choice`` ``required``, a
named function and ``auto`` (the hermes parser) give calls whose arguments validate,
streamed too in OpenAI's delta shape.

The random model favours whitespace, which a JSON grammar allows anywhere; the requests
bias the whitespace tokens down with ``logit_bias`` (or ask ``disable_any_whitespace``),
as a client of a small model would, so the outputs end within ``max_tokens``."""

from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from tokenlake.serve.api.http_server import HTTPServer  # noqa: E402
from tokenlake.serve.build import build  # noqa: E402
from tokenlake.serve.config import ServeConfig  # noqa: E402

MODEL = "tiny-random"
CHAT = [{"role": "user", "content": "What is the weather?"}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                    "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}  # fmt: skip
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                       "required": ["city"], "additionalProperties": False},
    },
}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time"}}
CONFIG = ServeConfig(
    num_instances=2, segment_len=8, num_slots=256, chunk_len=32, max_num_seqs=16,
    max_model_len=512, profile=False, torch_threads=1, port=0,
    enable_auto_tool_choice=True, tool_call_parser="hermes",
)  # fmt: skip


@pytest.fixture(scope="module")
def server():
    with HTTPServer(build(CONFIG), "127.0.0.1", 0).start() as srv:
        yield srv


@pytest.fixture(scope="module")
def no_space(server):
    """``logit_bias`` pushing the whitespace tokens down (allowed, never preferred)."""
    tok = server.served.tokenizer
    ids = {tok.encode(ch, add_special_tokens=False)[0] for ch in " \t\n\r"}
    return {str(t): -100 for t in sorted(ids)}


@pytest.fixture(scope="module")
def matcher_of(server):
    from tokenlake.engines.model.grammar import GrammarCompiler, GrammarSpec

    runtime = server.served.runtime
    compiler = GrammarCompiler(server.served.tokenizer.for_transformers(),
                               runtime.engine.model.config.vocab_size,
                               sorted(runtime.eos_token_ids))  # fmt: skip
    return lambda kind, value="": xgrammar.GrammarMatcher(
        compiler.compile(GrammarSpec(kind, value))
    )


def complete(oai, **kwargs):
    extra = {"return_token_ids": True, **kwargs.pop("extra_body", {})}
    return oai.completions.create(model=MODEL, prompt="Answer:", max_tokens=120,
                                  extra_body=extra, **kwargs)  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_field_gives_outputs_that_match(oai, no_space, seed):
    """Seeded samples (temperature 1) under each kind of structured output."""
    kw = {"temperature": 1.0, "seed": seed, "logit_bias": no_space}
    cases = [
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        ({"structured_outputs": {"json": SCHEMA}},
         lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": SCHEMA}}},
         lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        ({"guided_regex": r"[a-f]{3}-\d{2}"}, lambda t: re.fullmatch(r"[a-f]{3}-\d{2}", t)),
        ({"structured_outputs": {"regex": r"(yes|no)!"}}, lambda t: t in ("yes!", "no!")),
        ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"structured_outputs": {"choice": ["α", "β"]}}, lambda t: t in ("α", "β")),
        ({"guided_grammar": 'root ::= "(" [1-9] ("+" [1-9])* ")"'},
         lambda t: re.fullmatch(r"\([1-9](\+[1-9])*\)", t)),
    ]  # fmt: skip
    for extra, check in cases:
        choice = complete(oai, extra_body=extra, **kw).choices[0]
        assert choice.finish_reason == "stop", (extra, choice.text)
        assert check(choice.text) is not False, (extra, choice.text)
    obj = complete(oai, extra_body={"response_format": {"type": "json_object"}}, **kw).choices[0]
    assert obj.finish_reason == "stop" and isinstance(
        json.loads(obj.text, strict=False), dict | list
    )
    tight = complete(oai, temperature=1.0, seed=seed, extra_body={
        "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}).choices[0]  # fmt: skip
    # no free whitespace: the separators are json.dumps' own
    assert tight.text == json.dumps(json.loads(tight.text))
    jsonschema.validate(json.loads(tight.text), SCHEMA)


def test_the_mask_at_each_step_is_xgrammars(server, oai, matcher_of):
    """With ``logprobs=20`` and ids as token strings, each position's tokens of finite
    log-probability are exactly what a fresh matcher allows (there are at most 20 of
    them at every step of this regex), and the sampled token is one of them."""
    pattern = r"(ab|cd)[0-4]{2}(x|yz)"
    r = complete(oai, temperature=1.0, seed=3, logprobs=20,
                 extra_body={"guided_regex": pattern, "return_tokens_as_token_ids": True})  # fmt: skip
    choice = r.choices[0]
    assert re.fullmatch(pattern, choice.text)
    matcher = matcher_of("regex", pattern)
    vocab = server.served.runtime.engine.model.config.vocab_size
    for token_id, top in zip(choice.token_ids, choice.logprobs.top_logprobs, strict=True):
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(bitmask)
        allowed = {t for t in range(vocab) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1}
        finite = {int(k.removeprefix("token_id:")) for k, v in top.items() if v > -9999}
        assert finite == allowed
        assert matcher.accept_token(token_id)
    assert matcher.is_terminated()


def one_call(server, no_space) -> dict:
    """``no_space`` and a comma pushed down: where the grammar lets a call list go on or
    end, it ends (the random model would otherwise list calls until max_tokens)."""
    comma = server.served.tokenizer.encode(",", add_special_tokens=False)[0]
    return {**no_space, str(comma): -100}


def test_tool_choice_required_and_named_always_parse(server, oai, no_space):
    tools = [WEATHER, TIME]
    for seed in range(3):
        r = oai.chat.completions.create(model=MODEL, messages=CHAT, tools=tools, seed=seed,
                                        tool_choice="required", temperature=1.0, max_tokens=150,
                                        logit_bias=one_call(server, no_space))  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
            args = json.loads(call.function.arguments)
            if call.function.name == "get_weather":
                jsonschema.validate(args, WEATHER["function"]["parameters"])
            else:
                assert call.function.name == "get_time" and args == {}
        named = oai.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            tools=tools,
            seed=seed,
            temperature=1.0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=60,
            logit_bias=no_space,
        ).choices[0]
        assert named.finish_reason == "stop" and len(named.message.tool_calls) == 1
        call = named.message.tool_calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def _streamed_calls(stream) -> tuple[str, list, str | None]:
    """Content, calls and finish reason accumulated from OpenAI chunk deltas, the way the
    ``openai`` client's helpers and langchain merge them (by ``index``)."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            reason = c.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "get_weather"}}])  # fmt: skip
def test_streamed_tool_calls_equal_the_whole_response(server, oai, no_space, tool_choice):
    kw = {"model": MODEL, "messages": CHAT, "tools": [WEATHER, TIME], "seed": 7,
          "temperature": 1.0, "max_tokens": 150, "logit_bias": one_call(server, no_space),
          "tool_choice": tool_choice}  # fmt: skip
    whole = oai.chat.completions.create(**kw).choices[0]
    content, calls, reason = _streamed_calls(oai.chat.completions.create(stream=True, **kw))
    assert reason == whole.finish_reason and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls
    ]
    assert all(c["id"] for c in calls)


def test_auto_reads_hermes_calls_and_tools_alone_mean_auto(oai):
    """The random model never writes a call by itself: a one-choice grammar makes it write
    one in the hermes format, which auto (tools without tool_choice) reads back."""
    text = ('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            "</tool_call>")  # fmt: skip
    kw = {"model": MODEL, "messages": CHAT, "tools": [WEATHER], "max_tokens": 120,
          "extra_body": {"guided_choice": [text]}}  # fmt: skip
    r = oai.chat.completions.create(**kw).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content == "Sure."
    [call] = r.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    content, calls, reason = _streamed_calls(oai.chat.completions.create(stream=True, **kw))
    assert (content, reason) == ("Sure.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    plain = oai.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER],
                                        max_tokens=5, temperature=0).choices[0]  # fmt: skip
    assert plain.message.tool_calls in (None, []) and plain.message.content
    assert plain.finish_reason in ("stop", "length")


def test_langchain_bind_tools_and_with_structured_output(server, no_space):
    """langchain-openai as an agent framework drives the server: ``bind_tools`` (tools
    without a tool_choice: auto, read by the hermes parser; invoke and stream) and
    ``with_structured_output`` by JSON schema and by function calling."""
    langchain_openai = pytest.importorskip("langchain_openai")
    pydantic = pytest.importorskip("pydantic")

    class Weather(pydantic.BaseModel):
        """The weather in a city."""

        city: str = pydantic.Field(json_schema_extra={"enum": ["Paris", "Oslo"]})

    text = ('<tool_call>\n{"name": "Weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call>")  # fmt: skip
    llm = langchain_openai.ChatOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", model=MODEL, max_tokens=80,
        temperature=0, max_retries=0, logit_bias={int(k): v for k, v in no_space.items()},
    )  # fmt: skip
    forced = llm.bind_tools([Weather], extra_body={"guided_choice": [text]})
    message = forced.invoke("What is the weather in Paris?")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("Weather", {"city": "Paris"})]
    merged = None
    for chunk in forced.stream("What is the weather in Paris?"):
        merged = chunk if merged is None else merged + chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("Weather", {"city": "Paris"})]
    for method in ("json_schema", "function_calling"):
        answer = llm.with_structured_output(Weather, method=method).invoke("Weather?")
        assert isinstance(answer, Weather) and answer.city in ("Paris", "Oslo"), method


def test_litellm_tools_and_response_format(server, no_space):
    """litellm's ``hosted_vllm`` provider: a tool call read back by the hermes parser and
    a JSON-schema ``response_format``, as litellm sends them."""
    litellm = pytest.importorskip("litellm")
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            "</tool_call>")  # fmt: skip
    common = {"model": f"hosted_vllm/{MODEL}", "api_base": f"{server.url}/v1",
              "api_key": "unused", "messages": CHAT, "max_tokens": 80, "temperature": 0}  # fmt: skip
    r = litellm.completion(tools=[WEATHER], extra_body={"guided_choice": [text]}, **common)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    assert r.choices[0].finish_reason == "tool_calls"
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    r = litellm.completion(response_format=fmt, logit_bias=no_space, **common)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
