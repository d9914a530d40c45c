"""vLLM's sampling parameters against transformers on the same seeded tiny-random checkpoint:
the processed logits equal transformers' own logits processors (repetition penalty,
sequence bias for logit_bias, min new tokens; presence / frequency by the OpenAI formula,
which transformers lacks), and the server's greedy tokens, asked for with the official
``openai`` client, equal ``transformers.generate`` with the same processors."""

from __future__ import annotations

import pytest
import torch

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

from tokenlake.engines.model.logits_processors import process_logits  # noqa: E402
from tokenlake.engines.model.sampling import SamplingParams  # noqa: E402

EOS = 1  # tiny-random's
PROMPT = [0, 5, 6, 7, 5, 6, 7, 5, 6, 7]  # its greedy continuation repeats itself
NUM_NEW = 8


class OpenAIPenalties(transformers.LogitsProcessor):
    """The OpenAI definition, written from its documentation: each token's logit minus
    ``frequency * count + presence * (count > 0)`` over the tokens generated so far."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row, ids in enumerate(input_ids):
            out = ids[self.prompt_len :].tolist()
            for token in set(out):
                scores[row, token] -= self.frequency * out.count(token) + self.presence
        return scores


@pytest.fixture(scope="module")
def hf_model(server):
    path = str(server.served.model_path)
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def sequence_logits(hf_model):
    """The raw next-token logits after ``PROMPT`` + 5 greedy tokens, and those ids."""
    with torch.no_grad():
        ids = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=5, do_sample=False,
                                eos_token_id=None, min_new_tokens=5)  # fmt: skip
        logits = hf_model(ids).logits[0, -1].to(torch.float32)
    return ids[0].tolist(), logits


def processed(logits, params, ids, end_ids=frozenset()):
    return process_logits(logits, params, ids[: len(PROMPT)], ids[len(PROMPT) :], end_ids)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(sequence_logits, penalty):
    ids, logits = sequence_logits
    ref = transformers.RepetitionPenaltyLogitsProcessor(penalty)(
        torch.tensor([ids]), logits[None].clone()
    )[0]
    got = processed(logits, SamplingParams(repetition_penalty=penalty), ids)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    assert not torch.equal(got, logits)  # it did something


def test_logit_bias_equals_sequence_bias(sequence_logits):
    ids, logits = sequence_logits
    bias = ((5, 7.5), (EOS, -100.0), (60, 0.25))
    ref = transformers.SequenceBiasLogitsProcessor([[[t], b] for t, b in bias])(
        torch.tensor([ids]), logits[None].clone()
    )[0]
    got = processed(logits, SamplingParams(logit_bias=bias), ids)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("min_tokens", [3, 5, 6])
def test_min_tokens_equals_min_new_tokens(sequence_logits, min_tokens):
    """5 tokens generated: masked while fewer than ``min_tokens`` (3, 5: not; 6: masked)."""
    ids, logits = sequence_logits
    ref = transformers.MinNewTokensLengthLogitsProcessor(len(PROMPT), min_tokens, [EOS, 9])(
        torch.tensor([ids]), logits[None].clone()
    )[0]
    got = processed(logits, SamplingParams(min_tokens=min_tokens), ids, frozenset({EOS, 9}))
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert bool(torch.isinf(got[EOS])) == (min_tokens > 5)


def test_presence_frequency_and_their_order_equal_the_formula(sequence_logits):
    """All four at once, composed in vLLM's order from the independent references."""
    ids, logits = sequence_logits
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4,
                            repetition_penalty=1.2, logit_bias=((ids[-1], 3.0), (70, -2.0)),
                            min_tokens=9)  # fmt: skip
    chain = [
        transformers.MinNewTokensLengthLogitsProcessor(len(PROMPT), 9, [EOS]),
        transformers.SequenceBiasLogitsProcessor([[[ids[-1]], 3.0], [[70], -2.0]]),
        transformers.RepetitionPenaltyLogitsProcessor(1.2),
        OpenAIPenalties(len(PROMPT), 0.7, -0.4),
    ]
    ref = transformers.LogitsProcessorList(chain)(torch.tensor([ids]), logits[None].clone())[0]
    got = processed(logits, params, ids, frozenset({EOS}))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def server_greedy(oai, **extra):
    r = oai.completions.create(
        model="tiny-random", prompt=PROMPT, max_tokens=NUM_NEW, temperature=0,
        extra_body={"return_token_ids": True, **extra},
    )  # fmt: skip
    return r.choices[0]


