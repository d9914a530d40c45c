"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) split at its attention: the forward
driver (:mod:`tokenlake.engines.client.forward`) calls :meth:`LlamaModel.project` for a layer's q, k,
v, runs attention through the pool, and hands the result back to :meth:`LlamaModel.absorb`.

Matches ``transformers``' modeling code operation for operation (RMSNorm in float32, RoPE
rotate-half, SwiGLU), with q/k/v and gate/up projections fused into one matmul each.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenlake.engines.client.forward import RowBatch
from tokenlake.engines.model import rope
from tokenlake.engines.model.checkpoint import TensorTable, load_tensors
from tokenlake.engines.model.config import DTYPES, ModelConfig
from tokenlake.errors import InvalidArgumentError

log = logging.getLogger(__name__)
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LayerWeights:
    qkv: torch.Tensor  # [(H_q + 2 H_kv) D, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [hidden, H_q D]
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor  # [2 I, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [hidden, I]
    down_bias: torch.Tensor | None
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]


@dataclass(eq=False)
class ForwardState:
    """One iteration's activations: ``hidden`` ``[T, hidden]`` and RoPE tables ``[T, 1, D]``
    (:func:`rope.cos_sin`)."""

    hidden: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class LlamaModel:
    """Weights and per-layer math of one checkpoint (``dtype``: ``float32`` or ``bfloat16``)."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: str) -> None:
        if dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
        self.config = config
        self.dtype = dtype
        self.torch_dtype = _TORCH_DTYPES[dtype]
        self.shape = config.shape(dtype)
        c = config
        h, d, hq, hkv, inter = (
            c.hidden_size,
            c.head_dim,
            c.num_q_heads,
            c.num_kv_heads,
            c.intermediate_size,
        )
        table = TensorTable(tensors)
        self.embed = table.take("model.embed_tokens.weight", (c.vocab_size, h))
        self.norm = table.take("model.norm.weight", (h,))
        if table.has("lm_head.weight"):
            self.lm_head = table.take("lm_head.weight", (c.vocab_size, h))
        elif c.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            raise InvalidArgumentError(
                "model: checkpoint has no 'lm_head.weight' and config.json tie_word_embeddings is false"
            )
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."

            def bias(name: str, n: int, wanted: bool) -> torch.Tensor | None:
                return table.take(name, (n,)) if wanted else None

            qkv_b = [
                bias(a + "q_proj.bias", hq * d, c.qkv_bias),
                bias(a + "k_proj.bias", hkv * d, c.qkv_bias),
                bias(a + "v_proj.bias", hkv * d, c.qkv_bias),
            ]
            gu_b = [
                bias(m + "gate_proj.bias", inter, c.mlp_bias),
                bias(m + "up_proj.bias", inter, c.mlp_bias),
            ]
            self.layers.append(
                LayerWeights(
                    qkv=torch.cat([
                        table.take(a + "q_proj.weight", (hq * d, h)),
                        table.take(a + "k_proj.weight", (hkv * d, h)),
                        table.take(a + "v_proj.weight", (hkv * d, h)),
                    ]),
                    qkv_bias=torch.cat(qkv_b) if c.qkv_bias else None,
                    o=table.take(a + "o_proj.weight", (h, hq * d)),
                    o_bias=bias(a + "o_proj.bias", h, c.o_bias),
                    gate_up=torch.cat([
                        table.take(m + "gate_proj.weight", (inter, h)),
                        table.take(m + "up_proj.weight", (inter, h)),
                    ]),
                    gate_up_bias=torch.cat(gu_b) if c.mlp_bias else None,
                    down=table.take(m + "down_proj.weight", (h, inter)),
                    down_bias=bias(m + "down_proj.bias", h, c.mlp_bias),
                    input_norm=table.take(p + "input_layernorm.weight", (h,)),
                    post_norm=table.take(p + "post_attention_layernorm.weight", (h,)),
                )
            )  # fmt: skip
        extra = [n for n in table.leftover() if not n.endswith("rotary_emb.inv_freq")]
        if extra:
            raise InvalidArgumentError(
                f"model: checkpoint has tensors config.json does not explain: {extra[:5]}"
            )
        self.inv_freq = rope.inv_freq(c.rope, d)

    @classmethod
    def from_dir(cls, path: str | Path, dtype: str = "auto") -> LlamaModel:
        """Load ``config.json`` and the safetensors weights under ``path``. ``dtype``
        ``"auto"`` keeps the checkpoint's, except float16, served in float32 (weights upcast
        exactly; see :data:`~tokenlake.engines.model.config.AUTO_DTYPES`)."""
        path = Path(path)
        config = ModelConfig.from_dir(path)
        if dtype == "auto":
            dtype = config.auto_dtype
            if dtype != config.dtype:
                log.info(
                    "dtype: the checkpoint is %s, which the model does not compute in; serving "
                    "it in %s (weights upcast exactly; --dtype bfloat16 halves the memory, "
                    "rounding them)", config.dtype, dtype,
                )  # fmt: skip
        if dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype: expected 'auto' or one of {DTYPES}, got {dtype!r}")
        return cls(config, load_tensors(path, _TORCH_DTYPES[dtype]), dtype)

    # ---- the forward driver's protocol ----------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def begin(self, batch: RowBatch) -> ForwardState:
        if int(batch.positions.max(initial=0)) >= self.config.max_context_len:
            raise InvalidArgumentError(
                f"positions: the model serves at most {self.config.max_context_len} tokens"
            )
        tokens = torch.from_numpy(batch.token_ids).long()
        if len(tokens) and not 0 <= int(tokens.min()) <= int(tokens.max()) < self.config.vocab_size:
            raise InvalidArgumentError(
                f"token_ids: expected ids in [0, {self.config.vocab_size}), got "
                f"{int(tokens.min())}..{int(tokens.max())}"
            )
        cos, sin = rope.cos_sin(self.inv_freq, torch.from_numpy(batch.positions), self.torch_dtype)
        return ForwardState(self.embed.index_select(0, tokens), cos, sin)

    def project(self, state: ForwardState, layer: int):
        """``q`` ``[T, H_q, D]``, ``k``/``v`` ``[T, H_kv, D]`` of layer ``layer``."""
        w, c = self.layers[layer], self.config
        x = self._rms_norm(state.hidden, w.input_norm)
        qkv = F.linear(x, w.qkv, w.qkv_bias)
        nq, nkv = c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
        t = x.shape[0]
        # q and k heads side by side: one rotation for both
        qk = rope.apply(qkv[:, : nq + nkv].view(t, -1, c.head_dim), state.cos, state.sin)
        v = qkv[:, nq + nkv :].reshape(t, c.num_kv_heads, c.head_dim)
        return qk[:, : c.num_q_heads], qk[:, c.num_q_heads :], v

    def absorb(self, state: ForwardState, layer: int, o: torch.Tensor, lse: torch.Tensor) -> None:
        """Finish layer ``layer`` from its attention output ``o`` ``[T, H_q, D]`` float32."""
        w = self.layers[layer]
        attn = o.to(self.torch_dtype).reshape(o.shape[0], -1)
        hidden = state.hidden.add_(F.linear(attn, w.o, w.o_bias))
        x = self._rms_norm(hidden, w.post_norm)
        gate, up = F.linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
        hidden.add_(F.linear(F.silu(gate).mul_(up), w.down, w.down_bias))

    def logits(self, state: ForwardState, rows: torch.Tensor) -> torch.Tensor:
        """``[len(rows), vocab]`` float32 next-token logits of ``rows`` (int64)."""
        x = self._rms_norm(state.hidden.index_select(0, rows), self.norm)
        return F.linear(x, self.lm_head).float()

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op, bit for bit transformers' float32 RMSNorm
            return torch.rms_norm(x, weight.shape, weight, self.config.rms_norm_eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)
