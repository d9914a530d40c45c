"""FlashInfer backend of paged partial attention (CUDA): the one FlashInfer implementation.

NOT RUN ON A GPU: no GPU is available to this project. Written against FlashInfer 0.7.x
(``BatchDecodeWithPagedKVCacheWrapper`` / ``BatchPrefillWithPagedKVCacheWrapper``: ``plan(...)``
once, then ``run(q, paged_kv_cache, return_lse=True)``); every call made here is checked
against the released signatures by ``tests/engines/test_flashinfer_calls.py``, the numerics
only where a GPU exists (``@pytest.mark.gpu``).

Nothing is global. A :class:`FlashInferPlanner` is caller-held state (the module, the float
workspace, the attention shape, scale and soft cap): the engines hold one each
(``engines/flashinfer_attention.make_planner``) and plan every bound part once
(:class:`FlashInferPart`), then run it every layer. :func:`partial_attention`, behind
``tokenlake.engines.kernels.partial_attention(backend="flashinfer")``, is the one-shot form: a planner
of its own per call, whose workspace comes from (and goes back to) torch's caching allocator.

Edges handled here, so every backend returns the same thing:

* FlashInfer's LSE is base 2; TokenLake's is natural log: ``lse_ln = lse_2 * ln 2``.
* Requests without pages (empty prefix) never reach FlashInfer: their rows get ``o = 0``,
  ``lse = -inf``; so do causal rows that see no key.
* The soft cap is FlashInfer's ``logits_soft_cap`` (same semantics: ``cap * tanh(s / cap)`` of
  the scaled score ``s``, 0 for none); its LSE is that of the capped scores, as ours.
* Outputs are float32 whatever the KV dtype.
* FlashInfer has no float32 attention; float32 pools use the torch reference instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokenlake.engines.kernels import reference
from tokenlake.engines.kernels.inputs import PagedAttentionInputs, PagedCSR
from tokenlake.errors import InvalidArgumentError

__all__ = [
    "FlashInferPlanner",
    "FlashInferPart",
    "partial_attention",
    "nonempty_batch",
    "to_natural_lse",
    "uses_tensor_cores",
    "WORKSPACE_BYTES",
]

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended split-k workspace


@dataclass(frozen=True)
class _Batch:
    """The requests that have pages, renumbered (host tensors, int32 unless noted)."""

    rows: torch.Tensor  # int64 [num_sub_rows]: their rows of q
    csr: PagedCSR
    visible: torch.Tensor  # bool [num_sub_rows]: the row sees at least one key


def nonempty_batch(csr: PagedCSR, page_size: int, causal: bool) -> _Batch:
    """Drop requests with no pages or no rows (FlashInfer needs ``last_len`` in ``1..C`` and at
    least one page per request); for causal attention (bottom-right aligned) also mark the
    rows that see no key. All inputs on the host."""
    q_indptr, kv_indptr, kv_indices, last_len = csr
    q_lens = (q_indptr[1:] - q_indptr[:-1]).long()
    pages = (kv_indptr[1:] - kv_indptr[:-1]).long()
    keep = torch.nonzero((pages > 0) & (q_lens > 0)).flatten()
    zero = torch.zeros(1, dtype=torch.int32)
    if keep.numel() == 0:
        empty = torch.zeros(0, dtype=torch.int32)
        none = PagedCSR(zero, zero, empty, empty)
        return _Batch(empty.long(), none, torch.zeros(0, dtype=torch.bool))
    rows, indices, visible = [], [], []
    for b in keep.tolist():
        lo, n = int(q_indptr[b]), int(q_lens[b])
        rows.append(torch.arange(lo, lo + n))
        indices.append(kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])])
        kv_len = (int(pages[b]) - 1) * page_size + int(last_len[b])
        i = torch.arange(n)
        visible.append(kv_len - n + i >= 0 if causal else torch.ones(n, dtype=torch.bool))
    sub_q, sub_pages = q_lens[keep], pages[keep]
    return _Batch(
        rows=torch.cat(rows),
        csr=PagedCSR(
            torch.cat([zero, torch.cumsum(sub_q, 0).int()]),
            torch.cat([zero, torch.cumsum(sub_pages, 0).int()]),
            torch.cat(indices).int(),
            last_len[keep].int(),
        ),
        visible=torch.cat(visible),
    )


def to_natural_lse(lse_base2: torch.Tensor) -> torch.Tensor:
    """FlashInfer's base-2 log-sum-exp in natural log (``-inf`` stays ``-inf``)."""
    return lse_base2.float() * math.log(2.0)


