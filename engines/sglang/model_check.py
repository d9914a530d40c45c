"""What the SGLang backend supports, checked once at construction from SGLang's model runner
and its ``RadixAttention`` layers; anything else is refused with an error naming the feature."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenlake.config import ModelShape, check_logit_cap
from tokenlake.errors import InvalidArgumentError, TokenLakeError

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class UnsupportedFeatureError(TokenLakeError, NotImplementedError):
    """The SGLang configuration uses a feature the TokenLake backend does not implement."""


def _refuse(feature: str, why: str) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(
        f"--attention-backend tokenlake does not support {feature}: {why}. "
        "Use another attention backend for this model or configuration."
    )


def check_model(model_runner, layers: Sequence) -> ModelShape:
    """The pool's model shape for SGLang's ``model_runner``; ``layers`` are its
    ``RadixAttention`` modules. Raises :class:`UnsupportedFeatureError` naming the first
    unsupported feature found."""
    if model_runner.use_mla_backend:
        raise _refuse("MLA (multi-head latent attention)", "the pool stores per-head K and V")
    if not model_runner.spec_algorithm.is_none():
        raise _refuse(
            "speculative decoding (draft extend / target verify)",
            "tree-masked verify batches are not planned by the pool",
        )
    if model_runner.model_config.is_encoder_decoder:
        raise _refuse("cross-attention (encoder-decoder models)", "the pool holds decoder KV only")
    if model_runner.is_hybrid_swa or model_runner.sliding_window_size not in (None, -1, 0):
        raise _refuse("sliding-window attention", "prefix segments are never windowed")
    if not layers:
        raise _refuse("models without RadixAttention layers", "nothing to attach to")
    for layer in layers:
        name = f"layer {layer.layer_id}"
        if layer.is_cross_attention:
            raise _refuse("cross-attention", f"{name} attends to encoder states")
        if getattr(layer.attn_type, "value", layer.attn_type) != "decoder":
            raise _refuse(f"{layer.attn_type} attention", f"{name} is not causal decoder attention")
        if layer.sliding_window_size not in (None, -1):
            raise _refuse("sliding-window attention", f"{name} has a window")
        method = getattr(layer, "logit_capping_method", "tanh")
        if _logit_cap(layer) and method != "tanh":
            raise _refuse(
                f"logit capping method {method!r}", f"{name}: the pool's kernels cap with tanh"
            )
        if layer.qk_head_dim != layer.v_head_dim:
            raise _refuse("different K and V head dims", f"{name}")
    kv = model_runner.token_to_kv_pool
    first = layers[0]
    if len(layers) != kv.layer_num:
        raise _refuse(
            "hybrid models (layers without a KV cache)",
            f"{len(layers)} attention layers but {kv.layer_num} KV-cache layers",
        )
    if any(
        (layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim)
        != (first.tp_q_head_num, kv.head_num, kv.head_dim)
        for layer in layers
    ):
        raise _refuse("layers of different attention shapes", "the pool has one shape")
    caps = sorted({_logit_cap(layer) for layer in layers})
    if len(caps) > 1:
        raise _refuse("layers of different logit caps", f"{caps}: the pool has one cap")
    try:
        cap = check_logit_cap("logit_cap", caps[0])
    except InvalidArgumentError as e:
        raise _refuse("this logit soft cap", str(e)) from None
    dtype = _DTYPE_NAMES.get(kv.dtype)
    if dtype is None:
        raise _refuse(f"a {kv.dtype} KV cache", "the pool stores float32, bfloat16 or float16")
    return ModelShape(kv.layer_num, first.tp_q_head_num, kv.head_num, kv.head_dim, dtype, cap)


def _logit_cap(layer) -> float:
    """SGLang's soft cap of a ``RadixAttention`` layer: ``logit_cap > 0`` enables it (as in its
    triton and flashinfer backends); 0, None or a negative value mean none."""
    cap = layer.logit_cap
    return float(cap) if cap is not None and cap > 0 else 0.0
