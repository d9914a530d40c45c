"""Dispatch (paper §5): which instance runs each sub-batch, by minimum-cost bipartite
matching of sub-batches to instances, the cost being the bytes the choice puts on the wire."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenlake.errors import InvalidArgumentError

_NO_ASSIGNMENT = "instances: no assignment of sub-batches to distinct allowed live instances exists"


def traffic_cost(
    query_rows: np.ndarray,
    put_tokens: np.ndarray,
    q_row_bytes: float,
    kv_token_bytes: float,
    hop_bytes: float = 0.0,
) -> np.ndarray:
    """Bytes sent if sub-batch ``u`` runs on instance ``v`` (§5.2's edge weight, negated),
    plus ``hop_bytes`` per remote holder.

    Args:
        query_rows: ``[U, N]`` query rows sub-batch ``u`` must send to holder ``k``
            (its requests with prefix pages on ``k``).
        put_tokens: ``[U, N]`` new-KV tokens sub-batch ``u`` stores on home ``k``.
        q_row_bytes: bytes per query row and remote holder (q out, ``(o, lse)`` back).
        kv_token_bytes: bytes per new-KV token.
        hop_bytes: the fixed cost of one remote holder (round trip, merge, per-layer
            signals) in bytes of traffic it is worth; 0 prices bytes only. A small decode's
            rows are few, so its bytes barely tell instances apart while each holder it
            makes remote costs a fixed time: this term keeps it where its pages are.
    Returns:
        ``[U, N]``: everything not local to ``v`` crosses the network.
    """
    q_total = query_rows.sum(axis=1, keepdims=True)
    p_total = put_tokens.sum(axis=1, keepdims=True)
    cost = q_row_bytes * (q_total - query_rows) + kv_token_bytes * (p_total - put_tokens)
    if hop_bytes:
        holds = query_rows > 0
        cost = cost + hop_bytes * (holds.sum(axis=1, keepdims=True) - holds)
    return cost


def hungarian_dispatch(
    cost: np.ndarray, live: Sequence[int], allowed: np.ndarray | None = None
) -> np.ndarray:
    """Assign every sub-batch (row) a distinct live instance with minimum total cost.

    ``allowed`` (bool ``[U, N]``, optional) restricts sub-batch ``u`` to the instances where
    it is true (fixed-role deployments such as xPyD). Returns ``origins[u]``, instance ids.
    Raises if there are more sub-batches than live instances, or no assignment respects
    ``allowed``.
    """
    num_sub, _ = cost.shape
    live = np.asarray(live, dtype=np.int64)
    if num_sub > len(live):
        raise InvalidArgumentError(
            f"dops: {num_sub} sub-batches need more than the {len(live)} live instances"
        )
    sub_cost = cost[:, live]
    if num_sub == 1:  # the common decode lane: the cheapest allowed column, as the solver picks it
        ok = np.arange(len(live)) if allowed is None else np.flatnonzero(allowed[0, live])
        if not len(ok):
            raise InvalidArgumentError(_NO_ASSIGNMENT)
        return live[ok[np.argmin(sub_cost[0, ok])]].reshape(1)
    if allowed is not None:
        # a cost above any feasible total makes a forbidden edge the last resort; if the
        # optimum still uses one, no feasible assignment exists
        forbidden = ~allowed[:, live]
        big = (np.abs(sub_cost).sum() + 1.0) * (num_sub + 1)
        sub_cost = np.where(forbidden, big, sub_cost)
    # imported here: scipy costs ~1 s to import and engine processes never dispatch
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(sub_cost)
    if allowed is not None and forbidden[rows, cols].any():
        raise InvalidArgumentError(_NO_ASSIGNMENT)
    origins = np.empty(num_sub, dtype=np.int64)
    origins[rows] = live[cols]
    return origins
