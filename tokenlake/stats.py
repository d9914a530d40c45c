"""Pool counters, reported as one plain dict by :meth:`tokenlake.Pool.get_stats`."""

from __future__ import annotations

import numpy as np


def coefficient_of_variation(values: np.ndarray) -> float:
    """std / mean (0 when the mean is 0)."""
    mean = float(np.mean(values)) if len(values) else 0.0
    return float(np.std(values) / mean) if mean > 0 else 0.0


class PoolStats:
    """Counters the pool updates as it plans and commits."""

    def __init__(self, num_instances: int) -> None:
        self.num_requests = 0
        self.num_prompt_tokens = 0
        self.num_hit_tokens = 0
        self.num_dedup_segments = 0
        self.num_iterations = 0
        self.num_put_tokens = 0
        self.num_copy_tokens = 0
        self.load = np.zeros(num_instances, dtype=np.float64)

    def record_admission(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.num_requests += 1
        self.num_prompt_tokens += num_prompt_tokens
        self.num_hit_tokens += num_hit_tokens

    def as_dict(self) -> dict:
        """Counters since the pool was created.

        ``hit_rate``: prompt tokens served from the pool / prompt tokens admitted;
        ``instance_load``: prefix tokens read per instance (query rows × tokens);
        ``load_cv``: coefficient of variation of ``instance_load``.
        """
        return {
            "num_requests": self.num_requests,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_hit_tokens": self.num_hit_tokens,
            "hit_rate": self.num_hit_tokens / self.num_prompt_tokens
            if self.num_prompt_tokens
            else 0.0,
            "num_dedup_segments": self.num_dedup_segments,
            "num_iterations": self.num_iterations,
            "num_put_tokens": self.num_put_tokens,
            "num_copy_tokens": self.num_copy_tokens,
            "instance_load": self.load.tolist(),
            "load_cv": coefficient_of_variation(self.load),
        }
