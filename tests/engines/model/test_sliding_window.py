"""A Mistral checkpoint with ``sliding_window`` shorter than ``max_position_embeddings``:
prefix attention reads every cached segment (it does not apply the window), so the server
caps ``max_model_len`` at the window, says so in its log, refuses a longer one naming the
window, and inside the window its greedy tokens equal transformers'."""

from __future__ import annotations

import logging

import pytest
import torch
from driver import make_checkpoint, reference_generate
from serving import greedy, serve

from tokenlake.errors import InvalidArgumentError

WINDOW = 40
MAX_POSITIONS = 1024


@pytest.fixture(scope="module")
def mistral_path(tmp_path_factory):
    return make_checkpoint(
        tmp_path_factory.mktemp("swa") / "mistral", "mistral", seed=9,
        sliding_window=WINDOW, max_position_embeddings=MAX_POSITIONS,
    )  # fmt: skip


def test_max_model_len_capped_at_the_window_and_logged(mistral_path, caplog):
    with caplog.at_level(logging.WARNING, logger="tokenlake.serve.build"):
        served = serve(mistral_path)
    try:
        assert served.runtime.max_model_len == WINDOW
        (line,) = [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()]
        assert f"capped at {WINDOW}" in line and f"max_position_embeddings={MAX_POSITIONS}" in line
        assert f"sliding_window={WINDOW}" in line and "does not apply the window" in line
        # within the window: the tokens transformers' Mistral generates
        prompt = [(13 * i + 5) % 97 for i in range(WINDOW - 12)]
        ours = greedy(served, prompt, 12)
        ref, _ = reference_generate(mistral_path, prompt, 12, dtype=torch.float32)
        assert ours == ref
        # past the window: refused at submit, naming the limit
        with pytest.raises(InvalidArgumentError, match=f"maximum context length is {WINDOW}"):
            greedy(served, prompt, 13)
    finally:
        served.runtime.close()


def test_a_longer_max_model_len_is_refused_naming_the_window(mistral_path):
    with pytest.raises(InvalidArgumentError, match=r"max_model_len: 41 exceeds 40.*sliding_window"):
        serve(mistral_path, max_model_len=WINDOW + 1)


def test_no_window_no_cap(tmp_path, caplog):
    path = make_checkpoint(tmp_path / "mistral", "mistral", seed=9, max_position_embeddings=96)
    with caplog.at_level(logging.WARNING, logger="tokenlake.serve.build"):
        served = serve(path)
    try:
        assert served.runtime.max_model_len == 96
        assert "max_model_len" not in caplog.text
    finally:
        served.runtime.close()
