"""A stand-in for the ``flashinfer`` module on CPU: the calls the engines make, with FlashInfer's
conventions, computed by the torch reference, each recording one kernel launch.

It lets the CUDA path's code run on CPU (bfloat16 tensors) so that its results can be checked
against the reference and its kernels counted: aten ops by
:class:`~tokenlake.engines.kernels.op_count.OpCounter`, FlashInfer's own launches here
(:attr:`FlashInferStandIn.launches`). Its own arithmetic runs outside any dispatch mode, so it
is not counted as aten ops. What it does not model: FlashInfer's split-KV decode, which on a GPU
adds a merge kernel when it splits a long sequence, and the few aten ops FlashInfer's Python
wrappers run (allocations, which launch nothing). On a GPU the benchmark counts with
``torch.profiler`` instead, FlashInfer's kernels included.

Conventions kept (FlashInfer 0.7.2.post1): LSE in base 2; outputs in q's (or v's) dtype;
``merge_state``/``merge_states`` take 16-bit ``v`` and float32 ``s``, contiguous, and give an
empty state (all ``-inf``) ``o = 0``, ``lse = -inf``; ``out``/``lse`` are written when given.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from torch.utils._python_dispatch import _disable_current_modes

from tokenlake.engines.kernels import reference
from tokenlake.engines.kernels.inputs import PagedAttentionInputs

LOG2E = 1.0 / math.log(2.0)
HALF = (torch.float16, torch.bfloat16)


class FlashInferStandIn:
    """Use as the ``flashinfer`` module: ``FlashInferPlanner(FlashInferStandIn(), ...)``."""

    def __init__(self) -> None:
        self.launches: Counter[str] = Counter()
        standin = self

        class _Wrapper:
            def __init__(self, workspace, kv_layout="NHD", use_tensor_cores=False, backend="auto",
                         **_):  # fmt: skip
                assert kv_layout == "NHD" and isinstance(workspace, torch.Tensor)
                self.use_tensor_cores, self.backend, self.planned = use_tensor_cores, backend, None

            def _plan(self, q_indptr, kv_indptr, kv_indices, last_len, causal, kw) -> None:
                self.planned = (q_indptr, kv_indptr, kv_indices, last_len, causal, kw)

            def run(self, q, pool, out=None, lse=None, return_lse=False, lse_base="log2"):
                q_indptr, kv_indptr, kv_indices, last_len, causal, kw = self.planned
                with _disable_current_modes():
                    args = PagedAttentionInputs(
                        q, q_indptr, pool, kv_indptr, kv_indices, last_len, causal,
                        kw["sm_scale"], kw["logits_soft_cap"],
                    )  # fmt: skip
                    o_ln, lse_ln = reference.partial_attention(args)
                    o_new = o_ln.to(q.dtype)
                    lse_new = lse_ln if lse_base == "ln" else lse_ln * LOG2E
                    o_res = out.copy_(o_new) if out is not None else o_new
                    lse_res = lse.copy_(lse_new) if lse is not None else lse_new
                standin.launches[type(self).__name__] += 1
                return (o_res, lse_res) if return_lse else o_res

        class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
            def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                     page_size, **kw):  # fmt: skip
                q_indptr = torch.arange(len(indptr), dtype=torch.int32, device=indptr.device)
                self._plan(q_indptr, indptr, indices, last_page_len, False, kw)

            def run(self, q, pool, out=None, lse=None, return_lse=False):
                return super().run(q, pool, out, lse, return_lse)

        class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
            def plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                     head_dim, page_size, causal=False, **kw):  # fmt: skip
                self._plan(qo_indptr, indptr, indices, last_page_len, causal, kw)

        self.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
        self.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper

    def merge_state(self, v_a, s_a, v_b, s_b):
        for v, lse in ((v_a, s_a), (v_b, s_b)):
            _check_state(v, lse, 3)
        with _disable_current_modes():
            result = _merge(torch.stack([v_a, v_b], 1), torch.stack([s_a, s_b], 1))
        self.launches["merge_state"] += 1
        return result

    def merge_states(self, v, s):
        _check_state(v, s, 4)
        with _disable_current_modes():
            result = _merge(v, s)
        self.launches["merge_states"] += 1
        return result

    @property
    def num_launches(self) -> int:
        return sum(self.launches.values())


def _check_state(v: torch.Tensor, s: torch.Tensor, dims: int) -> None:
    """What FlashInfer's merge kernels check (CHECK_INPUT, CHECK_DIM, the 16-bit dispatch)."""
    assert v.dtype in HALF and s.dtype == torch.float32, (v.dtype, s.dtype)
    assert v.is_contiguous() and s.is_contiguous(), "FlashInfer's CHECK_INPUT: contiguous"
    assert v.dim() == dims and s.shape == v.shape[:-1], (v.shape, s.shape)


def _merge(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v`` ``[T, S, H, D]``, ``s`` ``[T, S, H]`` base 2 -> merged ``(o, lse)``; an empty row
    (every ``s`` is ``-inf``) gets ``o = 0``, ``lse = -inf``, as FlashInfer's kernel."""
    top = s.amax(dim=1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weight = torch.exp2(s - top)  # 0 for an empty state
    total = weight.sum(dim=1)
    o = (v.float() * weight[..., None]).sum(dim=1)
    o = torch.where(total[..., None] > 0, o / total.clamp_min(1e-30)[..., None], 0.0)
    lse = torch.where(total > 0, top[:, 0] + torch.log2(total), -torch.inf)
    return o.to(v.dtype), lse
