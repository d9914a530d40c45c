"""The architecture of a Llama-family checkpoint, read from its ``config.json``.

Supported: ``LlamaForCausalLM`` (Llama 2/3), ``MistralForCausalLM``, ``Qwen2ForCausalLM``;
GQA, RMSNorm, SwiGLU (``hidden_act`` ``silu``), tied or untied embeddings, RoPE of type
``default``, ``linear`` or ``llama3`` (both the transformers 5 ``rope_parameters`` and the
older ``rope_theta`` + ``rope_scaling`` spellings). Anything else is refused with a
:class:`~tokenlake.InvalidArgumentError` naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenlake.config import ModelShape
from tokenlake.errors import InvalidArgumentError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16")  # what the model computes and stores KV in
# a checkpoint's dtype -> what dtype "auto" serves it in. The model and prefix attention compute
# in float32 or bfloat16 only (the C++ CPU kernel has no float16 KV), and float32 holds every
# float16 value exactly, so float16 weights are upcast: the same model, not a lossy cast to
# bfloat16 (vLLM on CPU upcasts float16 too)
AUTO_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters (``rope_type`` one of :data:`ROPE_TYPES`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """What the model engine needs to know about a checkpoint (frozen, validated)."""

    model_type: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    dtype: str = "float32"  # the checkpoint's dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # Mistral: sequences are capped to it (see max_context_len)

    @property
    def auto_dtype(self) -> str:
        """The dtype ``--dtype auto`` serves this checkpoint in (:data:`AUTO_DTYPES`)."""
        return AUTO_DTYPES[self.dtype]

    @property
    def max_context_len(self) -> int:
        """Longest sequence served exactly. Prefix attention reads every cached segment (it
        has no window), so a sequence longer than a sliding window would attend to tokens
        the model never saw together: sequences are capped at the window."""
        return min(
            self.max_position_embeddings, self.sliding_window or self.max_position_embeddings
        )

    def shape(self, dtype: str | None = None) -> ModelShape:
        """The attention shape the pool stores (KV in ``dtype``, default the checkpoint's)."""
        return ModelShape(
            self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_dim, dtype or self.dtype
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise InvalidArgumentError(f"model: no config.json in {str(path)!r}")
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise InvalidArgumentError(f"model: cannot read {file}: {e}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        """Parse a Hugging Face ``config.json`` dict; raises naming the offending field."""
        if not isinstance(raw, dict):
            raise InvalidArgumentError("config.json: expected a JSON object")
        archs = raw.get("architectures") or []
        model_type = raw.get("model_type")
        by_arch = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
        if archs and not by_arch:
            raise InvalidArgumentError(
                f"config.json architectures: {archs!r} not supported; expected one of "
                f"{sorted(ARCHITECTURES)}"
            )
        if model_type not in ARCHITECTURES.values():
            raise InvalidArgumentError(
                f"config.json model_type: {model_type!r} not supported; expected one of "
                f"{sorted(ARCHITECTURES.values())}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise InvalidArgumentError(f"config.json hidden_act: {act!r} not supported (silu)")
        num_q = _int(raw, "num_attention_heads")
        hidden = _int(raw, "hidden_size")
        head_dim = raw.get("head_dim") or hidden // num_q
        num_kv = raw.get("num_key_value_heads") or num_q
        max_pos = _int(raw, "max_position_embeddings")
        _check_unsupported(raw, model_type, max_pos)
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(raw.get("attention_bias", False))
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        if dtype not in AUTO_DTYPES:
            raise InvalidArgumentError(
                f"config.json dtype: {dtype!r} not supported; expected one of {sorted(AUTO_DTYPES)}"
            )
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(raw, "intermediate_size"),
            num_layers=_int(raw, "num_hidden_layers"),
            num_q_heads=num_q,
            num_kv_heads=_int({"num_key_value_heads": num_kv}, "num_key_value_heads"),
            head_dim=_int({"head_dim": head_dim}, "head_dim"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            rope=_rope(raw, max_pos),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            dtype=dtype,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            sliding_window=raw.get("sliding_window") if model_type == "mistral" else None,
        )


def _int(raw: dict, name: str) -> int:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgumentError(f"config.json {name}: expected a positive int, got {value!r}")
    return value


def _check_unsupported(raw: dict, model_type: str, max_pos: int) -> None:
    if raw.get("pretraining_tp", 1) != 1:
        raise InvalidArgumentError(
            f"config.json pretraining_tp: {raw['pretraining_tp']!r} not supported (1)"
        )
    if model_type == "qwen2" and raw.get("use_sliding_window"):
        raise InvalidArgumentError("config.json use_sliding_window: true is not supported")
    window = raw.get("sliding_window") if model_type == "mistral" else None
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise InvalidArgumentError(
            f"config.json sliding_window: expected an int >= 1, got {window!r}"
        )
    num_q, num_kv = raw.get("num_attention_heads"), raw.get("num_key_value_heads") or 0
    if num_kv and isinstance(num_q, int) and num_q % num_kv:
        raise InvalidArgumentError(
            f"config.json num_key_value_heads: {num_kv} does not divide num_attention_heads={num_q}"
        )


def _rope(raw: dict, max_pos: int) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    where = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    if any(isinstance(v, dict) for v in params.values()):
        raise InvalidArgumentError(f"config.json {where}: per-layer RoPE is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise InvalidArgumentError(
            f"config.json {where}.rope_type: {rope_type!r} not supported; expected one of "
            f"{ROPE_TYPES}"
        )
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise InvalidArgumentError("config.json partial_rotary_factor: only 1.0 is supported")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return RopeConfig(theta)
    factor = params.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise InvalidArgumentError(f"config.json {where}.factor: expected > 0, got {factor!r}")
    if rope_type == "linear":
        return RopeConfig(theta, rope_type, float(factor))
    low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
    if not all(isinstance(x, (int, float)) for x in (low, high)) or not high > low:
        raise InvalidArgumentError(
            f"config.json {where}: llama3 needs low_freq_factor < high_freq_factor, got "
            f"{low!r}, {high!r}"
        )
    orig = params.get("original_max_position_embeddings", max_pos)
    return RopeConfig(theta, rope_type, float(factor), float(low), float(high), int(orig))
