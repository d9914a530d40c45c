"""Test helpers: seeded random checkpoints made with ``transformers`` (the oracle), and a
greedy generation loop that drives the pool directly, so tests choose chunk lengths (not
aligned to segments), DoPs and how prefill chunks and decode steps share an iteration."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import tokenlake as tl
from tokenlake.engines.model.engine import ModelEngine

ARCH_CONFIGS = {
    "llama": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "llama3": dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=True,
    ),
    "llama-linear": dict(
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        attention_bias=True,
    ),
    "mistral": dict(sliding_window=None),
    "qwen2": dict(tie_word_embeddings=True),
}


def make_checkpoint(
    path: Path, arch: str = "llama", seed: int = 0, dtype=torch.float32, **overrides
) -> Path:
    """A seeded random tiny model of ``arch`` saved with ``save_pretrained``."""
    import transformers

    cls_cfg, cls_model = {
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }.get(arch, (transformers.LlamaConfig, transformers.LlamaForCausalLM))
    kwargs = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,  # spread-out logits: greedy ties would make the oracle moot
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    kwargs.update(ARCH_CONFIGS[arch])
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**kwargs)).to(dtype).eval()
    model.save_pretrained(str(path))
    return path


def reference_generate(path: Path, prompt, num_new: int, dtype=torch.float32):
    """``transformers``' own greedy generation: ``(token ids, [num_new, vocab] logits)``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt)]),
            max_new_tokens=num_new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.stack([lg[0].float() for lg in out.logits])


@dataclass(eq=False)
class _Req:
    rid: str
    tokens: list
    prompt_len: int
    num_new: int
    stored: int = 0
    logits: list = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.prompt_len >= self.num_new


def generate(
    pool: tl.Pool,
    engine: ModelEngine,
    prompts: dict,
    num_new: int,
    chunk_len: int = 10**9,
    dop: int = 1,
    mixed: bool = True,
) -> dict:
    """Greedy generation of ``num_new`` tokens for every prompt, all requests at once.

    Prefill chunks are ``chunk_len`` tokens (any length); prefill chunks run as one batch of
    ``dop`` sub-batches; decode steps join that batch when ``mixed``, else run as a batch of
    their own. Returns ``{rid: (new token ids, [num_new, vocab] logits)}``; requests are
    finished in the pool (their tails stay cached).
    """
    tree = pool.get_prefix_tree()
    reqs = []
    for rid, prompt in prompts.items():
        start = min(tree.match(np.asarray(prompt, dtype=np.int32)).num_tokens, len(prompt) - 1)
        reqs.append(_Req(rid, list(prompt), len(prompt), num_new, start))
    while any(not r.done for r in reqs):
        prefill, decode = [], []
        for r in reqs:
            if r.done:
                continue
            ids = np.asarray(r.tokens, dtype=np.int32)
            if r.stored < r.prompt_len:
                end = min(r.stored + chunk_len, r.prompt_len)
                prefill.append(tl.Chunk(r.rid, ids[: r.prompt_len], r.stored, end))
            else:
                decode.append(tl.Chunk(r.rid, ids, r.stored))
        if mixed or not prefill or not decode:
            batches = [prefill + decode]
            rows = sum(c.num_new_tokens for c in batches[0])
            dops = [min(dop, rows)]
        else:
            batches = [prefill, decode]
            dops = [
                min(dop, sum(c.num_new_tokens for c in prefill), pool.config.num_instances - 1),
                1,
            ]
        plans = pool.gen_plans(batches, dops)
        chunks = {c.request_id: c for b in batches for c in b}
        logits = engine.run(plans, chunks)
        pool.commit(plans)
        pool.check_invariants()
        by_id = {r.rid: r for r in reqs}
        for rid, c in chunks.items():
            r = by_id[rid]
            r.stored = c.end
            if rid in logits:
                r.logits.append(logits[rid])
                r.tokens.append(int(torch.argmax(logits[rid])))
                if r.done:
                    pool.finish(rid)
    return {r.rid: (r.tokens[r.prompt_len :], torch.stack(r.logits)) for r in reqs}
