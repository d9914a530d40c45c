"""vLLM's token filters against ``transformers``' own processors on random logits:
``min_p`` (after temperature) keeps exactly the tokens ``MinPLogitsWarper`` keeps,
``bad_words`` masks exactly what ``NoBadWordsLogitsProcessor`` masks given the output so
far (vLLM looks at the output only), ``allowed_token_ids`` keeps exactly its tokens (as
``SuppressTokensLogitsProcessor`` suppressing every other one), and all of them compose
in vLLM's order (allowed ids and bad words first, then bias and penalties)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenlake.engines.model.logits_processors import process_logits  # noqa: E402
from tokenlake.engines.model.sampling import SamplingParams, sample, sampling_probs  # noqa: E402
from tokenlake.errors import InvalidArgumentError  # noqa: E402

VOCAB = 64


@pytest.mark.parametrize("min_p,temperature", [(0.05, 1.0), (0.3, 0.7), (0.9, 1.5), (1.0, 1.0)])
def test_min_p_keeps_what_transformers_keeps(min_p, temperature):
    gen = torch.Generator().manual_seed(int(min_p * 100))
    for _ in range(5):
        logits = torch.randn(VOCAB, generator=gen) * 3
        probs = sampling_probs(logits, SamplingParams(temperature=temperature, min_p=min_p))
        warped = transformers.TemperatureLogitsWarper(temperature)(None, logits[None].clone())
        warped = transformers.MinPLogitsWarper(min_p)(None, warped)
        assert torch.equal(probs > 0, torch.isfinite(warped[0]))
    # 0.9 gave the same tokens as no min_p before it was implemented: now it narrows
    logits = torch.tensor([2.0, 1.9, -3.0] + [0.0] * (VOCAB - 3))
    kept = sampling_probs(logits, SamplingParams(temperature=1.0, min_p=0.9)) > 0
    assert kept.nonzero().flatten().tolist() == [0, 1]


def test_bad_words_mask_what_transformers_masks():
    bad = ((5,), (7, 8), (9, 10, 11))
    params = SamplingParams(bad_words_token_ids=bad)
    processor = transformers.NoBadWordsLogitsProcessor([list(w) for w in bad], eos_token_id=1)
    for output in ([], [7], [3, 9, 10], [9, 10, 4], [7, 9, 10], [8, 7]):
        logits = torch.randn(VOCAB)
        ours = process_logits(logits, params, prompt_ids=[2, 3], output_ids=output)
        ids = torch.tensor([output or [0]])  # transformers looks at its input ids: the output
        theirs = processor(ids if output else ids[:, :0], logits[None].clone())[0]
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs)), output
    masked = process_logits(torch.zeros(VOCAB), params, [2], [3, 9, 10])
    assert torch.isinf(masked[[5, 11]]).all() and torch.isfinite(masked[8])


def test_allowed_token_ids_is_the_only_choice_and_composes_with_bias():
    allowed = (3, 17, 40)
    suppress = [t for t in range(VOCAB) if t not in allowed]
    processor = transformers.SuppressTokensLogitsProcessor(suppress)
    logits = torch.randn(VOCAB)
    params = SamplingParams(allowed_token_ids=allowed, logit_bias=((17, 0.5), (20, 50.0)))
    ours = process_logits(logits, params, [1], [])
    theirs = processor(torch.tensor([[1]]), logits[None].clone())[0]
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    assert ours[17] == pytest.approx(float(logits[17]) + 0.5)  # bias after the mask
    gen = torch.Generator().manual_seed(0)
    drawn = {sample(ours, SamplingParams(temperature=1.0), gen) for _ in range(200)}
    assert drawn <= set(allowed) and len(drawn) > 1


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"allowed_token_ids": ()}, "allowed_token_ids"),
        ({"allowed_token_ids": (-1,)}, "allowed_token_ids"),
        ({"bad_words_token_ids": ((),)}, "bad_words"),
    ],
)
def test_bad_values_are_refused_by_name(kwargs, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        SamplingParams(**kwargs)
