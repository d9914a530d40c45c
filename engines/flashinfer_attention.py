"""FlashInfer at the engines' edge (CUDA): a bound part's attention planned once, run every
layer.

NOT RUN ON A GPU: this machine has none. Written against FlashInfer 0.7.x
(``BatchDecodeWithPagedKVCacheWrapper`` / ``BatchPrefillWithPagedKVCacheWrapper``:
``plan(...)`` once, then ``run(q, paged_kv_cache, return_lse=True)`` per layer); every call
made here is checked against the released signatures by ``tests/engines/test_flashinfer_calls.py``.

Owned by the engine that binds the part (a query engine, or a client for its own part):
the wrapper lives in the :class:`FlashInferPart`, the float workspace in the engine's
:class:`FlashInferPlanner`; nothing is global. CSR arrays go to the device once, at bind.
Requests without pages never reach FlashInfer (their rows stay ``o = 0``, ``lse = -inf``).
LSE comes back base 2 from the decode kernel and is converted to natural log here.
"""

from __future__ import annotations

import math

import torch

from tokenlake.kernels.flashinfer_backend import nonempty_batch, to_natural_lse

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended split-k workspace


class FlashInferPart:
    """One holder part planned on FlashInfer: decode wrapper when every request has one row,
    prefill wrapper otherwise. :meth:`run` returns float32 ``o`` ``[num_rows, H_q, D]`` and
    natural-log ``lse`` ``[num_rows, H_q]`` for the part's rows of ``q``."""

    def __init__(
        self,
        flashinfer,
        workspace: torch.Tensor,
        q_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        last_len: torch.Tensor,
        shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        sm_scale: float,
    ) -> None:
        num_q_heads, num_kv_heads, head_dim, page_size = shape
        device = workspace.device
        self.num_rows, self.shape = int(q_indptr[-1]), shape
        batch = nonempty_batch(
            q_indptr.cpu(), kv_indptr.cpu(), kv_indices.cpu(), last_len.cpu(), page_size, False
        )
        self.rows = batch.rows.to(device)
        self.wrapper = None
        if batch.rows.numel() == 0:
            return
        kv = (batch.kv_indptr.to(device), batch.kv_indices.to(device), batch.last_len.to(device))
        dtypes = dict(q_data_type=dtype, kv_data_type=dtype)
        self.decode = bool((batch.q_indptr[1:] - batch.q_indptr[:-1]).eq(1).all())
        if self.decode:
            self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
            self.wrapper.plan(
                *kv, num_q_heads, num_kv_heads, head_dim, page_size, sm_scale=sm_scale, **dtypes
            )
        else:
            self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            self.wrapper.plan(
                batch.q_indptr.to(device), *kv, num_q_heads, num_kv_heads, head_dim, page_size,
                causal=False, sm_scale=sm_scale, **dtypes,
            )  # fmt: skip

    def run(self, q: torch.Tensor, pool_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_q_heads, _, head_dim, _ = self.shape
        o = torch.zeros(
            (self.num_rows, num_q_heads, head_dim), dtype=torch.float32, device=q.device
        )
        lse = torch.full(
            (self.num_rows, num_q_heads), -math.inf, dtype=torch.float32, device=q.device
        )
        if self.wrapper is None:
            return o, lse
        q_sub = q.index_select(0, self.rows).contiguous()
        if self.decode:
            o_sub, lse_sub = self.wrapper.run(q_sub, pool_layer, return_lse=True)
            lse_sub = to_natural_lse(lse_sub)
        else:
            o_sub, lse_sub = self.wrapper.run(q_sub, pool_layer, return_lse=True, lse_base="ln")
        o.index_copy_(0, self.rows, o_sub.float())
        lse.index_copy_(0, self.rows, lse_sub.float())
        return o, lse


class FlashInferPlanner:
    """An engine's FlashInfer state: the module, the float workspace (shared by its parts,
    which run one at a time on the engine's stream) and the attention shape."""

    def __init__(self, flashinfer, device: torch.device, shape: tuple[int, int, int, int], dtype):
        self.flashinfer, self.shape, self.dtype = flashinfer, shape, dtype
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)

    def plan(self, q_indptr, kv_indptr, kv_indices, last_len) -> FlashInferPart:
        scale = 1.0 / math.sqrt(self.shape[2])
        return FlashInferPart(
            self.flashinfer, self.workspace, q_indptr, kv_indptr, kv_indices, last_len,
            self.shape, self.dtype, scale,
        )  # fmt: skip


def make_planner(layout, backend: str | None, device: torch.device) -> FlashInferPlanner | None:
    """A planner when parts on ``device`` run on FlashInfer (CUDA, backend ``None`` or
    ``"flashinfer"``, a 16-bit pool); ``None`` otherwise (the kernels of
    :mod:`tokenlake.kernels` run each call)."""
    if device.type != "cuda" or backend not in (None, "flashinfer"):
        return None
    m = layout.model
    if m.torch_dtype == torch.float32:  # FlashInfer has no float32 attention
        return None
    import flashinfer

    shape = (m.num_q_heads, m.num_kv_heads, m.head_dim, layout.segment_len)
    return FlashInferPlanner(flashinfer, device, shape, m.torch_dtype)
