"""Merging attention states with FlashInfer's own kernels (CUDA): ``merge_state`` for two
states, ``merge_states`` for several, one kernel each.

NOT RUN ON A GPU. FlashInfer's convention differs from TokenLake's float32 / natural-log one:
``o`` in the model's 16-bit dtype, LSE in base 2, all contiguous. Converting at every
boundary costs kernels (a decode layer is launch-bound), so the decode path keeps FlashInfer's
form from the parts to the merge and converts once, at the end:

* :class:`DecodeMerge`: one decode step's ``S`` prefix states (the holders' parts, each written
  by :meth:`FlashInferPart.run_native <tokenlake.engines.kernels.flashinfer_backend.
  FlashInferPart.run_native>` straight into :attr:`DecodeMerge.o_states` / ``lse_states``) and
  the new token's own state (its ``v``, with its score as LSE), merged in one kernel.
* :func:`merge_states_ln`: several states per row in TokenLake's form (a holder's result comes
  over a buffer as float32), merged by ``merge_states``.

``flashinfer`` is passed in (the module, or a stand-in that records its launches on CPU).
"""

from __future__ import annotations

import math

import torch

__all__ = ["DecodeMerge", "merge_states_ln", "LOG2E", "LN2"]

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


class DecodeMerge:
    """One decode step's merge (one new token per request), bound once per batch, run every
    layer: ``S`` prefix states and the new token's state, merged by FlashInfer.

    The token's own state is ``o = v`` (of its KV head) with ``lse = s``, its scaled (and
    soft-capped) score ``q . k``. ``S = 1``: ``merge_state`` of the prefix state and that one;
    ``S > 1``: the token is state ``S`` of the stacked states, and ``merge_states`` takes all
    ``S + 1`` at once. The stack ``[S + 1, T, H_q, D]`` is this object's, allocated once:
    parts write their states into its first ``S`` slices, so nothing is copied per layer
    besides the token's ``v`` and, for ``S > 1``, the transposition to FlashInfer's
    ``[T, S + 1, H_q, D]``."""

    def __init__(
        self,
        flashinfer,
        q_shape: tuple[int, int, int],
        num_kv_heads: int,
        dtype: torch.dtype,
        device: torch.device,
        sm_scale: float,
        logit_cap: float,
        num_states: int,
    ) -> None:
        t, h_q, d = q_shape
        self.flashinfer, self.num_states = flashinfer, num_states
        self.heads = (num_kv_heads, h_q // num_kv_heads)  # (H_kv, group)
        self.sm_scale, self.logit_cap = sm_scale, logit_cap
        self.o_stack = torch.empty((num_states + 1, t, h_q, d), dtype=dtype, device=device)
        self.lse_stack = torch.empty((num_states + 1, t, h_q), dtype=torch.float32, device=device)

    @property
    def o_states(self) -> torch.Tensor:
        """``[S, T, H_q, D]``: where the prefix parts write their ``o`` (one slice each)."""
        return self.o_stack[: self.num_states]

    @property
    def lse_states(self) -> torch.Tensor:
        """``[S, T, H_q]`` float32, base 2: where the prefix parts write their LSE."""
        return self.lse_stack[: self.num_states]

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` ``[T, H_q, D]``, ``k``/``v`` ``[T, H_kv, D]`` (the model's dtype, any strides)
        with the prefix states written -> ``o`` ``[T, H_q, D]`` in the model's dtype (as
        FlashInfer's merge writes it: the layer's next op, the output projection, takes that
        dtype, so a float32 copy would only be converted back) and ``lse`` ``[T, H_q]``
        float32, natural log."""
        t, h_q, d = q.shape
        s = self.num_states
        # the token's state: its v for every q head of its group, its score as LSE (base 2)
        self.o_stack[s].view(t, *self.heads, d).copy_(v.unsqueeze(2))
        score = self.lse_stack[s].view(t, *self.heads, 1)
        # bmm of q's rows by their k (float32 accumulation), scaled into the float32 stack;
        # the softmax scale and base 2 in one multiply when there is no soft cap
        qk = torch.matmul(q.view(t, *self.heads, d), k.unsqueeze(-1))
        if self.logit_cap:
            torch.mul(qk, self.sm_scale / self.logit_cap, out=score)
            score.tanh_().mul_(self.logit_cap * LOG2E)
        else:
            torch.mul(qk, self.sm_scale * LOG2E, out=score)
        fi = self.flashinfer
        if s == 1:
            o, lse = fi.merge_state(
                self.o_stack[0], self.lse_stack[0], self.o_stack[1], score.view(t, h_q)
            )
        else:
            o, lse = fi.merge_states(
                self.o_stack.transpose(0, 1).contiguous(),
                self.lse_stack.transpose(0, 1).contiguous(),
            )
        return o, lse.mul_(LN2)


def merge_states_ln(
    flashinfer, o: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``o`` ``[T, K, H, D]`` float32, ``lse`` ``[T, K, H]`` natural log (``-inf``: no state)
    -> the rows' merged ``(o [T, H, D], lse [T, H])`` float32, natural log, by one
    ``merge_states`` over the states in ``dtype`` (16-bit, the model's). A row with no finite
    state gets ``o = 0``, ``lse = -inf`` (FlashInfer's empty state)."""
    merged_o, merged_lse = flashinfer.merge_states(o.to(dtype), lse.mul(LOG2E))
    return merged_o.float(), merged_lse.mul_(LN2)
