"""Dispatch: which instances run each batch. This is the simple locality rule; the
bipartite-matching dispatcher of §5 replaces it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenlake.errors import InvalidArgumentError


def simple_dispatch(scores: np.ndarray, dops: Sequence[int]) -> list[tuple[int, ...]]:
    """Give each batch the ``dops[b]`` free instances holding most of its data.

    Args:
        scores: float ``[num_batches, num_instances]``, e.g. segments of the batch per instance.
        dops: degree of parallelism of each batch; ``sum(dops) <= num_instances``.
    Returns:
        ``groups[b]``: the instance ids of batch ``b``, distinct across batches.
    """
    num_batches, num_instances = scores.shape
    if sum(dops) > num_instances:
        raise InvalidArgumentError(
            f"dops: {sum(dops)} sub-batches need more than the {num_instances} instances"
        )
    taken = np.zeros(num_instances, dtype=bool)
    groups: list[tuple[int, ...]] = [()] * num_batches
    for b in np.argsort(-scores.sum(axis=1), kind="stable"):
        masked = np.where(taken, -np.inf, scores[b])
        chosen = [int(i) for i in np.argsort(-masked, kind="stable")[: dops[b]]]
        taken[chosen] = True
        groups[b] = tuple(chosen)
    return groups
