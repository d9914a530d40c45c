"""One iteration's life inside the pool: plan it (admit new requests, reserve slots and
replica copies, build the plans), then settle it at commit or release it at abort. The
:class:`tokenlake.Pool` facade validates, registers the iteration in flight and calls these."""

from __future__ import annotations

import numpy as np

from tokenlake.cluster import locality
from tokenlake.cluster.balancer import AccessStats, BalancerConfig, plan_replications
from tokenlake.cluster.placement import Placement
from tokenlake.cluster.remote_reads import RemoteReads, record_remote_reads
from tokenlake.cluster.slots import SlotAllocator
from tokenlake.config import PoolConfig
from tokenlake.errors import PoolFullError
from tokenlake.iteration import admission, tier_moves
from tokenlake.iteration.engine_slots import assign as engine_assign
from tokenlake.iteration.inflight import InFlight
from tokenlake.iteration.instance_loss import FailoverLog
from tokenlake.iteration.record import Iteration
from tokenlake.iteration.sealing import seal_chunk
from tokenlake.iteration.segment_planner import SegmentPlanner, source_location
from tokenlake.planning.builder import PlanBuilder, TierMoves
from tokenlake.stats import PoolStats
from tokenlake.tree.node import DEMOTED, TIER_DROP, Evicted
from tokenlake.tree.prefix_tree import PrefixTree


