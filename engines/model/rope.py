"""Rotary position embeddings (RoPE) of the Llama family: ``default``, ``linear``, ``llama3``."""

from __future__ import annotations

import math

import torch

from tokenlake.engines.model.config import RopeConfig


def inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies, scaled as ``rope.rope_type`` says."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    freq = 1.0 / (rope.theta**exponent)
    if rope.rope_type == "linear":
        return freq / rope.factor
    if rope.rope_type != "llama3":
        return freq
    # Llama 3.1: long wavelengths are divided by ``factor``, short ones kept, the band between
    # interpolated smoothly
    old = rope.original_max_position_embeddings
    low_wavelen = old / rope.low_freq_factor
    high_wavelen = old / rope.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin(freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """``cos``, ``sin`` ``[T, 1, head_dim]`` in ``dtype`` for int ``positions`` ``[T]``; ``sin``
    has its first half negated (what :func:`apply` multiplies the swapped halves by)."""
    angles = positions.float()[:, None] * freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    sin = emb.sin()
    sin[:, : freq.shape[0]].neg_()
    return emb.cos().to(dtype)[:, None], sin.to(dtype)[:, None]


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, D]`` by ``cos``/``sin`` from :func:`cos_sin` (the rotate-half
    convention: ``x cos + cat(-x2, x1) sin``, bit for bit, as ``x cos + cat(x2, x1) sin'``
    with ``sin'`` = ``sin`` whose first half is negated)."""
    swapped = torch.roll(x, x.shape[-1] // 2, -1)
    return torch.mul(x, cos).add_(swapped.mul_(sin))
