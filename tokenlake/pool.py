"""The control-plane facade: composes the prefix tree, placement, slot allocators, segment
planner, balancer, dispatcher and plan builder; owns the table of running requests and the
one iteration that may be in flight (reserve → transfer → commit | abort)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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
from tokenlake.keys import SegmentHasher
from tokenlake.load_model import LoadModel
from tokenlake.placement import Placement
from tokenlake.plan_builder import PlanBuilder
from tokenlake.plans import Chunk, Plans
from tokenlake.pool_checks import check_pool_invariants
from tokenlake.pool_view import PrefixTreeView
from tokenlake.prefix_tree import Location, Node, PrefixTree
from tokenlake.requests import OpenSegment, PlannedChunk, RequestState
from tokenlake.segment_planner import SegmentPlanner
from tokenlake.slots import SlotAllocator
from tokenlake.stats import PoolStats


@dataclass(eq=False)
class _Iteration:
    epoch: int
    batches: list[list[PlannedChunk]]
    replications: list[tuple[Node, Location, Location]] = field(default_factory=list)

    @property
    def chunks(self) -> list[PlannedChunk]:
        return [pc for batch in self.batches for pc in batch]


class Pool:
    """A pool of ``config.num_instances`` instances' KV slots behind one prefix tree.

    Per iteration: ``gen_plans`` (reserves slots, pins prefixes, orders replications) → the
    data plane executes the plans → ``commit`` (seals full segments, deduplicating; adds the
    new replicas) or ``abort`` (undoes all). ``finish`` releases a request's pins and keeps
    its partial tail for a later turn. ``load_model`` enables :meth:`get_cache_load`.
    """

    def __init__(
        self,
        config: PoolConfig,
        hasher: SegmentHasher | None = None,
        balancer: BalancerConfig | None = None,
        load_model: LoadModel | None = None,
        seed: int = 0,
    ) -> None:
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
            self.tree, self.access, n, q_row_bytes, m.kv_bytes_per_token, config.segment_bytes, seed
        )
        self.stats = PoolStats(n)
        self.requests: dict[int | str, RequestState] = {}
        self._view = PrefixTreeView(self.tree)
        self._epoch = 0
        self._inflight: _Iteration | None = None

    # ---- control-plane API ---------------------------------------------------------------
    def get_prefix_tree(self) -> PrefixTreeView:
        return self._view

    @property
    def live_instances(self) -> tuple[int, ...]:
        return tuple(sorted(self.placement.live))

    @property
    def active_epoch(self) -> int | None:
        """Epoch of the iteration in flight, or ``None``."""
        return self._inflight.epoch if self._inflight else None

    def num_stored_tokens(self, request_id: int | str) -> int:
        return self._state(request_id).num_tokens

    def free_capacity(self) -> int:
        """Slots obtainable now without touching pinned data (free plus evictable)."""
        return self.planner.free_capacity()

    def get_cache_load(
        self, reqs: Sequence[tuple[int, int]], tree: PrefixTreeView | None = None
    ) -> float:
        """``L`` in ``[0, 1)``: the share of the cluster's time TokenLake needs for ``reqs``,
        a list of ``(prefix_len, input_len)`` (§6.1). Needs ``load_model``."""
        self._check_view(tree)
        if self.load_model is None:
            raise InvalidArgumentError(
                "load_model: construct the Pool with a LoadModel to use get_cache_load"
            )
        return self.load_model.cache_load(reqs, len(self.placement.live))

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
                a request appears at most once per iteration.
            dops: degree of parallelism per batch (default 1); every sub-batch gets its own
                instance, so ``sum(dops)`` must not exceed the live instances.
            tree: the view from :meth:`get_prefix_tree` (optional; must be this pool's).
            instances: optional per-batch instance ids the batch may run on (``None`` for
                any), for fixed-role deployments (xPyD); the dispatcher still picks among them.
        Returns:
            :class:`Plans` for this iteration's epoch (with replication orders in the
            transfer plans' copies). Call :meth:`commit` after the data plane executed
            them, or :meth:`abort`.
        Raises:
            InvalidArgumentError, UnknownRequestError: bad input; nothing changed.
            PoolFullError: pinned data leaves too few slots; nothing changed.
        """
        if self._inflight is not None:
            raise IterationStateError(
                f"iteration {self._inflight.epoch} is in flight; commit or abort it first"
            )
        self._check_view(tree)
        dops = admission.check_batches(batches, dops, len(self.placement.live))
        admission.check_instances(instances, batches, dops, self.placement.live)
        matches = admission.check_chunks(batches, self.requests, self.tree)
        planned, chunks, new_chunks = [], [], []
        for batch in batches:
            row = []
            for c in batch:
                state = self.requests.get(c.request_id)
                if state is None:
                    pc = admission.admit(c, matches[c.request_id], self.tree)
                    new_chunks.append(pc)
                else:  # running: usually a decode step that stays inside its open tail
                    pc = PlannedChunk(state, c.start, c.end, c.token_ids, False)
                    self.planner.write_open_tail(pc)
                row.append(pc)
            planned.append(row)
            chunks.extend(row)
        for pc in new_chunks:
            self.requests[pc.state.request_id] = pc.state
            self.stats.record_admission(len(pc.token_ids), pc.start)
        rest = [pc for pc in chunks if not pc.writes]
        needed = sum(self.planner.num_new_slots(pc) for pc in rest)
        if needed > self.planner.free_capacity():
            admission.release(new_chunks, self.requests, self.tree)
            self.stats.undo_admissions(new_chunks)
            raise PoolFullError(
                f"batches: need {needed} new slots, only {self.planner.free_capacity()} "
                "free or evictable (the rest is pinned by running requests)"
            )
        for pc in rest:
            self.planner.plan_writes(pc)
        self.access.begin_iteration()
        replications = self._reserve_replications()
        for pc in new_chunks:  # evictions above may have taken the copy source chosen earlier
            if pc.source is not None:
                for w in pc.writes:
                    if w.copy_from is not None and w.copy_from not in pc.source.replicas:
                        w.copy_from = pc.source.replicas[0]  # pinned: its last copy stays
        self._epoch += 1
        plans, traffic = self.builder.build(
            self._epoch, planned, dops, self.live_instances, replications, instances
        )
        self.access.record_load(traffic.load, list(self.live_instances))
        self.stats.record_iteration(traffic)
        self._inflight = _Iteration(self._epoch, planned, replications)
        return plans

    def commit(self, plans: Plans) -> None:
        """Seal what the iteration wrote and add its new replicas.

        The data plane must have finished every put and copy of these plans (an
        asynchronous data plane: wait for it first, e.g. ``MPCluster.synchronize()``).
        """
        iteration = self._take_inflight(plans)
        for pc in iteration.chunks:
            self._commit_chunk(pc)
        for node, _, dst in iteration.replications:
            if self.tree.get(node.key) is node:
                self.tree.add_replica(node, dst)
            else:  # cannot happen while no iteration is in flight; keep the slot consistent
                self.allocators[dst.instance_id].free(dst.slot_id)

    def abort(self, plans: Plans) -> None:
        """Undo an iteration: free its new slots, forget its new requests and replicas."""
        iteration = self._take_inflight(plans)
        for pc in reversed(iteration.chunks):
            for w in pc.writes:
                if w.pending is not None:
                    self.tree.abort(w.pending)
                if w.new_slot:
                    self.allocators[w.location.instance_id].free(w.location.slot_id)
        for _, _, dst in iteration.replications:
            self.allocators[dst.instance_id].free(dst.slot_id)
        admission.release(iteration.chunks, self.requests, self.tree)
        self.stats.undo_admissions([pc for pc in iteration.chunks if pc.is_new])

    def finish(self, request_id: int | str) -> None:
        """Release a finished request: unpin its prefix, keep its partial tail as a leaf."""
        state = self._state(request_id)
        if self._inflight and any(pc.state is state for pc in self._inflight.chunks):
            raise IterationStateError(
                f"request_id: {request_id!r} is in iteration {self._inflight.epoch}; commit it first"
            )
        del self.requests[request_id]
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

    def drop_instance(self, instance_id: int) -> list[int | str]:
        """Mark an instance lost (its engine died): forget its replicas and slots, stop
        placing segments on it, and fail the running requests whose data was only there.

        Returns the failed request ids; the caller recomputes them (their cached prefix
        elsewhere is still matched). No iteration may be in flight (``abort`` it first).
        """
        if self._inflight is not None:
            raise IterationStateError("abort the iteration in flight before drop_instance")
        return instance_loss.drop_instance(self, instance_id)

    def restore_instance(self, instance_id: int) -> None:
        """Bring a dropped instance back, empty (its engine restarted): new segments may be
        placed on it again. No iteration may be in flight."""
        if self._inflight is not None:
            raise IterationStateError("abort or commit the iteration in flight first")
        if not 0 <= instance_id < self.config.num_instances or instance_id in self.placement.live:
            raise InvalidArgumentError(
                f"instance_id: expected a dropped instance of this pool, got {instance_id!r}"
            )
        self.allocators[instance_id] = SlotAllocator(self.config.num_slots)
        self.placement.add(instance_id)

    def get_stats(self) -> dict:
        """One plain dict of counters; see :meth:`tokenlake.stats.PoolStats.as_dict`."""
        return self.stats.as_dict(self)

    def check_invariants(self) -> None:
        check_pool_invariants(self)

    # ---- internals -----------------------------------------------------------------------
    def _check_view(self, tree) -> None:
        if tree is not None and tree is not self._view:
            raise InvalidArgumentError(
                "tree: expected the view returned by this pool's get_prefix_tree()"
            )

    def _state(self, request_id) -> RequestState:
        try:
            return self.requests[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"request_id: unknown request {request_id!r}") from None

    def _free_private(self, state: RequestState, skip_instance: int | None = None) -> None:
        for node in state.private_nodes:
            loc = node.replicas[0]
            if loc.instance_id != skip_instance:
                self.allocators[loc.instance_id].free(loc.slot_id)
            self.tree.table.free(node.idx)

    def _reserve_replications(self) -> list[tuple[Node, Location, Location]]:
        if self._epoch % self.balancer.interval:
            return []
        capacity = self.config.num_slots * len(self.placement.live)
        orders = plan_replications(
            self.tree, self.access, list(self.live_instances), self.balancer, capacity
        )
        return self.planner.reserve_replicas(orders)

    def _take_inflight(self, plans: Plans) -> _Iteration:
        if not isinstance(plans, Plans):
            raise InvalidArgumentError(f"plans: expected Plans, got {type(plans).__name__}")
        if self._inflight is None or plans.epoch != self._inflight.epoch:
            raise StalePlanError(
                f"plans: epoch {plans.epoch} is not the iteration in flight ({self.active_epoch})"
            )
        iteration, self._inflight = self._inflight, None
        return iteration

    def _commit_chunk(self, pc: PlannedChunk) -> None:
        state, seg = pc.state, self.config.segment_len
        state.open = None
        sealed: list[Node] = []
        for w in pc.writes:
            self.stats.num_put_tokens += w.num_new
            if w.copy_from is not None:
                self.stats.num_copy_tokens += w.num_before
            if len(w.tokens) < seg:
                state.open = OpenSegment(w.location, w.parent_key, w.tokens)
                continue
            res = self.tree.commit(w.pending) if w.pending is not None else None
            if res is None or res.node is None:
                private = Node(self.hasher.key(w.parent_key, w.tokens), None, w.tokens, -1)
                private.idx = self.tree.table.alloc()
                private.replicas.append(w.location)
                self.tree.table.set_replicas(private.idx, private.replicas)
                sealed.append(private)
                state.num_private += 1
                state.detached = True
                continue
            if res.deduped:
                self.allocators[w.location.instance_id].free(w.location.slot_id)
                self.stats.num_dedup_segments += 1
            self.tree.pin(res.node)
            sealed.append(res.node)
        state.append_nodes(sealed)
        if pc.source is not None:
            self.tree.unpin(pc.source)
        state.num_tokens = pc.end