class IterationPlanner:
    """Plans, settles and releases iterations over the pool's components (shared, not owned)."""

    def __init__(
        self,
        config: PoolConfig,
        tree: PrefixTree,
        placement: Placement,
        allocators: list[SlotAllocator],
        access: AccessStats,
        balancer: BalancerConfig,
        stats: PoolStats,
        requests: dict,
        inflight: InFlight,
        failover: FailoverLog,
        seed: int,
        engine_slots: bool = False,
    ) -> None:
        self.config, self.tree, self.placement = config, tree, placement
        self.allocators, self.access, self.balancer = allocators, access, balancer
        self.stats, self.requests, self.inflight, self.failover = (
            stats,
            requests,
            inflight,
            failover,
        )
        self.seed = seed
        # the engines allocate every slot and write every segment in place: nothing to
        # place, put, copy or replicate (see Pool's ``engine_slots``)
        self.engine_slots = engine_slots
        n = config.num_instances
        priced = balancer.hop_bytes > 0
        beside = self._not_overloaded if priced else None
        self.remote = RemoteReads(n, balancer.decay) if priced else None
        self.segments = SegmentPlanner(tree, placement, allocators, beside)
        m = config.model
        q_row_bytes = m.num_layers * (
            m.q_bytes_per_token_layer + 4 * m.num_q_heads * (m.head_dim + 1)
        )
        self.builder = PlanBuilder(
            tree.table, config.segment_len, n, q_row_bytes, m.kv_bytes_per_token,
            config.segment_bytes, balancer.hop_bytes, engine_written=engine_slots,
        )  # fmt: skip

    def _light(self) -> bool:
        """Hops priced and at most one running request per live instance: no instance
        queues behind another, so recent load says nothing about imbalance, and spreading a
        request's reads only adds hops (unpriced, every decision stays as it was)."""
        return self.remote is not None and len(self.requests) <= len(self.placement.live)

    def _not_overloaded(self, instance_id: int) -> bool:
        """Hop-priced placement keeps a request's segments together on a live instance whose
        window load is within the balancer's factor of the mean, and always while at most
        one request per instance runs: then no instance queues work behind another's, and
        the recent load of a light stream (all of it on the instance that served the last
        request) says nothing about imbalance."""
        live = self.placement.live
        if instance_id not in live:
            return False
        if self._light():
            return True
        load = self.access.window_load
        mean = float(load[list(live)].mean())
        return mean <= 0 or load[instance_id] <= self.balancer.overload_factor * mean

    def plan(self, it: Iteration, dops, instances, matches, busy, engine_slots=None) -> None:
        """Admit ``it``'s new requests, reserve its writes and replica copies, build its plans.
        ``engine_slots``: ``{request_id: (instance, slots)}``, with engine-allocated slots."""
        tree, planner, cs = self.tree, self.segments, it.chunk_set
        for i, c in cs.new:
            pc = admission.admit(c, matches[c.request_id], tree)
            self.requests[c.request_id] = pc.state
            cs.admitted(i, pc)
            it.new_chunks.append(pc)
        it.chunks = cs.planned_chunks
        rest = it.chunks
        if self.engine_slots:
            engine_assign(rest, engine_slots or {}, planner.num_new_slots)
        hits = tier_moves.tier_hits(it.new_chunks)  # segments in the host tier: loaded first
        needed = sum(planner.num_new_slots(pc) for pc in rest if pc.engine_slots is None)
        needed += len(hits)
        if needed > planner.free_capacity():
            raise PoolFullError(
                f"batches: need {needed} new slots, only {planner.free_capacity()} free or "
                "evictable (the rest is pinned by running requests or read in flight)"
            )
        it.tier_hit_tokens = tier_moves.hit_tokens(it.new_chunks, self.config.segment_len)
        tier_moves.plan_loads(it, hits, planner, self.placement)
        loaded = {node.key: loc for node, loc in it.loads}
        for pc in rest:
            planner.plan_writes(pc, it.victims, loaded)
        if not self.engine_slots:
            self._reserve_replications(it)
        for pc in it.new_chunks:  # evictions above may have taken the copy source chosen earlier
            if pc.source is not None:
                for w in pc.writes:
                    if w.copy_from is not None and w.copy_from not in pc.source.replicas:
                        # pinned: its last copy stays (or it is loaded from the host tier)
                        w.copy_from = source_location(pc.source, loaded)
        free = [i for i in self.placement.live if i not in busy]
        base_load = locality.prefer_home(
            self.inflight.total_load(self.access.recent_load), cs, dops, self.tree.table,
            self.config.segment_len, self.placement.live, self.balancer,
            light=self._light(),
        )  # fmt: skip
        demotions = [(v.location, v.block) for v in it.victims if v.kind == DEMOTED]
        plans, traffic, reads, copied = self.builder.build(
            (self.inflight.pool_id, it.epoch),
            cs,
            dops,
            free,
            it.replications,
            instances,
            base_load,
            (self.seed * 1_000_003 + it.epoch) % 2**62,
            TierMoves(it.loads, demotions),
        )
        it.demotions_copied = copied
        self._add_readers(it, reads.rows)
        it.plans, it.traffic, it.reads = plans, traffic, reads
        it.instances = traffic.instances

    def settle(self, it: Iteration, live: list[int]) -> None:
        """Commit ``it``: seal, add its replicas, book accesses, LRU, load and counters."""
        tree, r = self.tree, it.reads
        gone = tier_moves.settle(it, tree, self.allocators, committed=True)
        for pc in it.new_chunks:  # the admitted prefix was read: the most recent for LRU
            path = pc.state.tree_nodes + ([pc.source] if pc.source else [])
            tree.touch(path)
            tree.mark_reused(path)
        tree.forget([v.node for v in it.victims] + gone)
        tree.touch_replicas(r.chosen_idx.tolist(), r.chosen_inst.tolist())
        self.access.begin_iteration()
        self.access.record_accesses(r.rows, r.query_rows, r.access_tokens)
        for pc in it.chunks:
            self.stats.record_writes(pc.writes)
            seal_chunk(pc, tree, self.allocators, self.stats)
        self.stats.num_put_tokens += it.chunk_set.commit_in_place()
        if it.failover is not None:  # its replication decision saw these drops and keys
            self.failover.settle(it.failover)
        for node, _, dst in it.replications:  # the node is read: it is still in the tree
            if any(r.instance_id == dst.instance_id for r in node.replicas):
                self.allocators[dst.instance_id].free(dst.slot_id)  # a restored copy won
            else:
                tree.add_replica(node, dst)
        self._drop_readers(it)
        self._record_remote_reads(it)
        self.access.record_load(it.traffic.load, live)
        self.stats.record_iteration(it.traffic, it.new_chunks, _num_pool_evictions(it.victims))
        self.stats.record_tier(it, self.config.segment_bytes)
        self.stats.record_gen_plans(it.gen_plans_s)

    def release(self, it: Iteration, executed: bool) -> None:
        """Undo everything :meth:`plan` reserved for ``it`` (see :meth:`tokenlake.Pool.abort`)."""
        tree = self.tree
        for pc in reversed(it.chunks):
            for w in reversed(pc.writes):
                if w.pending is not None and w.pending.state == "reserved":
                    tree.abort(w.pending)
        self._drop_readers(it)
        admission.release(it.new_chunks, self.requests, tree)
        restored = set()
        if not executed and it.victims:
            done = tree.restore(it.victims, self.placement.live)
            restored = {v.location for v, ok in zip(it.victims, done, strict=True) if ok}
        gone = tier_moves.settle(it, tree, self.allocators, False, frozenset(restored))
        tree.forget([v.node for v in it.victims if v.location not in restored] + gone)
        for loc in it.new_slots():
            if loc not in restored:
                self.allocators[loc.instance_id].free(loc.slot_id)
        left = [v for v in it.victims if v.location not in restored]
        self.stats.num_evictions += _num_pool_evictions(left)

    def _record_remote_reads(self, it: Iteration) -> None:
        """A committed small decode: the shared segments it read on other instances."""
        cs = it.chunk_set
        if self.remote is None or len(it.plans.query_plans) != 1:
            return
        if not locality.is_small_decode(cs, [1], self.balancer.small_decode_rows):
            return
        r, tree = it.reads, self.tree
        record_remote_reads(
            self.remote, tree.table, lambda row: tree.node_at(row).key,
            it.plans.query_plans[0].origin, r.rows, r.chosen_idx, r.chosen_inst,
        )  # fmt: skip

    def _add_readers(self, it: Iteration, idx: np.ndarray) -> None:
        """``it`` reads the table rows ``idx`` (a reader per occurrence until it ends)."""
        self.tree.add_readers(idx, 1)
        it.read_idx.append(idx)

    def _drop_readers(self, it: Iteration) -> None:
        for idx in it.read_idx:
            self.tree.add_readers(idx, -1)

    def _reserve_replications(self, it: Iteration) -> None:
        """Replication orders, decided every ``interval`` epochs, and at once after an
        instance was dropped or restored (fail-over: segments that lost a replica are
        eligible), with at most one decision in flight. Each source's whole path is read by
        the iteration (so no copy of it is evicted, and readers stay closed under
        ancestors), then a slot is reserved on the destination."""
        if (
            (it.epoch - 1) % self.balancer.interval and not self.failover.unseen
        ) or self.inflight.deciding_replication:
            return
        it.decided_replication = True
        it.failover = self.failover.snapshot()
        capacity = self.config.num_slots * len(self.placement.live)
        live = list(self.placement.live)
        orders = plan_replications(
            self.tree, self.access, live, self.balancer, capacity, failover=it.failover[1],
            remote=self.remote, light=self._light(),
        )  # fmt: skip
        paths = []
        for node, _, _ in orders:
            while node is not self.tree.root and node.idx >= 0:
                paths.append(node.idx)
                node = node.parent
        self._add_readers(it, np.asarray(paths, dtype=np.int64))
        for node, src, dst in orders:
            loc = self.segments.reserve_replica(dst, it.victims)
            if loc is not None:
                it.replications.append((node, src, loc))


def _num_pool_evictions(victims: list[Evicted]) -> int:
    """Evictions from the pool (a host-tier block's own eviction is not one)."""
    return sum(v.kind != TIER_DROP for v in victims)
