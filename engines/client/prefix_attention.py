"""The one step every compute engine shares (docs/architecture.md#one-iterations-life, step 4): the pool's prefix partial
plus causal self-attention over the new tokens → the merged attention output.

Used by the model engine (:mod:`tokenlake.engines.client.forward`) and the SGLang backend alike.
:class:`PrefixAttention` is bound once per iteration (its batch layout and options checked
once) and called every layer; :func:`attend_with_prefix` is the one-shot form.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenlake.config import check_logit_cap
from tokenlake.engines.kernels.causal_plan import CausalPlan
from tokenlake.engines.kernels.flashinfer_merge import DecodeMerge
from tokenlake.engines.kernels.inputs import KV_DTYPES, check_dtype_on
from tokenlake.engines.kernels.reference import merge_pair
from tokenlake.errors import InvalidArgumentError
from tokenlake.validate import canonical_device, check_int, check_tensor

_DTYPES = KV_DTYPES  # float16 on CUDA only (check_dtype_on)


@dataclass(frozen=True)
class PrefixAttention:
    """The merge of one iteration's rows, bound once (:meth:`bind`), run every layer.

    Bind checks the layout and plans the local causal part (:class:`CausalPlan`) on the host,
    once per batch; each call then checks only that its tensors have the bound geometry
    (shapes, dtypes, device: metadata, no values) and runs a fixed number of ops whatever the
    number of requests: decode (one new token each) six whole-batch ops, otherwise one
    scatter of the new K/V into the planned pages, one kernel call and one merge. No value of
    a tensor is read on the host per call.
    """

    q_shape: tuple[int, int, int]  # (T_q, H_q, D)
    kv_shape: tuple[int, int, int]  # (T_kv, H_kv, D)
    dtype: torch.dtype
    device: torch.device
    sm_scale: float
    logit_cap: float
    backend: str | None
    one_token_each: bool  # every request has one new token and no other key
    causal: CausalPlan | None  # None when one_token_each
    decode_merge: DecodeMerge | None = None  # FlashInfer's merge of a decode step (CUDA)

    @classmethod
    def bind(
        cls,
        q_indptr: torch.Tensor | np.ndarray,
        q_shape: tuple[int, int, int],
        num_kv_heads: int,
        dtype: torch.dtype,
        kv_indptr: torch.Tensor | np.ndarray | None = None,
        num_kv_rows: int | None = None,
        sm_scale: float | None = None,
        backend: str | None = None,
        logit_cap: float = 0.0,
        device: torch.device | str = "cpu",
        planner=None,
        flashinfer=None,
        num_prefix_states: int = 1,
    ) -> PrefixAttention:
        """Check an iteration's layout once: ``q_shape`` = ``(T_q, H_q, D)``, ``num_kv_heads``
        dividing ``H_q``, ``num_kv_rows`` = ``T_kv`` (default ``T_q``); the offsets as in
        :func:`attend_with_prefix`, int32 tensors or host arrays (a tensor on a GPU is
        read to the host here: the batch's one small host read). ``planner``: a FlashInfer
        planner of this shape, which plans the causal part (CUDA). ``flashinfer`` (the module,
        CUDA, 16-bit): a decode step (one new token each) merges on FlashInfer's kernels, in its
        form: the ``num_prefix_states`` prefix parts write their states into
        :attr:`prefix_states` (:class:`~tokenlake.engines.kernels.flashinfer_merge.DecodeMerge`),
        and the call takes none."""
        device = canonical_device(device)  # `cuda` and tensors' `cuda:N` compare equal
        t_q, h_q, d = q_shape
        t_kv = t_q if num_kv_rows is None else num_kv_rows
        if dtype not in _DTYPES:
            raise InvalidArgumentError(
                f"q: expected dtype float32, bfloat16 or float16 (CUDA), got {dtype}"
            )
        check_dtype_on("q", dtype, device)
        if min(h_q, d, num_kv_heads) < 1 or h_q % num_kv_heads:
            raise InvalidArgumentError(
                f"k: expected H_kv >= 1 dividing H_q={h_q} (D={d} >= 1), got {num_kv_heads}"
            )
        q_off = _host_offsets("q_indptr", q_indptr, None, t_q, "the rows of q")
        if kv_indptr is not None:
            kv_off = _host_offsets("kv_indptr", kv_indptr, len(q_off), t_kv, "the rows of k")
        elif t_kv != t_q:
            raise InvalidArgumentError(
                f"k: expected {t_q} rows (those of q) when kv_indptr is not given, got {t_kv}"
            )
        else:
            kv_off = q_off
        scale = d**-0.5 if sm_scale is None else sm_scale
        cap = check_logit_cap("logit_cap", logit_cap)
        # the rows are one per request exactly when the offsets are 0, 1, 2, ...
        one_each = kv_indptr is None and np.array_equal(q_off, np.arange(len(q_off)))
        causal = None
        if not one_each:
            if planner is not None and (planner.sm_scale != scale or planner.dtype != dtype):
                planner = None  # planned for another scale or dtype: the unplanned kernels
            causal = CausalPlan.build(
                q_off, kv_off, num_kv_heads, d, dtype, device, scale, cap, backend, planner
            )
        decode_merge = None
        if flashinfer is not None:
            if not one_each or dtype == torch.float32:
                raise InvalidArgumentError(
                    "flashinfer: FlashInfer's merge takes decode steps (one new token per "
                    f"request) of a 16-bit model, got offsets {q_off.tolist()[:8]}, {dtype}"
                )
            num_states = check_int("num_prefix_states", num_prefix_states, low=1)
            decode_merge = DecodeMerge(
                flashinfer, (t_q, h_q, d), num_kv_heads, dtype, device, scale, cap, num_states
            )
        return cls(
            (t_q, h_q, d), (t_kv, num_kv_heads, d), dtype, device, scale, cap, backend,
            bool(one_each), causal, decode_merge,
        )  # fmt: skip

    @property
    def prefix_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Bound with ``flashinfer``: where the prefix parts write their states, ``o``
        ``[S, T_q, H_q, D]`` (model dtype) and ``lse`` ``[S, T_q, H_q]`` (float32, base 2)."""
        if self.decode_merge is None:
            raise InvalidArgumentError("prefix_states: bound without flashinfer")
        return self.decode_merge.o_states, self.decode_merge.lse_states

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        prefix_o: torch.Tensor | None = None,
        prefix_lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(o [T_q, H_q, D], lse [T_q, H_q])`` float32: every row over its whole sequence.
        Bound with ``flashinfer``, the prefix states are in :attr:`prefix_states` (pass none)
        and ``o`` comes in the model's dtype (:class:`~tokenlake.engines.kernels.
        flashinfer_merge.DecodeMerge`)."""
        self._check("q", q, self.q_shape, self.dtype)
        self._check("k", k, self.kv_shape, self.dtype)
        self._check("v", v, self.kv_shape, self.dtype)
        if self.decode_merge is not None:
            if prefix_o is not None or prefix_lse is not None:
                raise InvalidArgumentError(
                    "prefix_o: bound with flashinfer, the prefix parts write into prefix_states"
                )
            return self.decode_merge(q, k, v)
        self._check("prefix_o", prefix_o, self.q_shape, torch.float32)
        self._check("prefix_lse", prefix_lse, self.q_shape[:2], torch.float32)
        if self.one_token_each:
            return self._one_token_each(q, k, v, prefix_o, prefix_lse)
        o_s, lse_s = self.causal.run(q, k, v)
        return merge_pair(prefix_o, prefix_lse, o_s, lse_s)

    def _check(self, name: str, t: object, shape: tuple, dtype: torch.dtype) -> None:
        if not (
            isinstance(t, torch.Tensor)
            and t.shape == shape
            and t.dtype == dtype
            and t.device == self.device
        ):
            check_tensor(name, t, shape=shape, dtype=dtype, device=self.device)
            raise InvalidArgumentError(f"{name}: expected a tensor of shape {list(shape)}")

    def _one_token_each(self, q, k, v, prefix_o, prefix_lse):
        """Every request has one new token: its only key is itself, so its causal partial is
        ``o = v`` with ``lse`` the single (soft-capped) score ``s``. Merged with the prefix
        partial ``(o_p, lse_p)``: ``o = o_p + w (v - o_p)`` with ``w = sigmoid(s - lse_p)``
        (= ``exp(s - lse)``), ``lse = logaddexp(lse_p, s)``, in a few whole-batch tensor ops
        (a row without a prefix, ``lse_p = -inf``, gets ``w = 1``: exactly ``v``)."""
        t, h_q, d = self.q_shape
        heads = (self.kv_shape[1], h_q // self.kv_shape[1])  # (H_kv, group)
        if self.dtype != torch.float32:
            q, k, v = q.float(), k.float(), v.float()
        # broadcasts over the views (splitting a dim is always a view): no copy of a strided
        # k or v, so the ops are the same for every batch size
        score = (q.unflatten(1, heads) * k.unsqueeze(2)).sum(-1, keepdim=True)
        score.mul_(self.sm_scale)
        if self.logit_cap:
            score.div_(self.logit_cap).tanh_().mul_(self.logit_cap)
        prefix_lse = prefix_lse.unflatten(1, heads).unsqueeze(-1)
        weight = torch.sub(score, prefix_lse).sigmoid_()
        o = torch.lerp(prefix_o.unflatten(1, heads), v.unsqueeze(2), weight)
        return o.view(t, h_q, d), torch.logaddexp(prefix_lse, score).view(t, h_q)


def _host_offsets(name: str, indptr: object, size: int | None, total: int, what: str) -> np.ndarray:
    """int64 host copy of an int32 offsets array ``[B + 1]`` (``size`` entries when given)
    that starts at 0, never decreases and ends at ``total`` (``what`` it covers)."""
    if isinstance(indptr, torch.Tensor):
        check_tensor(name, indptr, shape=(size,), dtype=torch.int32)
        arr = indptr.cpu().numpy()
    elif isinstance(indptr, np.ndarray) and indptr.dtype.kind in "iu" and indptr.ndim == 1:
        arr = indptr
    else:
        raise InvalidArgumentError(
            f"{name}: expected an int32 tensor or an integer array, got {type(indptr).__name__}"
        )
    arr = arr.astype(np.int64)
    if len(arr) == 0 or (size is not None and len(arr) != size):
        raise InvalidArgumentError(
            f"{name}: expected shape [{'batch_size + 1' if size is None else size}], "
            f"got [{len(arr)}]"
        )
    if arr[0] != 0 or arr[-1] != total or (np.diff(arr) < 0).any():
        raise InvalidArgumentError(
            f"{name}: expected offsets from 0 to {total} ({what}), never decreasing, got "
            f"{arr.tolist()[:16]}"
        )
    return arr


def attend_with_prefix(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_indptr: torch.Tensor,
    prefix_o: torch.Tensor,
    prefix_lse: torch.Tensor,
    kv_indptr: torch.Tensor | None = None,
    sm_scale: float | None = None,
    backend: str | None = None,
    logit_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the prefix partial of a ragged batch with causal attention over its new tokens.

    Args:
        q: ``[T_q, H_q, D]`` queries of the new tokens (model dtype: float32 or bfloat16).
        k, v: ``[T_kv, H_kv, D]`` keys and values of the new tokens, same dtype as ``q``;
            ``H_q % H_kv == 0`` (GQA).
        q_indptr: int32 ``[B + 1]``; request ``b`` owns q rows ``q_indptr[b]:q_indptr[b+1]``.
        prefix_o: ``[T_q, H_q, D]`` float32, the prefix partial output (``engine.query``).
        prefix_lse: ``[T_q, H_q]`` float32, its log-sum-exp in natural log (``-inf`` for a
            row with an empty prefix).
        kv_indptr: int32 ``[B + 1]`` key offsets of each request in ``k``/``v`` (default
            ``q_indptr``); request ``b``'s q rows are its *last* keys (bottom-right causal),
            so a request may have more new keys than q rows (a chunk split across instances).
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        backend: kernel backend (``"torch"``, ``"cpu"``, ``"flashinfer"``; ``None`` by device).
        logit_cap: the attention soft cap (0: none; see :func:`tokenlake.engines.kernels.partial_attention`),
            the same the prefix partial was computed with.
    Returns:
        ``(o, lse)``: ``o`` ``[T_q, H_q, D]`` float32, attention of every row over its whole
        sequence (prefix and new tokens up to itself); ``lse`` ``[T_q, H_q]`` float32, natural log.
    """
    check_tensor("q", q, shape=(None, None, None), dtype=_DTYPES)
    check_tensor("k", k, shape=(None, None, q.shape[2]), dtype=q.dtype, device=q.device)
    bound = PrefixAttention.bind(
        q_indptr, tuple(q.shape), k.shape[1], q.dtype, kv_indptr=kv_indptr,
        num_kv_rows=k.shape[0], sm_scale=sm_scale, backend=backend, logit_cap=logit_cap,
        device=q.device,
    )  # fmt: skip
    return bound(q, k, v, prefix_o, prefix_lse)
