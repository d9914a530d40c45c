"""Memory-aware admission and what a decision reads from the pool (:mod:`.deciding`): FCFS
admission within the pool's free capacity (:mod:`.memory`), prefix matches (each request's
next match resumes from its last one), and the cache load. Reads the pool, never changes it."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from tokenlake.pool import Pool
from tokenlake.scheduler import memory
from tokenlake.scheduler.config import SchedulerConfig
from tokenlake.scheduler.latency_model import DECODE, PREFILL
from tokenlake.scheduler.policy import WorkItem
from tokenlake.scheduler.request import Phase, Request
from tokenlake.tree.prefix_tree import PrefixMatch


class Admission:
    def __init__(self, config: SchedulerConfig, pool: Pool) -> None:
        self.config, self.pool = config, pool
        # request id -> (request, its last prefix match): the next match resumes from it
        self._matched: dict[int | str, tuple[Request, PrefixMatch]] = {}

    def capacity_slots(self) -> int:
        return self.pool.config.num_slots * len(self.pool.live_instances)

    def forget_finished(self, requests: Iterable[Request], num_idle: int) -> None:
        """Drop remembered matches of requests no longer in ``requests`` (now and then)."""
        if len(self._matched) > 2 * num_idle + 64:
            alive = {r.request_id for r in requests}
            self._matched = {k: v for k, v in self._matched.items() if k in alive}

    def admit(
        self,
        items: list[WorkItem],
        requests: Iterable[Request],
        stored: Mapping[int | str, int],
        matches: Mapping[int | str, PrefixMatch],
        now: float = math.inf,
    ) -> list[WorkItem]:
        """Memory-aware admission in ``items``' order (see :mod:`.memory`): new requests up
        to the first that does not fit, or, with ``admission_backfill``, past those that do
        not fit while their first-token deadline (on the scheduler's clock; ``now``) has not
        passed; running prefills and decodes always pass (their memory is reserved), also
        behind a new request that does not fit. ``requests`` are all unfinished requests; ``stored`` gives in-flight
        requests' stored tokens after their iteration (their slots are taken already)."""
        if not any(it.phase == PREFILL and it.request_id in matches for it in items):
            return items
        cfg, seg = self.config, self.config.segment_len
        by_id = {}
        reserved, running = 0, False
        for req in requests:
            by_id[req.request_id] = req
            if req.phase in (Phase.PREFILL, Phase.DECODE):
                stored_now = stored.get(req.request_id, req.num_stored)
                reserved += memory.future_slots(req, stored_now, seg, cfg.output_reserve)
                running = True
        # the watermark is room for running requests to grow: a lone request may use it all
        watermark = math.ceil(cfg.kv_watermark * self.capacity_slots()) if running else 0
        avail = self.pool.free_capacity() - watermark
        out, blocked = [], False
        for it in items:
            if it.phase == PREFILL and it.request_id in matches:
                if blocked:
                    continue
                req, match = by_id[it.request_id], matches[it.request_id]
                cost = memory.new_request_cost(req, match, it.start, seg, cfg.output_reserve)
                if reserved + cost > avail and it.start % seg:
                    # copy-on-extend holds the cached partial segment and its copy at once:
                    # starting at the segment boundary needs one slot fewer
                    it = it._replace(start=it.start - it.start % seg)
                    cost = memory.new_request_cost(req, match, it.start, seg, cfg.output_reserve)
                if reserved + cost > avail:
                    if cfg.admission_backfill and now <= req.deadline < math.inf:
                        continue  # smaller requests behind it may fit; it keeps its place
                    blocked = True  # FCFS: no later new request either
                    continue
                reserved += cost
            out.append(it)
        return out

    def cached(self, matches: dict[int | str, PrefixMatch]) -> Callable[[Request], int]:
        """``cached(request)``: its cached prefix length now; its match goes into
        ``matches`` and is remembered, so the next match of the same request resumes from it."""
        tree = self.pool.get_prefix_tree()
        memo = self._matched

        def cached(r: Request) -> int:
            last = memo.get(r.request_id)
            m = tree.match(r.token_ids, resume=last[1] if last and last[0] is r else None)
            matches[r.request_id] = m
            memo[r.request_id] = (r, m)
            return m.num_tokens

        return cached

    def cache_load(self, items: Sequence[WorkItem], inflight: Iterable = ()) -> float:
        """The pool's cache load ``L`` of ``items`` and the chunks of iterations ``inflight``."""
        # get_cache_load needs the pool's roofline LoadModel; without one, L = 0
        if self.pool.load_model is None or not items:
            return 0.0
        reqs = [(it.start, it.num_new) for it in items]
        reqs += [(c.start, c.num_new_tokens) for it in inflight for c in it.decision.chunks]
        return float(self.pool.load_model.cache_load(reqs, len(self.pool.live_instances)))


def items_of(decodes: Iterable[Request]) -> list[WorkItem]:
    """Work items of decode-phase requests (one step each)."""
    out = []
    for r in decodes:
        ids = r.token_ids
        out.append(WorkItem(r.request_id, DECODE, ids, len(ids) - 1, len(ids), r.arrival))
    return out