class FlashInferPlanner:
    """Caller-held FlashInfer state for one attention shape: the ``flashinfer`` module (passed
    in, so the calls can be checked without a GPU), a float workspace on ``device`` (shared by
    the parts it plans, which must run one at a time on one stream), ``shape`` = ``(H_q, H_kv,
    D, page_size)``, the 16-bit ``dtype`` of q and the pool, ``sm_scale`` (default
    ``1 / sqrt(D)``) and ``logit_cap`` (0: none), both already checked. ``attention_backend``:
    FlashInfer's kernel family for both wrappers, FA2 by default (on Hopper ``auto`` picks FA3,
    whose JIT build costs ~74 CPU-seconds a file against FA2's ~17)."""

    def __init__(
        self,
        flashinfer,
        device: torch.device,
        shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        sm_scale: float | None = None,
        logit_cap: float = 0.0,
        workspace_bytes: int = WORKSPACE_BYTES,
        attention_backend: str = "fa2",
    ) -> None:
        self.flashinfer, self.shape, self.dtype = flashinfer, shape, dtype
        self.attention_backend = attention_backend
        self.sm_scale = 1.0 / math.sqrt(shape[2]) if sm_scale is None else float(sm_scale)
        self.logit_cap = float(logit_cap)
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)

    def plan(self, csr: PagedCSR, causal: bool = False) -> FlashInferPart:
        """Plan one batch (int32 CSR as in :func:`tokenlake.engines.kernels.partial_attention`, any
        device): the CSR goes to the device once, here."""
        return FlashInferPart(self, PagedCSR(*csr), causal)


