"""The control-plane facade: composes the prefix tree, placement, slot allocators, segment
planner, balancer, dispatcher and plan builder; owns the running requests and the
iterations in flight (reserve → transfer → commit | abort), several at once."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

import numpy as np

from tokenlake import admission, instance_loss
from tokenlake.balancer import AccessStats, BalancerConfig, plan_replications
from tokenlake.config import PoolConfig
from tokenlake.errors import (
    InvalidArgumentError,
    IterationStateError,
    PoolFullError,
    StalePlanError,
    UnknownRequestError,
)
from tokenlake.iteration import Iteration, touched_instances
from tokenlake.keys import SegmentHasher
from tokenlake.load_model import LoadModel
from tokenlake.placement import Placement
from tokenlake.plan_builder import PlanBuilder
from tokenlake.plans import Chunk, Plans
from tokenlake.pool_checks import check_pool_invariants
from tokenlake.pool_view import PrefixTreeView
from tokenlake.prefix_tree import PrefixTree
from tokenlake.requests import RequestState
from tokenlake.sealing import seal_chunk
from tokenlake.segment_planner import SegmentPlanner
from tokenlake.slots import SlotAllocator
from tokenlake.stats import PoolStats
from tokenlake.validate import check_bool, check_int, check_request_id, check_sequence, fail


class Pool:
    """A pool of ``config.num_instances`` instances' KV slots behind one prefix tree.

    Per iteration: ``gen_plans`` (reserves slots, pins prefixes, orders replications) → the
    data plane executes the plans → ``commit`` (seals full segments, deduplicating; adds the
    new replicas) or ``abort`` (undoes all). Several iterations may be in flight at once,
    each over its own requests and its own compute instances (``free_instances``); each is
    committed or aborted on its own, in any order. ``finish`` releases a request's pins and
    keeps its partial tail for a later turn. ``load_model`` enables :meth:`get_cache_load`.

    The components (``tree``, ``allocators``, ``placement``, ``access``, ``requests``) are
    exposed for inspection and tests; change the pool only through its methods.
    """

    def __init__(
        self,
        config: PoolConfig,
        hasher: SegmentHasher | None = None,
        balancer: BalancerConfig | None = None,
        load_model: LoadModel | None = None,
        seed: int = 0,
    ) -> None:
        for name, value, kind in (
            ("config", config, PoolConfig),
            ("hasher", hasher, SegmentHasher),
            ("balancer", balancer, BalancerConfig),
            ("load_model", load_model, LoadModel),
        ):
            if not isinstance(value, kind) and (value is not None or kind is PoolConfig):
                raise fail(name, f"a {kind.__name__}", value)
        self.seed = check_int("seed", seed, low=0, high=2**62)
        self.config = config
        self.hasher = hasher if hasher is not None else SegmentHasher(config.namespace)
        self.balancer = balancer if balancer is not None else BalancerConfig()
        self.load_model = load_model
        n = config.num_instances
        self.tree = PrefixTree(config.segment_len, self.hasher, max_replicas=n)
        self.placement = Placement(range(n), seed=self.hasher.seed)
        self.allocators = [SlotAllocator(config.num_slots) for _ in range(n)]
        self.access = AccessStats(n, self.tree, self.balancer)
        self.planner = SegmentPlanner(self.tree, self.placement, self.allocators)
        m = config.model
        q_row_bytes = m.num_layers * (
            m.q_bytes_per_token_layer + 4 * m.num_q_heads * (m.head_dim + 1)
        )
        self.builder = PlanBuilder(
            self.tree.table,
            config.segment_len,
            n,
            q_row_bytes,
            m.kv_bytes_per_token,
            config.segment_bytes,
        )
        self.stats = PoolStats(n)
        self.requests: dict[int | str, RequestState] = {}
        self.pool_id = uuid.uuid4().hex  # binds plans to this pool object
        self._view = PrefixTreeView(self.tree)
        self._epoch = 0  # the last epoch handed out; epochs are never reused
        self._inflight: dict[int, Iteration] = {}  # in planning order
        self._busy_requests: dict[int | str, int] = {}  # request id -> epoch in flight
        # fail-over: drops/restores so far, how many a committed decision has seen, and the
        # keys of segments that lost a replica to a drop (eligible for a copy, see balancer)
        self._membership_changes = self._replicated_changes = 0
        self._lost_replica: set[int] = set()
        # committed iterations when the last committed replication decision was planned

    # ---- reading ---------------------------------------------------------------------------
    def get_prefix_tree(self) -> PrefixTreeView:
        return self._view

    @property
    def live_instances(self) -> tuple[int, ...]:
        return tuple(sorted(self.placement.live))

    @property
    def busy_instances(self) -> frozenset[int]:
        """Compute instances running an iteration in flight (its sub-batches' origins)."""
        return frozenset(i for it in self._inflight.values() for i in it.origins)

    @property
    def free_instances(self) -> tuple[int, ...]:
        """Live instances no iteration in flight runs on: where ``gen_plans`` may dispatch."""
        busy = self.busy_instances
        return tuple(i for i in self.live_instances if i not in busy)

    @property
    def active_epochs(self) -> tuple[int, ...]:
        """Epochs of the iterations in flight, oldest first."""
        return tuple(self._inflight)

    @property
    def active_epoch(self) -> int | None:
        """The newest epoch in flight, or ``None``. With several in flight use
        :attr:`active_epochs` / :meth:`is_active`; kept for single-iteration callers."""
        return next(reversed(self._inflight), None)

    def is_active(self, plans: Plans | int) -> bool:
        """Whether ``plans`` (or an epoch) is an iteration of this pool in flight."""
        if isinstance(plans, Plans):
            return plans.pool_id == self.pool_id and plans.epoch in self._inflight
        return isinstance(plans, int) and plans in self._inflight

    def iterations_in_flight(self) -> tuple[Iteration, ...]:
        return tuple(self._inflight.values())

    def in_flight_epoch(self, request_id: int | str) -> int | None:
        """The epoch of the iteration in flight that includes ``request_id``, or ``None``."""
        return self._busy_requests.get(check_request_id("request_id", request_id))

    def num_stored_tokens(self, request_id: int | str) -> int:
        return self._state(request_id).num_tokens

    def free_capacity(self) -> int:
        """Slots obtainable now without touching pinned or in-flight data."""
        return self.planner.free_capacity()

    def get_cache_load(
        self, reqs: Sequence[tuple[int, int]], tree: PrefixTreeView | None = None
    ) -> float:
        """``L`` in ``[0, 1)``: the share of the cluster's time TokenLake needs for ``reqs``,
        a list of ``(prefix_len, input_len)`` (§6.1). Needs ``load_model``."""
        self._check_view(tree)
        check_sequence("reqs", reqs)
        for i, pair in enumerate(reqs):
            check_sequence(f"reqs[{i}]", pair, length=2)
            for j, value in enumerate(pair):
                check_int(f"reqs[{i}][{j}]", value, low=0, high=2**40)
        if self.load_model is None:
            raise InvalidArgumentError(
                "load_model: construct the Pool with a LoadModel to use get_cache_load"
            )
        pairs = [(int(p), int(n)) for p, n in reqs]
        return self.load_model.cache_load(pairs, len(self.placement.live))

    # ---- an iteration --------------------------------------------------------------------
    def gen_plans(
        self,
        batches: Sequence[Sequence[Chunk]],
        dops: Sequence[int] | None = None,
        tree: PrefixTreeView | None = None,
        instances: Sequence[Sequence[int] | None] | None = None,
    ) -> Plans:
        """Plan one iteration: where each batch runs and where its prefix and new KV live.

        Args:
            batches: the scheduler's batches, each a non-empty list of :class:`Chunk`;
                a request appears at most once, and not in another iteration in flight.
            dops: degree of parallelism per batch (default 1); every sub-batch gets its own
                free instance, so ``sum(dops)`` must not exceed :attr:`free_instances`.
            tree: the view from :meth:`get_prefix_tree` (optional; must be this pool's).
            instances: optional per-batch instance ids the batch may run on (``None`` for
                any free instance), e.g. fixed roles (xPyD) or the instances an asynchronous
                scheduler has decided for; the dispatcher still picks among them. Query
                holders and put destinations may be any live instance, busy or not.
        Returns:
            :class:`Plans` with a new epoch (with replication orders in the transfer plans'
            copies). Call :meth:`commit` after the data plane executed them, or :meth:`abort`.
        Raises:
            InvalidArgumentError, UnknownRequestError: bad input; nothing changed.
            IterationStateError: a request or instance is taken by an iteration in flight.
            PoolFullError: pinned data leaves too few slots; nothing changed.
        """
        t0 = time.perf_counter()
        self._check_view(tree)
        live = self.placement.live
        dops = admission.check_batches(batches, dops, len(live))
        busy = self.busy_instances
        admission.check_instances(instances, batches, dops, live, busy)
        cs, matches = admission.scan_chunks(batches, self.requests, self._busy_requests, self.tree)
        admission.check_dops(dops, cs)
        it = Iteration(self._epoch + 1, cs)
        try:
            self._plan(it, dops, instances, matches, busy)
        except BaseException:
            self._release(it, executed=False)
            raise
        self._epoch = it.epoch
        self._inflight[it.epoch] = it
        self._busy_requests.update(dict.fromkeys(cs.request_ids, it.epoch))
        it.gen_plans_s = time.perf_counter() - t0  # booked at commit, like every counter
        return it.plans

    def commit(self, plans: Plans) -> None:
        """Seal what the iteration wrote, add its new replicas, make its evictions final and
        book its accesses, LRU touches, load and counters.

        The data plane must have finished every put and copy of these plans (an
        asynchronous data plane: wait for it first, e.g. ``MPCluster.synchronize()``).
        """
        it = self._take(plans)
        tree, g = self.tree, it.gathered
        for pc in it.new_chunks:  # the admitted prefix was read: the most recent for LRU
            tree.touch(pc.state.tree_nodes + ([pc.source] if pc.source else []))
        tree.touch_replicas(g.chosen_idx.tolist(), g.chosen_inst.tolist())
        self.access.begin_iteration()
        self.access.record_accesses(g.node_idx, g.node_rows, g.node_tokens)
        for pc in it.chunks:
            self.stats.record_writes(pc.writes)
            seal_chunk(pc, tree, self.allocators, self.stats)
        self.stats.num_put_tokens += it.chunk_set.commit_in_place()
        if it.failover is not None:  # its replication decision saw these drops and keys
            self._replicated_changes = max(self._replicated_changes, it.failover[0])
            self._lost_replica -= it.failover[1]
        for node, _, dst in it.replications:  # the node is read: it is still in the tree
            if any(r.instance_id == dst.instance_id for r in node.replicas):
                self.allocators[dst.instance_id].free(dst.slot_id)  # a restored copy won
            else:
                tree.add_replica(node, dst)
        tree.add_readers(it.all_read_idx(), -1)
        self.access.record_load(it.traffic.load, list(self.live_instances))
        self.stats.record_iteration(it.traffic, it.new_chunks, len(it.victims))
        self.stats.record_gen_plans(it.gen_plans_s)

    def abort(self, plans: Plans, executed: bool = True) -> None:
        """Undo an iteration: free its new slots, forget its new requests, reservations,
        pins and replica orders; its accesses, LRU touches, load and counters never count.

        ``executed`` says whether any put or copy of these plans may have reached an engine.
        The slots ``gen_plans`` took from evicted replicas were handed to this iteration's
        writes, so a victim can come back only if nothing was written into its slot:
        ``executed=False`` (the plans were never sent, or the caller knows no engine
        started them) restores every victim whose place is still free, leaving the pool as
        it was before ``gen_plans`` if nothing else happened since. The default ``True``
        is always safe: after a partial execution (a peer died mid-iteration) a victim's
        slot may hold this iteration's data, so the victims stay evicted and their slots
        are freed; restoring them would serve overwritten KV. The epoch is not reused.
        """
        executed = check_bool("executed", executed)
        self._release(self._take(plans), executed)

    def finish(self, request_id: int | str) -> None:
        """Release a finished request: unpin its prefix, keep its partial tail as a leaf."""
        state = self._state(request_id)
        epoch = self._busy_requests.get(state.request_id)
        if epoch is not None:
            raise IterationStateError(
                f"request_id: {request_id!r} is in iteration {epoch} in flight; commit or "
                "abort it first"
            )
        del self.requests[state.request_id]
        if state.open is not None:
            loc = state.open.location
            kept = None
            if not state.detached:
                parent = state.nodes[-1] if state.nodes else self.tree.root
                res = self.tree.insert(parent, state.open.tokens, loc)
                kept = res.node if res.node is not None and not res.deduped else None
            if kept is None:
                self.allocators[loc.instance_id].free(loc.slot_id)
        self.tree.touch(state.tree_nodes)  # just used: the most recent, for LRU
        for node in state.tree_nodes:
            self.tree.unpin(node)
        self._free_private(state)

    # ---- membership ----------------------------------------------------------------------
    def drop_instance(self, instance_id: int) -> list[int | str]:
        """Mark an instance lost (its engine died): forget its replicas and slots, stop
        placing segments on it, and fail the running requests whose data was only there.

        Returns the failed request ids; the caller recomputes them (their cached prefix
        elsewhere is still matched). Iterations in flight that use the instance (run on it,
        read or write it, or pin a segment that only it holds) must be aborted first;
        others go on.
        """
        instance_id = check_int("instance_id", instance_id, low=0, high=self.config.num_instances)
        live = self.placement.live
        if instance_id not in live or len(live) == 1:
            allowed = f"a live instance other than the last (one of {sorted(live)})"
            if len(live) == 1:
                allowed = "a live instance, but the last live instance cannot be dropped"
            raise fail("instance_id", allowed, instance_id)
        lost = instance_loss.lost_keys(self.tree, instance_id)
        using = [
            it.epoch
            for it in self._inflight.values()
            if instance_id in it.instances or any(n.key in lost for n in it.pinned_nodes())
        ]
        if using:
            raise IterationStateError(
                f"instance_id: iterations {using} in flight use instance {instance_id}; "
                "abort them first"
            )
        failed = instance_loss.dependent_requests(self.requests.values(), instance_id, lost)
        for state in failed:
            del self.requests[state.request_id]
            for node in state.tree_nodes:
                self.tree.unpin(node)
            if state.open is not None and state.open.location.instance_id != instance_id:
                self.allocators[state.open.location.instance_id].free(state.open.location.slot_id)
            self._free_private(state, skip_instance=instance_id)
        t = self.tree.table  # survivors with a copy there lose it: re-replicate the hot ones
        rows = t.in_tree & (t.num_replicas > 1) & (t.rep_inst == instance_id).any(axis=1)
        self._lost_replica.update(self.tree.node_at(i).key for i in np.flatnonzero(rows).tolist())
        self._membership_changes += 1  # the next gen_plans decides replications at once
        for loc in self.tree.drop_instance(instance_id):
            self.allocators[loc.instance_id].free(loc.slot_id)
        self.placement.remove(instance_id)
        self.allocators[instance_id] = SlotAllocator(self.config.num_slots)  # nothing lives there
        return [state.request_id for state in failed]

    def restore_instance(self, instance_id: int) -> None:
        """Bring a dropped instance back, empty (its engine restarted): new segments may be
        placed on it again. Iterations in flight are not affected (none uses it)."""
        instance_id = check_int("instance_id", instance_id, low=0, high=self.config.num_instances)
        if instance_id in self.placement.live:
            dropped = sorted(set(range(self.config.num_instances)) - set(self.placement.live))
            raise fail("instance_id", f"a dropped instance (one of {dropped})", instance_id)
        self.allocators[instance_id] = SlotAllocator(self.config.num_slots)
        self.placement.add(instance_id)
        self._membership_changes += 1

    def get_stats(self) -> dict:
        """One plain dict of counters; see :meth:`tokenlake.stats.PoolStats.as_dict`."""
        return self.stats.as_dict(self)

    def check_invariants(self) -> None:
        check_pool_invariants(self)

    # ---- internals -----------------------------------------------------------------------
    def _plan(self, it: Iteration, dops, instances, matches, busy) -> None:
        tree, planner, cs = self.tree, self.planner, it.chunk_set
        for i, c in cs.new:
            pc = admission.admit(c, matches[c.request_id], tree)
            self.requests[c.request_id] = pc.state
            cs.admitted(i, pc)
            it.new_chunks.append(pc)
        it.chunks = cs.planned_chunks
        rest = it.chunks
        needed = sum(planner.num_new_slots(pc) for pc in rest)
        if needed > planner.free_capacity():
            raise PoolFullError(
                f"batches: need {needed} new slots, only {planner.free_capacity()} free or "
                "evictable (the rest is pinned by running requests or read in flight)"
            )
        for pc in rest:
            planner.plan_writes(pc, it.victims)
        self._reserve_replications(it)
        for pc in it.new_chunks:  # evictions above may have taken the copy source chosen earlier
            if pc.source is not None:
                for w in pc.writes:
                    if w.copy_from is not None and w.copy_from not in pc.source.replicas:
                        w.copy_from = pc.source.replicas[0]  # pinned: its last copy stays
        free = [i for i in sorted(self.placement.live) if i not in busy]
        base_load = self.access.recent_load.copy()
        for other in self._inflight.values():
            base_load += other.traffic.load
        plans, traffic, gathered = self.builder.build(
            (self.pool_id, it.epoch),
            cs,
            dops,
            free,
            it.replications,
            instances,
            base_load,
            (self.seed * 1_000_003 + it.epoch) % 2**62,
        )
        self._add_readers(it, gathered.node_idx)
        it.plans, it.traffic, it.gathered = plans, traffic, gathered
        it.instances = touched_instances(plans)

    def _add_readers(self, it: Iteration, idx) -> None:
        idx = np.asarray(idx, dtype=np.int64)
        self.tree.add_readers(idx, 1)
        it.read_idx.append(idx)

    def _reserve_replications(self, it: Iteration) -> None:
        """Replication orders, decided every ``interval`` epochs, and at once after an
        instance was dropped or restored (fail-over: segments that lost a replica are
        eligible), with at most one decision in flight. Each source's whole path is read by
        the iteration (so no copy of it is evicted, and readers stay closed under
        ancestors), then a slot is reserved on the destination."""
        failover = self._membership_changes > self._replicated_changes
        if ((it.epoch - 1) % self.balancer.interval and not failover) or any(
            other.decided_replication for other in self._inflight.values()
        ):
            return
        it.decided_replication = True
        it.failover = (self._membership_changes, frozenset(self._lost_replica))
        capacity = self.config.num_slots * len(self.placement.live)
        orders = plan_replications(
            self.tree,
            self.access,
            list(self.live_instances),
            self.balancer,
            capacity,
            failover=it.failover[1],
        )
        paths = []
        for node, _, _ in orders:
            while node is not self.tree.root and node.idx >= 0:
                paths.append(node.idx)
                node = node.parent
        self._add_readers(it, paths)
        for node, src, dst in orders:
            loc = self.planner.reserve_replica(dst, it.victims)
            if loc is not None:
                it.replications.append((node, src, loc))

    def _release(self, it: Iteration, executed: bool) -> None:
        """Undo everything ``gen_plans`` reserved for ``it`` (see :meth:`abort`)."""
        tree = self.tree
        for pc in reversed(it.chunks):
            for w in reversed(pc.writes):
                if w.pending is not None and w.pending.state == "reserved":
                    tree.abort(w.pending)
        tree.add_readers(it.all_read_idx(), -1)
        admission.release(it.new_chunks, self.requests, tree)
        restored = set()
        if not executed and it.victims:
            done = tree.restore(it.victims, self.placement.live)
            restored = {v.location for v, ok in zip(it.victims, done, strict=True) if ok}
        for loc in it.new_slots():
            if loc not in restored:
                self.allocators[loc.instance_id].free(loc.slot_id)
        self.stats.num_evictions += len(it.victims) - len(restored)

    def _take(self, plans: Plans) -> Iteration:
        """The iteration in flight ``plans`` belong to, removed from the in-flight set."""
        if not isinstance(plans, Plans):
            raise fail("plans", "a Plans returned by this pool's gen_plans", plans)
        if plans.pool_id != self.pool_id:
            raise StalePlanError(
                f"plans: made by another pool ({plans.pool_id or 'none'}), not this one"
            )
        it = self._inflight.get(plans.epoch)
        if it is None:
            raise StalePlanError(
                f"plans: epoch {plans.epoch} is not in flight (in flight: {self.active_epochs})"
            )
        if it.plans is not plans:
            raise StalePlanError(
                f"plans: not the Plans object gen_plans returned for epoch {plans.epoch}"
            )
        del self._inflight[plans.epoch]
        busy = self._busy_requests
        for rid in it.chunk_set.request_ids:
            del busy[rid]
        return it

    def _check_view(self, tree) -> None:
        if tree is not None and tree is not self._view:
            raise fail("tree", "the view returned by this pool's get_prefix_tree()", tree)

    def _state(self, request_id) -> RequestState:
        request_id = check_request_id("request_id", request_id)
        try:
            return self.requests[request_id]
        except KeyError:
            raise UnknownRequestError(f"request_id: unknown request {request_id!r}") from None

    def _free_private(self, state: RequestState, skip_instance: int | None = None) -> None:
        for node in state.private_nodes:
            loc = node.replicas[0]
            if loc.instance_id != skip_instance:
                self.allocators[loc.instance_id].free(loc.slot_id)
            self.tree.free_private(node)
