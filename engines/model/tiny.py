"""``tiny-random``: a seeded small Llama checkpoint written locally (no download), with a
byte-level tokenizer and a chat template, so a fresh machine can serve and test a real model."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_RANDOM = "tiny-random"
SPECIAL_TOKENS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_config(vocab_size: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "dtype": "float32",
    }


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 0)]
    )
    return tok


def write_tiny_random(path: str | Path, seed: int = 0) -> Path:
    """Write the checkpoint (``config.json``, ``model.safetensors``, ``tokenizer.json``,
    ``tokenizer_config.json``, ``generation_config.json``) into ``path``; same seed, same bytes."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    cfg = tiny_config(tok.get_vocab_size(with_added_tokens=True))
    gen = torch.Generator().manual_seed(seed)
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    hq, hkv, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]

    def linear(out_dim: int, in_dim: int) -> torch.Tensor:
        # unit-variance activations, so logits are spread out and greedy ties are rare
        return torch.randn((out_dim, in_dim), generator=gen) / in_dim**0.5

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn((h,), generator=gen)

    tensors = {"model.embed_tokens.weight": torch.randn((vocab, h), generator=gen)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": linear(hq * d, h),
            p + "self_attn.k_proj.weight": linear(hkv * d, h),
            p + "self_attn.v_proj.weight": linear(hkv * d, h),
            p + "self_attn.o_proj.weight": linear(h, hq * d),
            p + "mlp.gate_proj.weight": linear(inter, h),
            p + "mlp.up_proj.weight": linear(inter, h),
            p + "mlp.down_proj.weight": linear(h, inter),
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
        })  # fmt: skip
    tensors["model.norm.weight"] = norm()
    tensors["lm_head.weight"] = linear(vocab, h) * 4.0
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save(str(path / "tokenizer.json"))
    tok_cfg = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": cfg["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    gen_cfg = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    return path