def hf_greedy(model, max_new=NUM_NEW, processors=(), **kwargs):
    kwargs.setdefault("eos_token_id", None)
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=max_new, do_sample=False,
                             logits_processor=transformers.LogitsProcessorList(processors),
                             **kwargs)  # fmt: skip
    return out[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize(
    "extra, hf_kwargs, processors",
    [
        ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}, ()),
        ({"repetition_penalty": 0.6}, {"repetition_penalty": 0.6}, ()),
        ({"presence_penalty": 1.5}, {}, (OpenAIPenalties(len(PROMPT), 1.5, 0.0),)),
        ({"frequency_penalty": 2.0}, {}, (OpenAIPenalties(len(PROMPT), 0.0, 2.0),)),
        ({"frequency_penalty": 0.8, "presence_penalty": -0.3}, {},
         (OpenAIPenalties(len(PROMPT), -0.3, 0.8),)),
    ],
)  # fmt: skip
def test_server_greedy_with_penalties_equals_transformers(oai, hf_model, extra, hf_kwargs,
                                                          processors):  # fmt: skip
    got = server_greedy(oai, ignore_eos=True, **extra)
    assert got.token_ids == hf_greedy(hf_model, processors=processors, **hf_kwargs)
    plain = server_greedy(oai, ignore_eos=True)
    assert got.token_ids != plain.token_ids  # the parameter changed the answer


def test_server_logit_bias_equals_sequence_bias(oai, hf_model):
    plain = server_greedy(oai, ignore_eos=True).token_ids
    bias = {plain[0]: -100.0, plain[1]: 4.0, 77: 2.5}
    got = server_greedy(oai, ignore_eos=True, logit_bias={str(t): b for t, b in bias.items()})
    ref = hf_greedy(hf_model, sequence_bias=[[[t], b] for t, b in bias.items()])
    assert got.token_ids == ref and got.token_ids[0] != plain[0]


def test_server_min_tokens_equals_min_new_tokens(oai, hf_model):
    """EOS made likely with a bias: without min_tokens the answer is EOS at once; with it,
    EOS is masked for 4 tokens, as transformers' min_new_tokens."""
    bias = {str(EOS): 100.0}
    first = server_greedy(oai, logit_bias=bias)
    assert first.token_ids == [EOS] and first.finish_reason == "stop"
    got = server_greedy(oai, logit_bias=bias, min_tokens=4)
    ref = hf_greedy(hf_model, sequence_bias=[[[EOS], 100.0]], min_new_tokens=4, eos_token_id=EOS)
    assert got.token_ids == ref and len(ref) == 5 and ref[-1] == EOS
    assert got.finish_reason == "stop" and got.stop_reason is None  # EOS: no stop_reason


def test_server_logprobs_are_the_raw_model_logprobs(oai, hf_model):
    """vLLM V1's default: log-softmax of the raw logits, even with a penalty applied."""
    r = oai.completions.create(
        model="tiny-random", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
        extra_body={"return_token_ids": True, "ignore_eos": True, "repetition_penalty": 1.5},
    )  # fmt: skip
    choice = r.choices[0]
    ids = PROMPT + choice.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    for step, token in enumerate(choice.token_ids):
        row = ref[len(PROMPT) - 1 + step]
        assert choice.logprobs.token_logprobs[step] == pytest.approx(float(row[token]), abs=1e-4)
        # keys are token texts: byte pieces of one character all read '\ufffd' and merge
        want = [*torch.topk(row, 3).values.tolist(), float(row[token])]
        top = choice.logprobs.top_logprobs[step]
        assert max(top.values()) == pytest.approx(want[0], abs=1e-4)
        assert all(min(abs(v - w) for w in want) < 1e-4 for v in top.values()), top
    assert len(choice.logprobs.tokens) == 5 and choice.logprobs.text_offset[0] == 0