class FlashInferPart:
    """One batch planned on FlashInfer: the decode wrapper when every request has one row
    (bottom-right causal then sees every key, so it is causal too), the prefill wrapper
    otherwise. :meth:`run` returns float32 ``o`` ``[num_rows, H_q, D]`` and natural-log
    ``lse`` ``[num_rows, H_q]`` for the batch's rows of ``q``."""

    def __init__(
        self,
        planner: FlashInferPlanner,
        csr: PagedCSR,
        causal: bool,
    ) -> None:
        num_q_heads, num_kv_heads, head_dim, page_size = planner.shape
        workspace = planner.workspace
        device = workspace.device
        self.num_rows, self.shape = int(csr.q_indptr[-1]), planner.shape
        self.planner = planner  # its FlashInfer also merges this part's states
        batch = nonempty_batch(csr.map(torch.Tensor.cpu), page_size, causal)
        self.rows = batch.rows.to(device)
        hidden = ~batch.visible
        self.hidden = hidden.to(device) if bool(hidden.any()) else None
        self.wrapper = None
        # every row, in order, each seeing a key: FlashInfer's output is the answer as it is
        self.dense = (
            self.hidden is None
            and batch.rows.numel() == self.num_rows
            and bool(batch.rows.eq(torch.arange(self.num_rows)).all())
        )
        if batch.rows.numel() == 0:
            return
        on_device = batch.csr.map(lambda t: t.to(device))
        kv = on_device[1:]
        common = dict(
            sm_scale=planner.sm_scale,
            logits_soft_cap=planner.logit_cap,
            q_data_type=planner.dtype,
            kv_data_type=planner.dtype,
        )
        fi = planner.flashinfer
        q_indptr = batch.csr.q_indptr
        self.decode = bool((q_indptr[1:] - q_indptr[:-1]).eq(1).all())
        if self.decode:
            self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=uses_tensor_cores(num_q_heads, num_kv_heads),
                backend=planner.attention_backend,
            )  # fmt: skip
            self.wrapper.plan(*kv, num_q_heads, num_kv_heads, head_dim, page_size, **common)
        else:
            self.wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
                workspace, "NHD", backend=planner.attention_backend
            )
            self.wrapper.plan(
                on_device.q_indptr, *kv, num_q_heads, num_kv_heads, head_dim, page_size,
                causal=causal, **common,
            )  # fmt: skip

    def run(self, q: torch.Tensor, pool_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` ``[num_rows, H_q, D]``, ``pool_layer`` ``[num_slots, 2, C, H_kv, D]`` (NHD pages
        of ``C`` tokens), both of the planner's dtype and device."""
        if self.dense:  # no empty or hidden rows to fill in: no gather, no scatter
            o, lse = self.run_native(q, pool_layer)
            return o.float(), to_natural_lse(lse)
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
        o_sub, lse_sub = o_sub.float(), lse_sub.float()
        if self.hidden is not None:  # causal rows that see no key: exactly empty, never NaN
            o_sub[self.hidden] = 0.0
            lse_sub[self.hidden] = -math.inf
        o.index_copy_(0, self.rows, o_sub)
        lse.index_copy_(0, self.rows, lse_sub)
        return o, lse

    def run_native(
        self,
        q: torch.Tensor,
        pool_layer: torch.Tensor,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FlashInfer's own state of a :attr:`dense` part: ``o`` ``[num_rows, H_q, D]`` in q's
        dtype and ``lse`` ``[num_rows, H_q]`` float32 in base 2, written into ``out`` / ``lse``
        (contiguous) when given: what FlashInfer's ``merge_state(s)`` take, with no conversion
        (:class:`~tokenlake.engines.kernels.flashinfer_merge.DecodeMerge`)."""
        if not self.dense or self.wrapper is None:
            raise InvalidArgumentError(
                "run_native: this part does not cover every row in order (empty or hidden "
                "rows); use run()"
            )
        if self.decode:
            return self.wrapper.run(q, pool_layer, out=out, lse=lse, return_lse=True)
        return self.wrapper.run(q, pool_layer, out=out, lse=lse, return_lse=True, lse_base="log2")


def uses_tensor_cores(num_q_heads: int, num_kv_heads: int) -> bool:
    """The decode wrapper's kernel: tensor cores from a GQA group of 4. The CUDA-core decode
    kernels cover only some group sizes (5 and 7 are not among them: Qwen2.5-0.5B is 14/2); the
    tensor-core path takes any, and is the faster one from a group of 4, which is SGLang's own
    FlashInfer backend's rule for 16-bit caches (should_use_tensor_core). The one rule, for
    TokenLake's parts and for any FlashInfer baseline compared with them."""
    return num_q_heads // num_kv_heads >= 4


def partial_attention(args: PagedAttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of :func:`tokenlake.engines.kernels.partial_attention` on FlashInfer (shapes there),
    planned and run at once; float32 pools go to the torch reference."""
    if args.pool_layer.dtype == torch.float32:  # FlashInfer has no float32 attention
        return reference.partial_attention(args)
    import flashinfer

    _, _, page_size, num_kv_heads, head_dim = args.pool_layer.shape
    shape = (args.q.shape[1], num_kv_heads, head_dim, page_size)
    planner = FlashInferPlanner(
        flashinfer, args.q.device, shape, args.q.dtype, args.sm_scale, args.logit_cap
    )
    part = planner.plan(args.csr, args.causal)
    return part.run(args.q, args.pool_layer)
