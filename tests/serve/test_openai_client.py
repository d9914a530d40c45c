"""Every sampling parameter and refusal driven with the official ``openai`` client against
the shared tiny-random server: ``n`` and ``best_of`` (each sample equal to a single request
with its seed; the best ``n`` by cumulative log-probability), chat ``logprobs`` /
``top_logprobs``, ``echo`` when streaming, ``stop_reason``, and a 400 naming the field for
what is not implemented, parsed by the client."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

MODEL = "tiny-random"
PROMPT = [0, 9, 10, 11, 12, 13]
CHAT = [{"role": "user", "content": "Say hi"}]


def complete(oai, prompt=PROMPT, **kwargs):
    extra = {"return_token_ids": True, "ignore_eos": True, **kwargs.pop("extra_body", {})}
    return oai.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **kwargs)


def test_n_samples_are_the_seeded_single_requests(oai):
    """Sample j of a seeded request is the request seeded seed + j (vLLM's parallel
    sampling); the prompt is counted once in usage, every sample's tokens."""
    r = complete(oai, n=3, max_tokens=6, temperature=1.0, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for j, choice in enumerate(r.choices):
        alone = complete(oai, max_tokens=6, temperature=1.0, seed=11 + j).choices[0]
        assert choice.token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in r.choices}) > 1
    assert r.usage.prompt_tokens == len(PROMPT) and r.usage.completion_tokens == 18
    batch = complete(oai, prompt=[PROMPT, PROMPT[:3]], n=2, max_tokens=2, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]


def test_best_of_returns_the_n_most_likely_samples(oai):
    every = complete(oai, n=4, max_tokens=5, temperature=1.0, seed=5, logprobs=0).choices
    totals = [sum(c.logprobs.token_logprobs) for c in every]
    ranked = sorted(range(4), key=lambda j: (-totals[j], j))[:2]
    r = complete(oai, n=2, best_of=4, max_tokens=5, temperature=1.0, seed=5)
    assert [c.token_ids for c in r.choices] == [every[j].token_ids for j in ranked]
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == 20  # all four were generated


def test_chat_logprobs_and_top_logprobs(oai):
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                    logprobs=True, top_logprobs=3,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    for item in content:
        assert len(item.top_logprobs) == 3
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        assert item.logprob == pytest.approx(values[0])  # greedy: the most likely
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    plain = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                        temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content
    stream = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=1,
                                         stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    streamed = [t for ch in stream for c in ch.choices if c.logprobs for t in c.logprobs.content]
    assert [t.logprob for t in streamed] == pytest.approx(
        [t.logprob for t in content], abs=1e-4
    )  # a cached prefix is attended in another order: rounding differs


def test_echo_when_streaming_and_completion_logprobs_stream(oai):
    whole = complete(oai, prompt="Echo me", max_tokens=5, temperature=0, echo=True)
    text = "".join(
        c.text
        for chunk in complete(
            oai, prompt="Echo me", max_tokens=5, temperature=0, echo=True, stream=True
        )  # fmt: skip
        for c in chunk.choices
    )
    assert text == whole.choices[0].text and text.startswith("Echo me")
    lp = complete(oai, max_tokens=4, temperature=0, logprobs=2).choices[0].logprobs
    chunks = complete(oai, max_tokens=4, temperature=0, logprobs=2, stream=True)
    streamed = [
        v for ch in chunks for c in ch.choices if c.logprobs for v in c.logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_stop_reason_names_what_stopped(oai):
    full = complete(oai, max_tokens=8, temperature=0).choices[0]
    assert full.finish_reason == "length" and full.stop_reason is None
    token = full.token_ids[3]
    by_token = complete(oai, max_tokens=8, temperature=0,
                        extra_body={"stop_token_ids": [token]}).choices[0]  # fmt: skip
    assert by_token.finish_reason == "stop" and by_token.stop_reason == token
    assert by_token.token_ids == full.token_ids[: full.token_ids.index(token) + 1]
    text = complete(oai, prompt="stop here", max_tokens=12, temperature=0).choices[0].text
    needle = text[2:4]
    by_text = complete(oai, prompt="stop here", max_tokens=12, temperature=0,
                       stop=[needle]).choices[0]  # fmt: skip
    assert by_text.finish_reason == "stop" and by_text.stop_reason == needle
    assert by_text.text == text[: text.index(needle)]
    chat = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                       extra_body={"stop_token_ids": [token],
                                                   "ignore_eos": True})  # fmt: skip
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.choices[0].stop_reason in (token, None)


