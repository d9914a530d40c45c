"""The TBT-aware chunked-prefill size of an SGLang-like instance: the prefill chunk sized so
that the step it runs in fits the TBT SLO beside the decodes running on the instance, as
TokenLake's lanes cap their prefill (``tokenlake.scheduler.lanes.prefill_budget``).

The step time comes from the simulator's own step timer (the roofline every system is priced
by), so the chunk an operator would tune for a TBT target is the one the simulator rewards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

CHUNK_GRANULE = 64  # chunk sizes tried: multiples of this (and the configured maximum)


def fill_chunk(budget: int, queued: Sequence[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(new tokens, prefix tokens) of the prefill pieces that ``budget`` tokens buy from
    ``queued`` (remaining prompt tokens, cached or computed prefix) in FCFS order, as the
    engine fills a chunk: at most one piece is cut."""
    news, prefixes = [], []
    for remaining, prefix in queued:
        if budget <= 0:
            break
        n = min(remaining, budget)
        if n > 0:
            news.append(n)
            prefixes.append(prefix)
            budget -= n
    return news, prefixes


def largest_fitting_chunk(
    step_time: Callable[[int], float], max_chunk: int, slo_s: float, granule: int = CHUNK_GRANULE
) -> int:
    """The largest chunk ``c`` among the multiples of ``granule`` up to ``max_chunk`` (and
    ``max_chunk`` itself) with ``step_time(c) <= slo_s``; the smallest candidate when none fits
    (a prefill must progress). ``step_time`` must not fall as the chunk grows."""
    if max_chunk < 1 or granule < 1:
        raise ValueError(
            f"largest_fitting_chunk: max_chunk and granule >= 1, got {max_chunk}, {granule}"
        )
    candidates = list(range(granule, max_chunk, granule)) + [max_chunk]
    if step_time(candidates[-1]) <= slo_s:
        return candidates[-1]
    lo, hi = -1, len(candidates) - 1  # candidates[hi] misses; candidates[lo] fits (or -1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if step_time(candidates[mid]) <= slo_s:
            lo = mid
        else:
            hi = mid
    return candidates[max(lo, 0)]


def tbt_aware_chunk(
    timer,
    max_chunk: int,
    slo_s: float,
    queued: Sequence[tuple[int, int]],
    decode_ctxs: Sequence[int],
    mixed: bool,
    granule: int = CHUNK_GRANULE,
) -> int:
    """The chunk (prefill tokens plus, when ``mixed``, one token per running decode, SGLang's
    budget) whose step fits ``slo_s``: a mixed step runs the decodes beside the chunk; an
    unmixed one makes them wait for it, so it must fit the SLO as well."""
    num_decodes = len(decode_ctxs) if mixed else 0

    def step_time(chunk: int) -> float:
        news, prefixes = fill_chunk(chunk - num_decodes, queued)
        if mixed:
            news += [1] * num_decodes
            prefixes += list(decode_ctxs)
        return timer.prefill_time(news, prefixes) if news else 0.0

    return largest_fitting_chunk(step_time, max_chunk, slo_s, granule)
