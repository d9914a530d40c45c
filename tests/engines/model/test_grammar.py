"""Structured outputs: the batched masks of :class:`GrammarMasks` equal xgrammar's own
matcher, filled alone, at every step of random walks through five kinds of grammar at once
(a JSON schema, any JSON, a regex, a choice, an EBNF grammar) on tiny-random's byte-level
vocabulary; what each walk produced matches its grammar (parsed and validated by
``json`` / ``jsonschema`` / ``re``). xgrammar's JSON strings admit raw control
characters other than newlines (as vLLM's and SGLang's outputs do), which Python's
``json`` parses with ``strict=False``."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

xgrammar = pytest.importorskip("xgrammar")
transformers = pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")

from tokenlake.engines.model.grammar import (  # noqa: E402
    GrammarCompiler,
    GrammarMasks,
    GrammarSpec,
    allowed_ids,
    new_matcher,
)
from tokenlake.engines.model.tiny import write_tiny_random  # noqa: E402
from tokenlake.errors import InvalidArgumentError  # noqa: E402

EOS = 1
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
SPECS = {
    "json": GrammarSpec("json", json.dumps(SCHEMA)),
    "json_object": GrammarSpec("json_object"),
    "regex": GrammarSpec("regex", r"[a-c]{2,4}-\d{1,3}"),
    "choice": GrammarSpec("choice", json.dumps(["yes", "no", 'say "maybe"'])),
    "grammar": GrammarSpec("grammar", 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),
}


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    path = write_tiny_random(tmp_path_factory.mktemp("tiny"))
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def compiler(hf_tokenizer):
    return GrammarCompiler(hf_tokenizer, len(hf_tokenizer), [EOS])


def check_output(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text, strict=False), SCHEMA)
    elif kind == "json_object":
        json.loads(text, strict=False)
    elif kind == "regex":
        assert re.fullmatch(SPECS["regex"].value, text), text
    elif kind == "choice":
        assert text in json.loads(SPECS["choice"].value)
    else:
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_masks_equal_xgrammars_own_matcher_step_by_step(compiler, hf_tokenizer, seed):
    rng = random.Random(seed)
    vocab = compiler.vocab_size
    compiled = {k: compiler.compile(s) for k, s in SPECS.items()}
    ours = {k: new_matcher(c) for k, c in compiled.items()}  # masked together, batched
    theirs = {k: xgrammar.GrammarMatcher(c) for k, c in compiled.items()}  # alone
    outputs = {k: [] for k in SPECS}
    masks = GrammarMasks(vocab)
    for _ in range(200):
        live = [k for k in SPECS if not ours[k].is_terminated()]
        if not live:
            break
        logits = masks.apply([torch.randn(vocab) for _ in live], [ours[k] for k in live])
        for row, k in enumerate(live):
            alone = xgrammar.allocate_token_bitmask(1, vocab)
            theirs[k].fill_next_token_bitmask(alone)
            expected = allowed_ids(alone[0], vocab)
            assert torch.equal(torch.isfinite(logits[row]), expected), k
            # a walk that favours closing and skips whitespace when it can (JSON would
            # otherwise rarely end): EOS when allowed, else any allowed token
            allowed = expected.nonzero().flatten().tolist()
            texts = {t: hf_tokenizer.decode([t]) for t in allowed}
            closing = [t for t in allowed if texts[t] in '"}])']
            solid = [t for t in allowed if texts[t].strip()] or allowed
            token = rng.choice(closing if closing and rng.random() < 0.3 else solid)
            if EOS in allowed:
                token = EOS
            assert ours[k].accept_token(token) and theirs[k].accept_token(token)
            if token != EOS:
                outputs[k].append(token)
    for k in SPECS:
        assert ours[k].is_terminated(), f"{k} did not finish: {hf_tokenizer.decode(outputs[k])}"
        check_output(k, hf_tokenizer.decode(outputs[k]))


def test_bad_grammars_are_refused_by_field(compiler):
    for spec, needle in [
        (GrammarSpec("json", "{not json", field="guided_json"), "guided_json"),
        (GrammarSpec("regex", "(", field="guided_regex"), "guided_regex"),
        (GrammarSpec("grammar", "root ::= ", field="guided_grammar"), "guided_grammar"),
        (GrammarSpec("choice", "[]", field="guided_choice"), "guided_choice"),
    ]:
        with pytest.raises(InvalidArgumentError, match=needle):
            compiler.compile(spec)
    with pytest.raises(InvalidArgumentError, match="structured_outputs"):
        GrammarSpec("xml", "")
