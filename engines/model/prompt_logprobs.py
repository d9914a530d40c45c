"""vLLM's ``prompt_logprobs``: the log-probability of each prompt token given the tokens
before it, and the most likely tokens at each position, from one forward of the whole
prompt with dense causal attention (the model's own layers, no pool): a prompt's cached
prefix is never recomputed by the serving loop, so its logits exist nowhere else, and vLLM
too recomputes a prompt whose prompt log-probabilities are asked for."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from tokenlake.engines.client.forward import RowBatch
from tokenlake.engines.model.llama import LlamaModel
from tokenlake.engines.model.logits_processors import LOGPROB_FLOOR
from tokenlake.plans import Chunk

# (token_id, logprob, rank): rank 1 is the most likely token at that position
Entry = tuple[int, float, int]


@torch.inference_mode()
def prompt_logits(model: LlamaModel, token_ids: Sequence[int]) -> torch.Tensor:
    """``[len(token_ids), vocab]`` float32: row ``i`` is the next-token logits after
    ``token_ids[: i + 1]``."""
    batch = RowBatch.from_chunks([Chunk("prompt", np.asarray(token_ids, dtype=np.int64), 0)])
    state = model.begin(batch)
    for layer in range(model.num_layers):
        q, k, v = model.project(state, layer)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
            is_causal=True, enable_gqa=True,
        )  # fmt: skip
        model.absorb(state, layer, o.transpose(0, 1).contiguous(), None)
    return model.logits(state, torch.arange(len(token_ids)))


def prompt_logprobs(
    model: LlamaModel, token_ids: Sequence[int], num_top: int
) -> list[list[Entry] | None]:
    """Per prompt position: ``None`` for the first token (nothing precedes it), else the
    token's own ``(id, logprob, rank)`` followed by the ``num_top`` most likely tokens not
    already listed, each logprob at least :data:`LOGPROB_FLOOR`."""
    logprobs = torch.log_softmax(prompt_logits(model, token_ids)[:-1], dim=-1)
    out: list[list[Entry] | None] = [None]
    for i, token in enumerate(token_ids[1:]):
        row = logprobs[i]
        value = float(row[token])
        entries = [(int(token), max(value, LOGPROB_FLOOR), int((row > value).sum()) + 1)]
        if num_top:
            values, ids = torch.topk(row, min(num_top, row.numel()))
            for rank, (v, t) in enumerate(zip(values.tolist(), ids.tolist(), strict=True), 1):
                if t != token:
                    entries.append((t, max(v, LOGPROB_FLOOR), rank))
        out.append(entries)
    return out
