"""The local causal part of an iteration (each request's new tokens over themselves), planned
once per batch and run every layer in a fixed number of ops.

The new keys arrive dense (``[T_kv, H_kv, D]``, request after request); the paged kernels
(C++ on CPU, FlashInfer on CUDA) read pages. :class:`CausalPlan` lays the batch out once on
pages of ``page_len`` tokens (request ``b`` on its own consecutive pages) and keeps the
scatter index of every key row and the kernel's CSR; a layer is then one ``index_copy_``
of its K and V rows into a page buffer kept for the batch, and one planned kernel call,
whatever the number of requests. Nothing of a tensor's value is read on the host per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenlake.engines import kernels
from tokenlake.engines.kernels.cpu import CpuPart
from tokenlake.engines.kernels.inputs import PagedCSR

PAGE_LEN = 16
"""Tokens per page of the causal layout: at most ``PAGE_LEN - 1`` padding rows per request."""


@dataclass(eq=False)
class CausalPlan:
    """One batch's causal part: ``q_offsets`` / ``kv_offsets`` (host int64 ``[B + 1]``, checked
    by the caller) of rows of ``q`` and keys; each request's q rows are its last keys."""

    scatter_index: torch.Tensor  # int64 [2 * T_kv]: K then V flat page row of each key row
    pages: torch.Tensor  # [num_pages * 2 * page_len, H_kv, D], rewritten every layer
    csr: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    page_len: int
    backend: str | None
    sm_scale: float
    logit_cap: float
    planned: object | None  # a FlashInferPart or CpuPart, planned once

    @classmethod
    def build(
        cls,
        q_offsets: np.ndarray,
        kv_offsets: np.ndarray,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        sm_scale: float,
        logit_cap: float,
        backend: str | None,
        planner=None,
        page_len: int = PAGE_LEN,
    ) -> CausalPlan:
        """``planner``: a FlashInfer planner of this shape (``page_len`` then its page size)."""
        if planner is not None:
            page_len = planner.shape[3]
        kv_lens = np.diff(kv_offsets)
        num_pages = -(-kv_lens // page_len)
        first_page = np.concatenate([[0], np.cumsum(num_pages)])
        total_pages = int(first_page[-1])
        rows = np.arange(int(kv_offsets[-1]))
        req = np.repeat(np.arange(len(kv_lens)), kv_lens)
        within = rows - kv_offsets[req]
        page = first_page[req] + within // page_len
        k_row = page * (2 * page_len) + within % page_len
        scatter = np.concatenate([k_row, k_row + page_len])
        last_len = np.where(num_pages > 0, kv_lens - (num_pages - 1) * page_len, 1)
        i32 = dict(dtype=torch.int32, device=device)
        csr = PagedCSR(
            torch.tensor(q_offsets, **i32),
            torch.tensor(first_page, **i32),
            torch.arange(total_pages, **i32),
            torch.tensor(last_len, **i32),
        )
        pages = torch.zeros(
            (max(total_pages, 1) * 2 * page_len, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        planned = None
        if planner is not None:
            planned = planner.plan(csr, causal=True)
        elif device.type == "cpu" and backend in (None, "cpu"):
            planned = CpuPart(csr, causal=True, sm_scale=sm_scale, logit_cap=logit_cap)
        return cls(
            torch.from_numpy(scatter).to(device), pages, csr, page_len, backend, sm_scale,
            logit_cap, planned,
        )  # fmt: skip

    def run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of ``q`` ``[T_q, H_q, D]`` over ``k`` / ``v`` ``[T_kv, H_kv, D]``:
        ``(o [T_q, H_q, D], lse [T_q, H_q])`` float32, natural log; a row that sees no key
        gets ``o = 0``, ``lse = -inf``."""
        self.pages.index_copy_(0, self.scatter_index, torch.cat((k, v)))
        h_kv, dim = self.pages.shape[1:]
        pool_layer = self.pages.view(-1, 2, self.page_len, h_kv, dim)
        if self.planned is not None:
            return self.planned.run(q, pool_layer)
        return kernels.partial_attention(
            q, self.csr[0], pool_layer, *self.csr[1:], causal=True, sm_scale=self.sm_scale,
            backend=self.backend, logit_cap=self.logit_cap,
        )  # fmt: skip
