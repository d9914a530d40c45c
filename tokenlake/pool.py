"""The control-plane facade: composes the prefix tree, placement, slot allocators, segment
planner, dispatcher and plan builder; owns the table of running requests and the one
iteration that may be in flight (reserve → transfer → commit | abort)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenlake.config import PoolConfig
from tokenlake.dispatch import simple_dispatch
from tokenlake.errors import (
    InvalidArgumentError,
    IterationStateError,
    PoolFullError,
    StalePlanError,
    UnknownRequestError,
)
from tokenlake.keys import SegmentHasher
from tokenlake.placement import Placement
from tokenlake.plan_builder import PlanBuilder
from tokenlake.plans import Chunk, Plans
from tokenlake.pool_checks import check_pool_invariants
from tokenlake.prefix_tree import Node, PrefixMatch, PrefixTree
from tokenlake.requests import OpenSegment, PlannedChunk, RequestState
from tokenlake.segment_planner import SegmentPlanner
from tokenlake.slots import SlotAllocator
from tokenlake.stats import PoolStats


class PrefixTreeView:
    """Read-only view of the pool's prefix tree (``Pool.get_prefix_tree``)."""

    def __init__(self, tree: PrefixTree) -> None:
        self._tree = tree

    def match(self, token_ids) -> PrefixMatch:
        """Cached prefix of ``token_ids`` (``.num_tokens``); does not count as an access."""
        return self._tree.match(token_ids)

    @property
    def segment_len(self) -> int:
        return self._tree.segment_len

    @property
    def num_segments(self) -> int:
        return self._tree.num_nodes

    @property
    def num_replicas(self) -> int:
        return self._tree.num_replicas


@dataclass(eq=False)
class _Iteration:
    epoch: int
    batches: list[list[PlannedChunk]]

    @property
    def chunks(self) -> list[PlannedChunk]:
        return [pc for batch in self.batches for pc in batch]


