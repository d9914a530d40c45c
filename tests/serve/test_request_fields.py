"""vLLM's request fields, each against an independent reference, with the official
``openai`` client on the shared tiny-random server: ``min_p`` 1 samples the argmax,
``allowed_token_ids`` / ``bad_words`` bound the tokens, ``truncate_prompt_tokens`` keeps
the prompt's tail, ``skip_special_tokens`` and ``include_stop_str_in_output`` decode as
the tokenizer does, ``return_tokens_as_token_ids`` and ``stream_options`` shape the answer
as vLLM documents; chat prompts equal ``transformers``' ``apply_chat_template`` with the
request's ``chat_template``, its kwargs, ``continue_final_message`` and text parts joined
by a newline; ``echo``; a field nobody knows is logged by name."""

from __future__ import annotations

import logging

import pytest

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

MODEL = "tiny-random"
PROMPT = [0, 9, 10, 11, 12, 13]
CHAT = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def hf(server):
    return transformers.AutoTokenizer.from_pretrained(str(server.served.model_path))


def complete(oai, prompt=PROMPT, **kwargs):
    extra = {"return_token_ids": True, "ignore_eos": True, **kwargs.pop("extra_body", {})}
    return oai.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **kwargs)


def chat(oai, messages, **extra):
    extra = {"return_token_ids": True, **extra}
    return oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                       temperature=0, extra_body=extra)  # fmt: skip


def test_min_p_one_keeps_only_the_most_likely_token(oai):
    greedy = complete(oai, max_tokens=8, temperature=0).choices[0].token_ids
    sampled = complete(oai, max_tokens=8, temperature=1.0, seed=3).choices[0].token_ids
    narrowed = complete(oai, max_tokens=8, temperature=1.0, seed=3, extra_body={"min_p": 1.0})
    assert narrowed.choices[0].token_ids == greedy != sampled


def test_allowed_token_ids_and_bad_words_bound_the_output(oai, server):
    allowed = [20, 30, 40, 50]
    r = complete(oai, max_tokens=12, temperature=1.0, seed=1,
                 extra_body={"allowed_token_ids": allowed})  # fmt: skip
    assert set(r.choices[0].token_ids) <= set(allowed)
    tok = server.served.tokenizer
    letters = {"allowed_token_ids": [tok.encode(ch, add_special_tokens=False)[0]
                                     for ch in "abcdefgh"]}  # fmt: skip
    greedy = complete(oai, max_tokens=12, temperature=0, extra_body=letters).choices[0]
    word = greedy.text[2:4]  # two letters (two tokens) the greedy output writes
    ids = tok.encode(word, add_special_tokens=False)
    banned = complete(oai, max_tokens=12, temperature=0,
                      extra_body={**letters, "bad_words": [word]}).choices[0]  # fmt: skip
    out = banned.token_ids
    assert len(ids) == 2 and word not in banned.text and out != greedy.token_ids
    assert all(out[i : i + 2] != ids for i in range(len(out)))
    # up to the ban the output is the greedy one: only the word's last token is masked
    first = greedy.text.index(word)
    assert banned.text[: first + 1] == greedy.text[: first + 1]


def test_truncate_prompt_tokens_keeps_the_tail(oai):
    whole = complete(oai, max_tokens=4, temperature=0, extra_body={"truncate_prompt_tokens": 3})
    tail = complete(oai, prompt=PROMPT[-3:], max_tokens=4, temperature=0)
    assert whole.choices[0].prompt_token_ids == PROMPT[-3:]
    assert whole.usage.prompt_tokens == 3
    assert whole.choices[0].token_ids == tail.choices[0].token_ids


def test_skip_special_tokens_decodes_as_the_tokenizer(oai, server):
    tok = server.served.tokenizer
    special = [2, 3]  # <|system|>, <|user|>
    kept = complete(oai, max_tokens=4, temperature=1.0, seed=2,
                    extra_body={"allowed_token_ids": special, "skip_special_tokens": False})  # fmt: skip
    dropped = complete(oai, max_tokens=4, temperature=1.0, seed=2,
                       extra_body={"allowed_token_ids": special})  # fmt: skip
    ids = kept.choices[0].token_ids
    assert ids == dropped.choices[0].token_ids
    assert kept.choices[0].text == tok.decode(ids, skip_special_tokens=False) != ""
    assert dropped.choices[0].text == ""


def test_include_stop_str_in_output(oai, server):
    tok = server.served.tokenizer
    greedy = complete(oai, max_tokens=10, temperature=0).choices[0]
    stop = greedy.text[3:5]
    cut = complete(oai, max_tokens=10, temperature=0, stop=[stop]).choices[0]
    kept = complete(oai, max_tokens=10, temperature=0, stop=[stop],
                    extra_body={"include_stop_str_in_output": True}).choices[0]  # fmt: skip
    assert cut.text == greedy.text[: greedy.text.index(stop)]
    assert kept.text == cut.text + stop and kept.stop_reason == stop
    # a stop token id ends the text before it, unless included (vLLM's detokenizer)
    token = greedy.token_ids[4]
    ended = complete(oai, max_tokens=10, temperature=0, extra_body={"stop_token_ids": [token]})
    with_it = complete(oai, max_tokens=10, temperature=0, extra_body={
        "stop_token_ids": [token], "include_stop_str_in_output": True})  # fmt: skip
    ids = ended.choices[0].token_ids
    assert ids[-1] == token and ended.choices[0].stop_reason == token
    assert ended.choices[0].text == tok.decode(ids[:-1])
    assert with_it.choices[0].text == tok.decode(ids)