@pytest.mark.parametrize(
    "call, param",
    [
        (lambda c: complete(c, suffix="tail"), "suffix"),
        (lambda c: complete(c, extra_body={"response_format": {"type": "xml"}}), "response_format"),
        (lambda c: complete(c, n=3, best_of=2), "best_of"),
        (lambda c: complete(c, n=1, best_of=2, stream=True), "best_of"),
        (lambda c: complete(c, echo=True, logprobs=1, stream=True), "echo"),
        (lambda c: complete(c, extra_body={"min_tokens": 20}, max_tokens=4), "min_tokens"),
        (lambda c: complete(c, logit_bias={"999999": 1}), "logit_bias"),
        (lambda c: complete(c, logit_bias={"5": 101}), "logit_bias"),
        (lambda c: complete(c, presence_penalty=2.5), "presence_penalty"),
        (lambda c: complete(c, extra_body={"repetition_penalty": 0}), "repetition_penalty"),
        (lambda c: complete(c, logprobs=21), "logprobs"),
        (lambda c: complete(c, prompt=[PROMPT] * 20, n=64, max_tokens=1), "n"),
        (lambda c: c.chat.completions.create(model=MODEL, messages=CHAT,
                                             tools=[{"type": "function",
                                                     "function": {"name": "f"}}]),
         "tool_choice"),  # tools alone mean auto: needs --enable-auto-tool-choice
        (lambda c: complete(c, extra_body={"use_beam_search": True}), "use_beam_search"),
        (lambda c: complete(c, extra_body={"length_penalty": 0.5}), "length_penalty"),
        (lambda c: complete(c, extra_body={"priority": 1}), "priority"),
        (lambda c: complete(c, stream=True, extra_body={"prompt_logprobs": 1}),
         "prompt_logprobs"),
        (lambda c: complete(c, extra_body={"logits_processors": ["x.y"]}), "logits_processors"),
        (lambda c: complete(c, extra_body={"cache_salt": "s"}), "cache_salt"),
        (lambda c: complete(c, extra_body={"spaces_between_special_tokens": False,
                                           "skip_special_tokens": False}),
         "spaces_between_special_tokens"),
        (lambda c: complete(c, stream_options={"include_usage": True}), "stream_options"),
        (lambda c: complete(c, extra_body={"guided_regex": "a", "guided_choice": ["b"]}),
         "guided_choice"),
        (lambda c: complete(c, extra_body={"guided_regex": "("}), "guided_regex"),
        (lambda c: complete(c, extra_body={"truncate_prompt_tokens": 0}),
         "truncate_prompt_tokens"),
        (lambda c: complete(c, extra_body={"allowed_token_ids": [99999]}), "allowed_token_ids"),
        (lambda c: c.chat.completions.create(model=MODEL, messages=CHAT,
                                             extra_body={"continue_final_message": True}),
         "continue_final_message"),  # with add_generation_prompt true
        (lambda c: c.chat.completions.create(model=MODEL, messages=CHAT, top_logprobs=2),
         "top_logprobs"),
        (lambda c: c.chat.completions.create(model=MODEL, messages=CHAT,
                                             response_format={"type": "json_schema",
                                                              "json_schema": {"name": "x"}}),
         "response_format"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(server, oai, call, param):
    requests = server.served.runtime.counters["requests"]
    with pytest.raises(openai.BadRequestError) as e:
        call(oai)
    assert e.value.status_code == 400 and e.value.param == param, e.value.body
    assert e.value.type == "BadRequestError" and param in e.value.message
    assert server.served.runtime.counters["requests"] == requests  # nothing was submitted


def test_tool_choice_none_and_text_format_are_served(oai):
    tools = [{"type": "function", "function": {"name": "f"}}]
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, tools=tools,
                                    tool_choice="none", response_format={"type": "text"})  # fmt: skip
    assert r.choices[0].message.content is not None and not r.choices[0].message.tool_calls