class Pool:
    """A pool of ``config.num_instances`` instances' KV slots behind one prefix tree.

    Per iteration: ``gen_plans`` (reserves slots, pins prefixes) → the data plane executes
    the plans → ``commit`` (seals full segments, deduplicating) or ``abort`` (undoes all).
    ``finish`` releases a request's pins and keeps its partial tail for a later turn.
    """

    def __init__(self, config: PoolConfig, hasher: SegmentHasher | None = None) -> None:
        self.config = config
        self.hasher = hasher if hasher is not None else SegmentHasher(config.namespace)
        self.tree = PrefixTree(config.segment_len, self.hasher)
        self.placement = Placement(range(config.num_instances), seed=self.hasher.seed)
        self.allocators = [SlotAllocator(config.num_slots) for _ in range(config.num_instances)]
        self.planner = SegmentPlanner(self.tree, self.placement, self.allocators)
        self.builder = PlanBuilder(config.segment_len, config.num_instances)
        self.stats = PoolStats(config.num_instances)
        self.requests: dict[int | str, RequestState] = {}
        self._view = PrefixTreeView(self.tree)
        self._epoch = 0
        self._inflight: _Iteration | None = None

    # ---- control-plane API ---------------------------------------------------------------
    def get_prefix_tree(self) -> PrefixTreeView:
        return self._view

    @property
    def active_epoch(self) -> int | None:
        """Epoch of the iteration in flight, or ``None``."""
        return self._inflight.epoch if self._inflight else None

    def num_stored_tokens(self, request_id: int | str) -> int:
        return self._state(request_id).num_tokens

    def gen_plans(
        self,
        batches: Sequence[Sequence[Chunk]],
        dops: Sequence[int] | None = None,
        tree: PrefixTreeView | None = None,
    ) -> Plans:
        """Plan one iteration: where each batch runs and where its prefix and new KV live.

        Args:
            batches: the scheduler's batches, each a non-empty list of :class:`Chunk`;
                a request appears at most once per iteration.
            dops: degree of parallelism per batch (default 1); ``sum(dops) <= num_instances``.
            tree: the view from :meth:`get_prefix_tree` (optional; must be this pool's).
        Returns:
            :class:`Plans` for this iteration's epoch. Call :meth:`commit` after the data
            plane has executed them, or :meth:`abort`.
        Raises:
            InvalidArgumentError, UnknownRequestError: bad input; nothing changed.
            PoolFullError: the pinned data leaves too few slots; nothing changed.
        """
        if self._inflight is not None:
            raise IterationStateError(
                f"iteration {self._inflight.epoch} is in flight; commit or abort it first"
            )
        if tree is not None and tree is not self._view:
            raise InvalidArgumentError(
                "tree: expected the view returned by this pool's get_prefix_tree()"
            )
        dops = self._check_batches(batches, dops)
        matches = self._check_chunks(batches)
        planned = [
            [self._admit(chunk, matches.get(chunk.request_id)) for chunk in b] for b in batches
        ]
        chunks = [pc for batch in planned for pc in batch]
        needed = sum(self.planner.num_new_slots(pc) for pc in chunks)
        if needed > self.planner.free_capacity():
            self._release_admissions(chunks)
            raise PoolFullError(
                f"batches: need {needed} new slots, only {self.planner.free_capacity()} "
                "free or evictable (the rest is pinned by running requests)"
            )
        for pc in chunks:
            self.planner.plan_writes(pc)
        groups = simple_dispatch(self._dispatch_scores(planned), dops)
        self._epoch += 1
        plans, load = self.builder.build(self._epoch, planned, groups)
        self.stats.load += load
        self.stats.num_iterations += 1
        self._inflight = _Iteration(self._epoch, planned)
        return plans

    def commit(self, plans: Plans) -> None:
        """Seal what the iteration wrote; the data plane must have finished every put."""
        iteration = self._take_inflight(plans)
        for pc in iteration.chunks:
            self._commit_chunk(pc)

    def abort(self, plans: Plans) -> None:
        """Undo an iteration: free its new slots, forget its new requests."""
        iteration = self._take_inflight(plans)
        for pc in reversed(iteration.chunks):
            for w in pc.writes:
                if w.pending is not None:
                    self.tree.abort(w.pending)
                if w.new_slot:
                    self.allocators[w.location.instance_id].free(w.location.slot_id)
        self._release_admissions(iteration.chunks)

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
        for node in state.tree_nodes:
            self.tree.unpin(node)
        for node in state.private_nodes:
            self.allocators[node.replicas[0].instance_id].free(node.replicas[0].slot_id)

    def get_stats(self) -> dict:
        """One plain dict of counters; see :meth:`PoolStats.as_dict`, plus storage figures."""
        out = self.stats.as_dict()
        seg_bytes = self.config.segment_bytes
        out.update(
            num_segments=self.tree.num_nodes,
            num_replicas=self.tree.num_replicas,
            num_running_requests=len(self.requests),
            num_evictions=self.planner.num_evictions,
            slots_used=[a.num_used for a in self.allocators],
            bytes_stored=sum(a.num_used for a in self.allocators) * seg_bytes,
            bytes_saved_by_dedup=self.stats.num_dedup_segments * seg_bytes,
        )
        return out

    def check_invariants(self) -> None:
        check_pool_invariants(self)

    # ---- internals -----------------------------------------------------------------------
    def _state(self, request_id) -> RequestState:
        try:
            return self.requests[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"request_id: unknown request {request_id!r}") from None

    def _check_batches(self, batches, dops) -> list[int]:
        if not isinstance(batches, Sequence) or not batches:
            raise InvalidArgumentError("batches: expected a non-empty list of batches")
        for b, batch in enumerate(batches):
            if not isinstance(batch, Sequence) or not batch:
                raise InvalidArgumentError(f"batches[{b}]: expected a non-empty list of Chunk")
            for chunk in batch:
                if not isinstance(chunk, Chunk):
                    raise InvalidArgumentError(
                        f"batches[{b}]: expected Chunk items, got {type(chunk).__name__}"
                    )
        dops = [1] * len(batches) if dops is None else list(dops)
        if len(dops) != len(batches):
            raise InvalidArgumentError(f"dops: expected {len(batches)} entries, got {len(dops)}")
        for b, (dop, batch) in enumerate(zip(dops, batches, strict=True)):
            rows = sum(c.num_new_tokens for c in batch)
            if isinstance(dop, bool) or not isinstance(dop, int) or not 1 <= dop <= max(rows, 1):
                raise InvalidArgumentError(f"dops[{b}]: expected an int in 1..{rows}, got {dop!r}")
        if sum(dops) > self.config.num_instances:
            raise InvalidArgumentError(
                f"dops: {sum(dops)} sub-batches exceed the {self.config.num_instances} instances"
            )
        return dops

    def _check_chunks(self, batches) -> dict:
        seen, matches = set(), {}
        for batch in batches:
            for c in batch:
                try:
                    hash(c.request_id)
                except TypeError:
                    raise InvalidArgumentError("Chunk.request_id: expected an int or str") from None
                if c.request_id in seen:
                    raise InvalidArgumentError(f"batches: request {c.request_id!r} appears twice")
                seen.add(c.request_id)
                if not 0 <= c.start < c.end <= len(c.token_ids):
                    raise InvalidArgumentError(
                        f"Chunk.start/end: expected 0 <= start < end <= len(token_ids)="
                        f"{len(c.token_ids)}, got start={c.start}, end={c.end} ({c.request_id!r})"
                    )
                state = self.requests.get(c.request_id)
                if state is not None and c.start != state.num_tokens:
                    raise InvalidArgumentError(
                        f"Chunk.start: request {c.request_id!r} has {state.num_tokens} tokens "
                        f"in the pool, got start={c.start}"
                    )
                if state is None:
                    m = self.tree.match(c.token_ids[: c.start])
                    if m.num_tokens < c.start:
                        raise InvalidArgumentError(
                            f"Chunk.start: new request {c.request_id!r} has only {m.num_tokens} "
                            f"cached tokens, got start={c.start}"
                        )
                    matches[c.request_id] = m
        return matches

    def _admit(self, chunk: Chunk, match: PrefixMatch | None) -> PlannedChunk:
        state = self.requests.get(chunk.request_id)
        pc = PlannedChunk(
            state if state else RequestState(chunk.request_id),
            chunk.start,
            chunk.end,
            chunk.token_ids,
            is_new=state is None,
        )
        if state is not None:
            return pc
        seg = self.config.segment_len
        full, rest = divmod(chunk.start, seg)
        pc.state.nodes = list(match.nodes[:full])
        path = list(pc.state.nodes)
        if rest:
            pc.source = match.nodes[full] if full < len(match.nodes) else match.partial
            pc.source_len = rest
            path.append(pc.source)
        for node in path:
            self.tree.pin(node)
        self.tree.touch(path)
        self.requests[chunk.request_id] = pc.state
        self.stats.record_admission(len(chunk.token_ids), chunk.start)
        return pc

    def _release_admissions(self, chunks: list[PlannedChunk]) -> None:
        for pc in chunks:
            if pc.is_new:
                for node in pc.state.nodes + ([pc.source] if pc.source else []):
                    self.tree.unpin(node)
                del self.requests[pc.state.request_id]

    def _dispatch_scores(self, planned: list[list[PlannedChunk]]) -> np.ndarray:
        scores = np.zeros((len(planned), self.config.num_instances))
        for b, batch in enumerate(planned):
            for pc in batch:
                for _, loc, _ in pc.prefix_pages(self.config.segment_len):
                    scores[b, loc.instance_id] += 1
                for w in pc.writes:
                    scores[b, w.location.instance_id] += 1
        return scores

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
        for w in pc.writes:
            self.stats.num_put_tokens += w.num_new
            if w.copy_from is not None:
                self.stats.num_copy_tokens += w.num_before
            if len(w.tokens) < seg:
                state.open = OpenSegment(w.location, w.parent_key, w.tokens)
                continue
            res = self.tree.commit(w.pending) if w.pending is not None else None
            if res is None or res.node is None:
                private = Node(
                    self.hasher.key(w.parent_key, w.tokens), None, w.tokens, len(state.nodes)
                )
                private.replicas.append(w.location)
                state.nodes.append(private)
                state.num_private += 1
                state.detached = True
                continue
            if res.deduped:
                self.allocators[w.location.instance_id].free(w.location.slot_id)
                self.stats.num_dedup_segments += 1
            self.tree.pin(res.node)
            state.nodes.append(res.node)
        if pc.source is not None:
            self.tree.unpin(pc.source)
        state.num_tokens = pc.end