def test_return_tokens_as_token_ids_in_logprobs(oai):
    r = complete(oai, max_tokens=4, temperature=0, logprobs=2,
                 extra_body={"return_tokens_as_token_ids": True})  # fmt: skip
    c = r.choices[0]
    assert c.logprobs.tokens == [f"token_id:{t}" for t in c.token_ids]
    assert all(k.startswith("token_id:") for top in c.logprobs.top_logprobs for k in top)
    ch = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                     logprobs=True, top_logprobs=1,
                                     extra_body={"return_tokens_as_token_ids": True})  # fmt: skip
    assert all(t.token.startswith("token_id:") for t in ch.choices[0].logprobs.content)


def test_stream_options_usage_and_continuous_usage(oai):
    chunks = list(complete(oai, max_tokens=5, temperature=0, stream=True, stream_options={}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5  # vLLM: on
    assert all(c.usage is None for c in chunks[:-1])
    chunks = list(complete(oai, max_tokens=5, temperature=0, stream=True,
                           stream_options={"include_usage": True,
                                           "continuous_usage_stats": True}))  # fmt: skip
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(c.usage.prompt_tokens == len(PROMPT) for c in chunks)
    none = list(complete(oai, max_tokens=2, temperature=0, stream=True,
                         stream_options={"include_usage": False}))  # fmt: skip
    assert all(c.usage is None and c.choices for c in none)


def test_chat_template_and_kwargs_render_as_transformers(oai, hf):
    template = ("{% for m in messages %}[{{ m['role'] }}|{{ greeting }}]{{ m['content'] }}"
                "{% endfor %}{% if add_generation_prompt %}>{% endif %}")  # fmt: skip
    r = chat(oai, CHAT, chat_template=template, chat_template_kwargs={"greeting": "hey"})
    want = hf.apply_chat_template(CHAT, chat_template=template, greeting="hey",
                                  add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert r.choices[0].prompt_token_ids == hf.encode(want, add_special_tokens=False)
    bare = chat(oai, CHAT, add_generation_prompt=False)
    want = hf.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=False)
    assert bare.choices[0].prompt_token_ids == hf.encode(want, add_special_tokens=False)
    special = chat(oai, CHAT, add_special_tokens=True).choices[0].prompt_token_ids
    want = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert special == hf.encode(want, add_special_tokens=True)  # <s> twice, as asked


def test_continue_final_message_and_echo(oai, hf):
    messages = [*CHAT, {"role": "assistant", "content": "Hi! The answer is"}]
    r = chat(oai, messages, continue_final_message=True, add_generation_prompt=False, echo=True)
    want = hf.apply_chat_template(messages, continue_final_message=True,
                                  add_generation_prompt=False, tokenize=False)  # fmt: skip
    c = r.choices[0]
    assert c.prompt_token_ids == hf.encode(want, add_special_tokens=False)
    assert c.message.role == "assistant"
    assert c.message.content.startswith("Hi! The answer is")  # echo: the last message first
    plain = chat(oai, messages, continue_final_message=True, add_generation_prompt=False)
    assert c.message.content == "Hi! The answer is" + plain.choices[0].message.content


def test_text_parts_are_joined_with_a_newline(oai, hf):
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"},
                                          {"type": "text", "text": "two"}]}]  # fmt: skip
    r = chat(oai, parts)
    want = hf.apply_chat_template([{"role": "user", "content": "one\ntwo"}],
                                  add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert r.choices[0].prompt_token_ids == hf.encode(want, add_special_tokens=False)


def test_unknown_fields_are_logged_by_name(oai, caplog):
    with caplog.at_level(logging.WARNING, logger="tokenlake.serve.api.protocol"):
        complete(oai, max_tokens=1, extra_body={"made_up_field": 1, "another_one": "x"})
    logged = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert logged and "made_up_field" in logged[-1] and "another_one" in logged[-1]


def test_prompt_logprobs_equal_transformers(oai, server):
    """Each prompt token's log-probability given the tokens before it, its rank, and the
    top tokens, as ``transformers``' forward of the prompt gives them (vLLM's shape: the
    first position ``None``, then ``{token id: {logprob, rank, decoded_token}}``)."""
    import torch

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(server.served.model_path)
    ).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    r = complete(oai, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2})
    got = r.choices[0].prompt_logprobs
    assert len(got) == len(PROMPT) and got[0] is None
    for i, token in enumerate(PROMPT[1:]):
        row = ref[i]
        entry = got[i + 1][str(token)]
        assert entry["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        assert entry["rank"] == int((row > row[token]).sum()) + 1
        top = torch.topk(row, 2).indices.tolist()
        assert set(got[i + 1]) == {str(token), *map(str, top)}
        assert list(got[i + 1])[0] == str(token)  # the prompt's own token first
    chat = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                       extra_body={"prompt_logprobs": 0})  # fmt: skip
    lps = chat.model_extra["prompt_logprobs"]
    assert lps[0] is None and all(len(p) == 1 for p in lps[1:])


def test_echo_with_logprobs_leads_with_the_prompts(oai):
    """vLLM's echo with logprobs: the prompt's tokens first (the first without a logprob),
    their logprobs those of ``prompt_logprobs``, then the generated tokens'."""
    both = complete(oai, max_tokens=3, temperature=0, logprobs=1, echo=True,
                    extra_body={"return_tokens_as_token_ids": True}).choices[0]  # fmt: skip
    alone = complete(oai, max_tokens=3, temperature=0, logprobs=1,
                     extra_body={"prompt_logprobs": 1}).choices[0]  # fmt: skip
    n = len(PROMPT)
    lp = both.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in PROMPT + alone.token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [alone.prompt_logprobs[i][str(t)]["logprob"] for i, t in enumerate(PROMPT) if i]
    assert lp.token_logprobs[1:n] == pytest.approx(want, abs=1e-6)
    assert lp.token_logprobs[n:] == pytest.approx(alone.logprobs.token_logprobs, abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset)
