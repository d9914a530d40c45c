"""Checkpoint loading: sharded safetensors, dtypes, refusals naming the field, tokenizer and
chat template against transformers' own tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from driver import make_checkpoint

from tokenlake.engines.model.config import ModelConfig
from tokenlake.engines.model.llama import LlamaModel
from tokenlake.engines.model.tiny import write_tiny_random
from tokenlake.engines.model.tokenizer import Tokenizer
from tokenlake.errors import InvalidArgumentError

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
}


def test_sharded_checkpoint_loads_the_same_weights(checkpoints, tmp_path):
    import transformers

    path = make_checkpoint(tmp_path / "sharded", "llama", seed=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    model.save_pretrained(str(tmp_path / "shards"), max_shard_size="20KB")
    assert (tmp_path / "shards" / "model.safetensors.index.json").is_file()
    one, many = LlamaModel.from_dir(path), LlamaModel.from_dir(tmp_path / "shards")
    assert torch.equal(one.layers[1].qkv, many.layers[1].qkv)
    assert torch.equal(one.lm_head, many.lm_head)


def test_dtype_override_and_float16_served_in_float32(checkpoints, tmp_path):
    model = LlamaModel.from_dir(checkpoints.path("llama"), dtype="bfloat16")
    assert model.embed.dtype == torch.bfloat16 and model.shape.dtype == "bfloat16"
    path = make_checkpoint(tmp_path / "fp16", "llama", dtype=torch.float16)
    assert LlamaModel.from_dir(path).embed.dtype == torch.float32  # auto: no refusal
    assert LlamaModel.from_dir(path, dtype="bfloat16").embed.dtype == torch.bfloat16
    with pytest.raises(InvalidArgumentError, match="dtype"):
        LlamaModel.from_dir(path, dtype="float16")


@pytest.mark.parametrize(
    "change, field",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"model_type": "gpt2", "architectures": []}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters.rope_type"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor"),
        ({"num_key_value_heads": 3, "num_attention_heads": 4}, "num_key_value_heads"),
        ({"pretraining_tp": 2}, "pretraining_tp"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"dtype": "float8_e4m3fn"}, "dtype"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(change, field):
    with pytest.raises(InvalidArgumentError, match=field.replace(".", r"\.")):
        ModelConfig.from_dict({**BASE, **change})


def test_qwen2_sliding_window_refused_and_mistral_window_caps_context():
    with pytest.raises(InvalidArgumentError, match="use_sliding_window"):
        ModelConfig.from_dict(
            {**BASE, "model_type": "qwen2", "architectures": [], "use_sliding_window": True}
        )
    cfg = ModelConfig.from_dict(
        {**BASE, "model_type": "mistral", "architectures": [], "sliding_window": 40}
    )
    assert cfg.max_context_len == 40


def test_old_rope_spelling_equals_the_new(tmp_path):
    old = ModelConfig.from_dict(
        {**BASE, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
         "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}
    )  # fmt: skip
    new = ModelConfig.from_dict(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
         "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}
    )  # fmt: skip
    assert old == new and new.rope.rope_type == "llama3"


def test_missing_or_misshapen_tensors_are_named(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "broken"
    shutil.copytree(checkpoints.path("llama"), path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(InvalidArgumentError, match="model.layers.1.mlp.up_proj.weight"):
        LlamaModel.from_dir(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] += 1
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidArgumentError, match="implies"):
        LlamaModel.from_dir(path)
    with pytest.raises(InvalidArgumentError, match="config.json"):
        LlamaModel.from_dir(tmp_path / "nowhere")


def test_tiny_random_tokenizer_matches_transformers(tmp_path):
    import transformers

    path = write_tiny_random(tmp_path / "tiny")
    ours = Tokenizer.from_dir(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path))
    text = "Hello, wörld! 数字 123\n"
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.decode(ours.encode(text)) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages) == rendered
    assert ours.eos_token_id == 1


def test_tiny_random_is_seeded_and_loads(tmp_path):
    a = LlamaModel.from_dir(write_tiny_random(tmp_path / "a", seed=3))
    b = LlamaModel.from_dir(write_tiny_random(tmp_path / "b", seed=3))
    assert torch.equal(a.layers[0].qkv, b.layers[0].qkv)
    assert a.config.vocab_size == Tokenizer.from_dir(tmp_path / "a").vocab_size
    assert Tokenizer.from_dir(tmp_path / "nothing-here") is None
