"""FlashInfer at the engines' edge (CUDA): each engine owns one planner for its layout.

NOT RUN ON A GPU: this machine has none. The implementation is
:mod:`tokenlake.engines.kernels.flashinfer_backend` (the only one): an engine's
:class:`~tokenlake.engines.kernels.flashinfer_backend.FlashInferPlanner` holds the workspace and the
model's attention shape and soft cap, and plans each bound part once
(:class:`~tokenlake.engines.core.executor.BoundPart`); the part runs every layer. Nothing is global.
"""

from __future__ import annotations

import torch

from tokenlake.engines.kernels.flashinfer_backend import FlashInferPlanner


def make_planner(layout, backend: str | None, device: torch.device) -> FlashInferPlanner | None:
    """A planner when parts on ``device`` run on FlashInfer (CUDA, backend ``None`` or
    ``"flashinfer"``, a 16-bit pool); ``None`` otherwise (the kernels of
    :mod:`tokenlake.engines.kernels` run each call)."""
    if device.type != "cuda" or backend not in (None, "flashinfer"):
        return None
    m = layout.model
    if m.torch_dtype == torch.float32:  # FlashInfer has no float32 attention
        return None
    import flashinfer

    shape = (m.num_q_heads, m.num_kv_heads, m.head_dim, layout.segment_len)
    return FlashInferPlanner(flashinfer, device, shape, m.torch_dtype, logit_cap=m.logit_cap)


def make_causal_planner(
    model, backend: str | None, device: torch.device
) -> FlashInferPlanner | None:
    """A planner for the local causal part of a batch (:class:`~tokenlake.engines.kernels.
    causal_plan.CausalPlan`) of ``model`` (a ``ModelShape``) on ``device``, or ``None`` where
    FlashInfer does not run it (as :func:`make_planner`)."""
    if device.type != "cuda" or backend not in (None, "flashinfer"):
        return None
    if model.torch_dtype == torch.float32:
        return None
    import flashinfer

    from tokenlake.engines.kernels.causal_plan import PAGE_LEN

    shape = (model.num_q_heads, model.num_kv_heads, model.head_dim, PAGE_LEN)
    return FlashInferPlanner(
        flashinfer, device, shape, model.torch_dtype, logit_cap=model.logit_cap
    )
