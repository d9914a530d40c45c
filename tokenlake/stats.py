"""Pool counters, reported as one plain dict by :meth:`tokenlake.Pool.get_stats`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tokenlake.plan_builder import Traffic
    from tokenlake.pool import Pool


def coefficient_of_variation(values: np.ndarray) -> float:
    """std / mean (0 when the mean is 0)."""
    values = np.asarray(values, dtype=np.float64)
    mean = float(values.mean()) if values.size else 0.0
    return float(values.std() / mean) if mean > 0 else 0.0


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
        self.num_replications = 0
        self.query_bytes = 0.0
        self.put_bytes = 0.0
        self.replication_bytes = 0.0
        self.load = np.zeros(num_instances, dtype=np.float64)

    def record_admission(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.num_requests += 1
        self.num_prompt_tokens += num_prompt_tokens
        self.num_hit_tokens += num_hit_tokens

    def undo_admissions(self, chunks) -> None:
        for pc in chunks:
            self.num_requests -= 1
            self.num_prompt_tokens -= len(pc.token_ids)
            self.num_hit_tokens -= pc.start

    def record_iteration(self, traffic: Traffic) -> None:
        self.num_iterations += 1
        self.load += traffic.load
        self.query_bytes += traffic.query_bytes
        self.put_bytes += traffic.put_bytes
        self.replication_bytes += traffic.replication_bytes
        self.num_replications += traffic.num_replications

    def as_dict(self, pool: Pool) -> dict:
        """Counters since the pool was created.

        - ``hit_rate``: prompt tokens served from the pool / prompt tokens admitted.
        - ``instance_load``: prefix tokens read per instance (query rows × tokens), in total;
          ``load_cv`` its coefficient of variation; ``window_load`` / ``window_load_cv`` the
          same over the balancer's sliding window; ``load_cv_over_time`` the CV of each
          consecutive window of iterations (oldest first) and ``mean_load_cv`` their mean.
        - ``query_bytes`` / ``put_bytes`` / ``replication_bytes``: bytes planned to cross
          between instances (query rows to remote holders and their results back, new KV to
          remote homes, segment copies), all layers.
        - storage: segments, replicas, slots used, evictions, dedup savings.
        """
        window = pool.access.window_load
        over_time = pool.access.cv_history
        live = list(pool.live_instances)
        seg_bytes = pool.config.segment_bytes
        slots_used = [a.num_used for a in pool.allocators]
        return {
            "num_requests": self.num_requests,
            "num_running_requests": len(pool.requests),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_hit_tokens": self.num_hit_tokens,
            "hit_rate": self.num_hit_tokens / self.num_prompt_tokens
            if self.num_prompt_tokens
            else 0.0,
            "num_iterations": self.num_iterations,
            "instance_load": self.load.tolist(),
            "load_cv": coefficient_of_variation(self.load[live]),
            "window_load": window.tolist(),
            "window_load_cv": coefficient_of_variation(window[live]),
            "load_cv_over_time": list(over_time),
            "mean_load_cv": float(np.mean(over_time)) if over_time else 0.0,
            "query_bytes": self.query_bytes,
            "put_bytes": self.put_bytes,
            "replication_bytes": self.replication_bytes,
            "num_replications": self.num_replications,
            "num_put_tokens": self.num_put_tokens,
            "num_copy_tokens": self.num_copy_tokens,
            "num_segments": pool.tree.num_nodes,
            "num_replicas": pool.tree.num_replicas,
            "num_replicated_segments": int((pool.tree.table.num_replicas > 1).sum()),
            "num_dedup_segments": self.num_dedup_segments,
            "num_evictions": pool.planner.num_evictions,
            "slots_used": slots_used,
            "bytes_stored": sum(slots_used) * seg_bytes,
            "bytes_saved_by_dedup": self.num_dedup_segments * seg_bytes,
            "live_instances": live,
        }
