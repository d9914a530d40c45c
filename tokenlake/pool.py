"""The control-plane facade: validates every call, then composes the prefix tree, placement,
slot allocators, the iteration planner (:mod:`tokenlake.iteration.planner`: plan, settle,
release), the iterations in flight (:mod:`tokenlake.iteration.inflight`) and fail-over
(:mod:`tokenlake.iteration.instance_loss`); owns the running requests."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence

import numpy as np

from tokenlake.cluster.balancer import AccessStats, BalancerConfig
from tokenlake.cluster.load_model import LoadModel
from tokenlake.cluster.placement import Placement
from tokenlake.cluster.slots import EngineSlots, SlotAllocator
from tokenlake.config import PoolConfig
from tokenlake.errors import InvalidArgumentError, IterationStateError, UnknownRequestError
from tokenlake.iteration import admission, engine_slots, instance_loss
from tokenlake.iteration.checks import check_pool_invariants
from tokenlake.iteration.engine_slots import by_request as engine_slots_by_request
from tokenlake.iteration.inflight import InFlight
from tokenlake.iteration.planner import IterationPlanner
from tokenlake.iteration.record import Iteration
from tokenlake.iteration.requests import RequestState, release_finished
from tokenlake.keys import SegmentHasher
from tokenlake.plans import Chunk, Plans
from tokenlake.stats import PoolStats
from tokenlake.tree.policy import EvictionConfig, EvictionPolicy
from tokenlake.tree.prefix_tree import PrefixTree
from tokenlake.tree.tier_blocks import HostTier
from tokenlake.tree.view import PrefixTreeView
from tokenlake.validate import check_bool, check_int, check_request_id, check_sequence, fail


class Pool:
    """A pool of ``config.num_instances`` instances' KV slots behind one prefix tree.

    Per iteration: ``gen_plans`` (reserves slots, pins prefixes, orders replications) → the
    data plane executes the plans → ``commit`` (seals full segments, deduplicating; adds the
    new replicas) or ``abort`` (undoes all). Several iterations may be in flight at once,
    each over its own requests and its own compute instances (``free_instances``); each is
    committed or aborted on its own, in any order. ``finish`` releases a request's pins and
    keeps its partial tail for a later turn. ``load_model`` enables :meth:`get_cache_load`;
    ``eviction`` picks what goes when the pool is full (:mod:`tokenlake.tree.policy`).
    ``engine_slots``: the instances' engines allocate the slots (SGLang's page allocator over
    the same memory, one copy): ``gen_plans`` takes the slot of every new segment, nothing is
    put, copied or replicated, and a slot the engine gives up (:meth:`release_slots`) leaves
    the pool once nothing reads it (:mod:`tokenlake.iteration.engine_slots`).

    The components (``tree``, ``allocators``, ``placement``, ``access``, ``requests``,
    ``inflight``, ``failover``, ``iterations``) are exposed for inspection and tests; change
    the pool only through its methods.
    """

    def __init__(
        self,
        config: PoolConfig,
        hasher: SegmentHasher | None = None,
        balancer: BalancerConfig | None = None,
        load_model: LoadModel | None = None,
        seed: int = 0,
        eviction: EvictionConfig | None = None,
        engine_slots: bool = False,
    ) -> None:
        for name, value, kind in (
            ("config", config, PoolConfig),
            ("hasher", hasher, SegmentHasher),
            ("balancer", balancer, BalancerConfig),
            ("load_model", load_model, LoadModel),
            ("eviction", eviction, EvictionConfig),
        ):
            if not isinstance(value, kind) and (value is not None or kind is PoolConfig):
                raise fail(name, f"a {kind.__name__}", value)
        self.seed = check_int("seed", seed, low=0, high=2**62)
        self.engine_slots = check_bool("engine_slots", engine_slots)
        self.config = config
        self.hasher = hasher if hasher is not None else SegmentHasher(config.namespace)
        self.balancer = balancer if balancer is not None else BalancerConfig()
        self.load_model = load_model
        n = config.num_instances
        policy = EvictionPolicy(eviction or EvictionConfig(), n * config.num_slots)
        if self.engine_slots and config.num_tier_blocks:
            raise fail(
                "config.num_tier_blocks", "0 with engine_slots (the engine owns every slot)",
                config.num_tier_blocks,
            )  # fmt: skip
        tier = HostTier(config.num_tier_blocks)
        self.tree = PrefixTree(
            config.segment_len, self.hasher, max_replicas=n, policy=policy, tier=tier
        )
        self.placement = Placement(range(n), seed=self.hasher.seed)
        self.allocators = [self._new_allocator() for _ in range(n)]
        self.access = AccessStats(n, self.tree, self.balancer)
        self.stats = PoolStats(n)
        self.requests: dict[int | str, RequestState] = {}
        self.pool_id = uuid.uuid4().hex  # binds plans to this pool object
        self.inflight = InFlight(self.pool_id)
        self.failover = instance_loss.FailoverLog()
        self.iterations = IterationPlanner(
            config, self.tree, self.placement, self.allocators, self.access, self.balancer,
            self.stats, self.requests, self.inflight, self.failover, self.seed,
            engine_slots=self.engine_slots,
        )  # fmt: skip
        self._view = PrefixTreeView(self.tree)

    # ---- reading ---------------------------------------------------------------------------
    def get_prefix_tree(self) -> PrefixTreeView:
        return self._view

    @property
    def live_instances(self) -> tuple[int, ...]:
        return self.placement.live

    @property
    def busy_instances(self) -> frozenset[int]:
        """Compute instances running an iteration in flight (its sub-batches' origins)."""
        return self.inflight.busy_instances

    @property
    def free_instances(self) -> tuple[int, ...]:
        """Live instances no iteration in flight runs on: where ``gen_plans`` may dispatch."""
        busy = self.busy_instances
        return tuple(i for i in self.live_instances if i not in busy)

    @property
    def active_epochs(self) -> tuple[int, ...]:
        """Epochs of the iterations in flight, oldest first."""
        return self.inflight.epochs

    @property
    def active_epoch(self) -> int | None:
        """The newest epoch in flight, or ``None``. With several in flight use
        :attr:`active_epochs` / :meth:`is_active`; kept for single-iteration callers."""
        return self.inflight.newest

    def is_active(self, plans: Plans | int) -> bool:
        """Whether ``plans`` (or an epoch) is an iteration of this pool in flight."""
        if isinstance(plans, Plans):
            return plans.pool_id == self.pool_id and plans.epoch in self.inflight
        return isinstance(plans, int) and plans in self.inflight

    def iterations_in_flight(self) -> tuple[Iteration, ...]:
        return tuple(self.inflight)

    def in_flight_epoch(self, request_id: int | str) -> int | None:
        """The epoch of the iteration in flight that includes ``request_id``, or ``None``."""
        return self.inflight.busy_requests.get(check_request_id("request_id", request_id))

    def num_stored_tokens(self, request_id: int | str) -> int:
        return self._state(request_id).num_tokens

    def home_instance(self, request_id: int | str) -> int | None:
        """Where a running request's newest KV lives (its open tail, else its last segment's
        first replica); ``None`` for a request the pool does not run or holds nothing of."""
        state = self.requests.get(check_request_id("request_id", request_id))
        return None if state is None else state.home_instance()

    def free_capacity(self) -> int:
        """Slots obtainable now without touching pinned or in-flight data."""
        return self.iterations.segments.free_capacity()

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
        engine_slots: Mapping[int | str, Sequence[int]] | None = None,
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
            engine_slots: with ``Pool(engine_slots=True)`` (and only then): per request id
                whose chunk starts segments, the slot of each, in order, on its batch's one
                instance (``instances[b] == [w]``), where the engine has written them.
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
        inflight = self.inflight
        cs, matches = admission.scan_chunks(
            batches, self.requests, inflight.busy_requests, self.tree
        )
        admission.check_dops(dops, cs)
        slots = None
        if self.engine_slots or engine_slots is not None:
            slots = engine_slots_by_request(self.engine_slots, batches, instances, engine_slots)
        it = Iteration(inflight.next_epoch(), cs)
        try:
            self.iterations.plan(it, dops, instances, matches, busy, slots)
        except BaseException:
            self.iterations.release(it, executed=False)
            raise
        inflight.add(it)
        it.gen_plans_s = time.perf_counter() - t0  # booked at commit, like every counter
        return it.plans

    def commit(self, plans: Plans) -> None:
        """Seal what the iteration wrote, add its new replicas, make its evictions final and
        book its accesses, LRU touches, load and counters.

        The data plane must have finished every put and copy of these plans (an
        asynchronous data plane: wait for it first, e.g. ``MPCluster.synchronize()``).
        """
        self.iterations.settle(self.inflight.take(plans), list(self.live_instances))
        self._evict_released()

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
        self.iterations.release(self.inflight.take(plans), executed)
        self._evict_released()

    def finish(self, request_id: int | str) -> None:
        """Release a finished request: unpin its prefix, keep its partial tail as a leaf."""
        state = self._state(request_id)
        epoch = self.inflight.busy_requests.get(state.request_id)
        if epoch is not None:
            raise IterationStateError(
                f"request_id: {request_id!r} is in iteration {epoch} in flight; commit or "
                "abort it first"
            )
        del self.requests[state.request_id]
        release_finished(state, self.tree, self.allocators)
        self._evict_released()

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
        lost_rows = np.array([self.tree.get(key).idx for key in lost], dtype=np.int64)
        using = self.inflight.using(instance_id, lost, lost_rows)
        if using:
            raise IterationStateError(
                f"instance_id: iterations {using} in flight use instance {instance_id}; "
                "abort them first"
            )
        failed = instance_loss.forget_instance(
            instance_id, lost, self.requests, self.tree, self.allocators, self.failover
        )
        self.placement.remove(instance_id)
        self.allocators[instance_id] = self._new_allocator()  # nothing lives there
        return failed

    def restore_instance(self, instance_id: int) -> None:
        """Bring a dropped instance back, empty (its engine restarted): new segments may be
        placed on it again. Iterations in flight are not affected (none uses it)."""
        instance_id = check_int("instance_id", instance_id, low=0, high=self.config.num_instances)
        if instance_id in self.placement.live:
            dropped = sorted(set(range(self.config.num_instances)) - set(self.placement.live))
            raise fail("instance_id", f"a dropped instance (one of {dropped})", instance_id)
        self.allocators[instance_id] = self._new_allocator()
        self.placement.add(instance_id)
        self.failover.num_changes += 1

    # ---- engine-allocated slots -----------------------------------------------------------
    def release_slots(self, instance_id: int, slots: Sequence[int]) -> list[int]:
        """The engine of ``instance_id`` gives ``slots`` up (``engine_slots`` pools). Returns
        the slots it may reuse now: these, where nothing of the pool's is in them or once
        evicted, and earlier ones the pool has let go of since (:meth:`reclaim`); the rest
        come back through :meth:`reclaim` once nothing pins or reads them."""
        alloc = self._engine_allocator(instance_id)
        return engine_slots.release(self.tree, self.allocators, int(instance_id), alloc, slots)

    def reclaim(self, instance_id: int) -> list[int]:
        """Slots the engine of ``instance_id`` released earlier that the pool has let go of
        since (``engine_slots`` pools): the engine's to reuse."""
        return self._engine_allocator(instance_id).drain_reclaimed()

    def _engine_allocator(self, instance_id: int) -> EngineSlots:
        if not self.engine_slots:
            raise InvalidArgumentError(
                "engine_slots: this pool allocates its own slots; construct it with "
                "engine_slots=True to take an engine's"
            )
        instance_id = check_int("instance_id", instance_id, low=0, high=self.config.num_instances)
        return self.allocators[instance_id]

    def _new_allocator(self) -> SlotAllocator:
        kind = EngineSlots if self.engine_slots else SlotAllocator
        return kind(self.config.num_slots)

    def _evict_released(self) -> None:
        if self.engine_slots:
            for instance_id in self.placement.live:
                engine_slots.evict_released(self.tree, self.allocators, instance_id)

    def get_stats(self) -> dict:
        """One plain dict of counters; see :meth:`tokenlake.stats.PoolStats.as_dict`."""
        return self.stats.as_dict(
            tree=self.tree,
            access=self.access,
            allocators=self.allocators,
            live=self.live_instances,
            segment_bytes=self.config.segment_bytes,
            num_running=len(self.requests),
            num_in_flight=len(self.active_epochs),
            tier=self.tree.tier,
        )

    def check_invariants(self) -> None:
        check_pool_invariants(
            tree=self.tree,
            allocators=self.allocators,
            requests=self.requests,
            iterations=self.iterations_in_flight(),
            live=self.live_instances,
            in_flight_epoch=self.in_flight_epoch,
        )

    # ---- internals -----------------------------------------------------------------------
    def _check_view(self, tree) -> None:
        if tree is not None and tree is not self._view:
            raise fail("tree", "the view returned by this pool's get_prefix_tree()", tree)

    def _state(self, request_id) -> RequestState:
        request_id = check_request_id("request_id", request_id)
        try:
            return self.requests[request_id]
        except KeyError:
            raise UnknownRequestError(f"request_id: unknown request {request_id!r}") from None
