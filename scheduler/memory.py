"""Memory-aware admission and preemption choices, in pool slots (one segment each).

Admission goes by priority (earliest first-token deadline, then arrival; plain FCFS without
an input-token SLO), blocking behind its head: a waiting request enters only if the slots every admitted request may
still need (its remaining prompt and ``output_reserve`` of its remaining output), its own
need and the cached segments it would pin fit in what the pool can free now, less a
watermark. When the pool still runs short (the estimate is not exact: replicas, in-flight
reservations, an ``output_reserve`` below 1), the scheduler preempts the running request
with the lowest priority in no iteration in flight, which the pool releases (its segments
stay cached, unpinned) and which later recomputes from its cached prefix. The running request
with the highest priority is never preempted while another runs, so it always progresses; it
fits the pool alone (larger requests are refused), so it finishes, and then the next: nothing
starves (deadlines are absolute, so a request's priority only rises relative to newcomers).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from tokenlake.scheduler.request import Phase, Request
from tokenlake.tree.prefix_tree import PrefixMatch


def segments(num_tokens: int, segment_len: int) -> int:
    """Slots ``num_tokens`` tokens occupy (the last one partial)."""
    return -(-num_tokens // segment_len)


def future_slots(req: Request, stored: int, segment_len: int, output_reserve: float) -> int:
    """Slots ``req`` may still take beyond the ``stored`` tokens it holds: the rest of its
    known tokens and ``output_reserve`` of the output it has not generated yet."""
    remaining = req.max_output_tokens - req.num_generated
    final = req.num_known + math.ceil(output_reserve * remaining)
    return max(0, segments(final, segment_len) - segments(stored, segment_len))


def pin_cost(match: PrefixMatch, start: int, segment_len: int) -> int:
    """Cached segments a new request starting at ``start`` would pin that nobody pins yet:
    the evictable slots its admission takes from the pool."""
    full, rest = divmod(start, segment_len)
    nodes = list(match.nodes[:full])
    if rest:
        nodes.append(match.nodes[full] if full < len(match.nodes) else match.partial)
    return sum(1 for node in nodes if node is not None and node.pin_count == 0)


def new_request_cost(
    req: Request, match: PrefixMatch, start: int, segment_len: int, output_reserve: float
) -> int:
    """Slots admitting ``req`` at ``start`` takes: what it will write (whole segments from the
    one holding ``start``: a partial cached one is copied into a new slot) and its pins."""
    own = future_slots(req, start - start % segment_len, segment_len, output_reserve)
    return own + pin_cost(match, start, segment_len)


def victim(candidates: Iterable[Request]) -> Request | None:
    """The running request to preempt: the lowest priority among ``candidates`` (the requests
    in no iteration in flight); ``None`` if none of them runs. A batch that cannot get its
    slots has its own running requests among the candidates, so the victim is one of them
    or younger than all of them."""
    best = None
    for req in candidates:
        if req.phase not in (Phase.PREFILL, Phase.DECODE):
            continue
        if best is None or req.priority > best.priority:
            best = req
    return best
