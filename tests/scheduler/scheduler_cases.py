"""Shared by the scheduler tests that run a real pool: segment length, model shape, a latency
model, and seeded prompts."""

from __future__ import annotations

import tokenlake as tl
from tokenlake.scheduler import Coeffs, LatencyModel

C = 16
SHAPE = tl.ModelShape(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16)
LATENCY = LatencyModel({1: Coeffs(1e-3, 1e-5, 1e-8)}, Coeffs(1e-3, 1e-5, 0.0))
