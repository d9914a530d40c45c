"""Pool counters, reported as one plain dict by :meth:`tokenlake.Pool.get_stats`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from tokenlake import latency
from tokenlake.cluster.balancer import AccessStats, coefficient_of_variation
from tokenlake.tree.node import TIER_DROP

if TYPE_CHECKING:
    from tokenlake.cluster.slots import SlotAllocator
    from tokenlake.iteration.record import Iteration
    from tokenlake.planning.builder import Traffic
    from tokenlake.tree.prefix_tree import PrefixTree
    from tokenlake.tree.tier_blocks import HostTier


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
        self.num_evictions = 0
        # the host tier (committed iterations): hits, loads into the pool, evictions into it
        self.num_tier_hit_tokens = 0
        self.num_promotions = 0
        self.num_demotions = 0
        self.num_tier_evictions = 0
        self.load = np.zeros(num_instances, dtype=np.float64)
        self.latency: dict[str, int] = {}  # histograms (tokenlake.latency)

    def record_gen_plans(self, seconds: float) -> None:
        """How long ``gen_plans`` took for an iteration now committed."""
        latency.observe(self.latency, "gen_plans", seconds)

    def record_writes(self, writes) -> None:
        for w in writes:
            self.num_put_tokens += w.num_new
            if w.copy_from is not None:
                self.num_copy_tokens += w.num_before

    def record_iteration(self, traffic: Traffic, new_chunks, num_evictions: int) -> None:
        """A committed iteration: its traffic, the requests it admitted, its evictions."""
        for pc in new_chunks:
            self.num_requests += 1
            self.num_prompt_tokens += len(pc.token_ids)
            self.num_hit_tokens += pc.start
        self.num_evictions += num_evictions
        self.num_iterations += 1
        self.load += traffic.load
        self.query_bytes += traffic.query_bytes
        self.put_bytes += traffic.put_bytes
        self.replication_bytes += traffic.replication_bytes
        self.num_replications += traffic.num_replications

    def record_tier(self, it: Iteration, segment_bytes: int) -> None:
        """A committed iteration's host-tier moves: its hits, loads, demotions copied and
        segments the tier evicted."""
        self.num_tier_hit_tokens += it.tier_hit_tokens
        self.num_promotions += len(it.loads)
        self.num_demotions += len(it.demotions_copied)
        self.num_tier_evictions += sum(v.kind == TIER_DROP for v in it.victims)

    def tier_dict(self, tier: HostTier, segment_bytes: int) -> dict:
        """The host tier's counters: ``tier_hit_tokens`` (prompt tokens served from segments
        in the tier, part of ``num_hit_tokens``), ``pool_hit_tokens`` (the rest),
        ``tier_promotions`` / ``tier_demotions`` (segments loaded into the pool / copied into
        the tier) and their bytes, ``tier_evictions`` (segments the full tier forgot),
        ``tier_blocks`` / ``tier_blocks_used`` / ``tier_segments`` and ``tier_bytes_stored``."""
        return {
            "tier_blocks": tier.num_blocks,
            "tier_blocks_used": tier.num_used,
            "tier_segments": tier.num_segments,
            "tier_bytes_stored": tier.num_used * segment_bytes,
            "tier_hit_tokens": self.num_tier_hit_tokens,
            "pool_hit_tokens": self.num_hit_tokens - self.num_tier_hit_tokens,
            "tier_promotions": self.num_promotions,
            "tier_demotions": self.num_demotions,
            "tier_promotion_bytes": self.num_promotions * segment_bytes,
            "tier_demotion_bytes": self.num_demotions * segment_bytes,
            "tier_evictions": self.num_tier_evictions,
        }

    def as_dict(
        self,
        *,
        tree: PrefixTree,
        access: AccessStats,
        allocators: Sequence[SlotAllocator],
        live: Sequence[int],
        segment_bytes: int,
        num_running: int,
        num_in_flight: int,
        tier: HostTier,
    ) -> dict:
        """Counters since the pool was created, with the pool's parts that hold the rest:
        ``num_running`` requests, ``num_in_flight`` iterations.

        - ``hit_rate``: prompt tokens served from the pool / prompt tokens admitted.
        - ``instance_load``: prefix tokens read per instance (query rows × tokens), in total;
          ``load_cv`` its coefficient of variation; ``window_load`` / ``window_load_cv`` the
          same over the balancer's sliding window; ``load_cv_over_time`` the CV of each
          consecutive window of iterations (oldest first; the most recent 1,024 windows),
          ``num_load_cv_windows`` how many windows there were and ``mean_load_cv`` the mean
          over all of them.
        - everything counts committed iterations only: an aborted one leaves no trace.
        - ``query_bytes`` / ``put_bytes`` / ``replication_bytes``: bytes planned to cross
          between instances (query rows to remote holders and their results back, new KV to
          remote homes, segment copies), all layers.
        - storage: segments, replicas, slots used, evictions, dedup savings.
        - the host tier below the pool: see :meth:`tier_dict`; ``num_segments`` counts
          segments in the pool and in the tier.
        - ``gen_plans_seconds``: latency histogram of the ``gen_plans`` calls of committed
          iterations: ``buckets`` ``[[upper bound s, count <= it], ...]`` (cumulative, last
          bound ``inf``), ``sum``, ``count``.
        """
        window = access.window_load
        live = list(live)
        slots_used = [a.num_used for a in allocators]
        return {
            "num_requests": self.num_requests,
            "num_running_requests": num_running,
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
            "load_cv_over_time": list(access.cv_history),
            "num_load_cv_windows": access.num_cv_windows,
            "mean_load_cv": access.mean_cv,
            "query_bytes": self.query_bytes,
            "put_bytes": self.put_bytes,
            "replication_bytes": self.replication_bytes,
            "num_replications": self.num_replications,
            "num_put_tokens": self.num_put_tokens,
            "num_copy_tokens": self.num_copy_tokens,
            "num_segments": tree.num_nodes,
            "num_replicas": tree.num_replicas,
            "num_replicated_segments": int((tree.table.num_replicas > 1).sum()),
            "num_dedup_segments": self.num_dedup_segments,
            "num_evictions": self.num_evictions,
            "num_iterations_in_flight": num_in_flight,
            "slots_used": slots_used,
            "bytes_stored": sum(slots_used) * segment_bytes,
            "bytes_saved_by_dedup": self.num_dedup_segments * segment_bytes,
            "live_instances": live,
            "gen_plans_seconds": _histogram_dict(self.latency, "gen_plans"),
            **self.tier_dict(tier, segment_bytes),
        }


def _histogram_dict(counters: dict, name: str) -> dict:
    h = latency.histograms({f"{name}:count": 0, **counters})[name]
    return {"buckets": [list(b) for b in h.buckets], "sum": h.sum_s, "count": h.count}
