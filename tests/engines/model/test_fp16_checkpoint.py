"""A float16 checkpoint (many Llama-2 ones are) is served as it is, with no --dtype: the model
computes in float32 or bfloat16 only, so the server runs it in float32 with the weights
upcast exactly and says so in its log; greedy tokens equal transformers' run in float32 on
the same weights."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from driver import make_checkpoint, reference_generate
from serving import greedy, serve

pytest.importorskip("safetensors")

from tokenlake.engines.model.llama import LlamaModel  # noqa: E402

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19]
NUM_NEW = 12


@pytest.fixture(scope="module")
def fp16_path(tmp_path_factory):
    path = make_checkpoint(
        tmp_path_factory.mktemp("fp16") / "llama", "llama", seed=5, dtype=torch.float16
    )
    raw = json.loads((path / "config.json").read_text())
    assert (raw.get("dtype") or raw.get("torch_dtype")) == "float16"
    return path


def test_weights_are_the_checkpoints_upcast_exactly(fp16_path):
    from safetensors.torch import load_file

    stored = load_file(str(fp16_path / "model.safetensors"))
    model = LlamaModel.from_dir(fp16_path)
    assert model.dtype == "float32" and model.shape.dtype == "float32"
    embed = stored["model.embed_tokens.weight"]
    assert embed.dtype == torch.float16
    assert torch.equal(model.embed, embed.float())
    down = stored["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(model.layers[1].down, down.float())


def test_served_without_dtype_matches_transformers_in_float32(fp16_path, caplog):
    with caplog.at_level(logging.INFO, logger="tokenlake.engines.model.llama"):
        served = serve(fp16_path)  # dtype "auto", as `tokenlake serve --model PATH`
    try:
        assert "checkpoint is float16" in caplog.text and "float32" in caplog.text
        assert served.runtime.engine.model.dtype == "float32"
        ours = greedy(served, PROMPT, NUM_NEW)
    finally:
        served.runtime.close()
    ref_tokens, _ = reference_generate(fp16_path, PROMPT, NUM_NEW, dtype=torch.float32)
    assert ours == ref_tokens
