"""Asynchronous decisions (docs/architecture.md#the-floors): which free instances run decode now and which prefill.

Iterations are in flight at once, each on its own instance group. Decodes run in *lanes*: an
instance that finishes a decode batch decodes again at once with the requests that are ready,
so decode never waits for a prefill elsewhere. The elastic mode keeps as few lanes as the TBT
SLO allows (every free instance beyond them prefills), so it becomes the best fixed split by
itself: one lane is TokenLake-(N-1)P1D; more decodes open more lanes, up to N-1
(TokenLake-1P(N-1)D); no decodes, no lane. One instance stays out of the planned lanes: once
many requests decode, lanes would otherwise take every instance and new prompts starve (and
even a prompt that arrives when none waited would wait for a multi-step lane to end). An N-th
lane opens only when a ready decode's next token would otherwise miss the TBT SLO and no
prefill work waits.
xPyD keeps its decode instances as lanes and its prefill instances for prefill. A ready
decode may wait for a busy lane that frees soon enough for its next token to stay within the
TBT SLO ("what is about to free up") instead of taking a free instance from prefill.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from tokenlake.scheduler.config import ELASTIC, XPYD, SchedulerConfig
from tokenlake.scheduler.latency_model import DECODE, PREFILL, LatencyModel
from tokenlake.scheduler.request import Request

# How much longer than the step of the most lanes allowed a decode step may take when no lane
# count meets the TBT budget (see lanes_needed).
LANE_GAIN = 0.1


class Running(NamedTuple):
    """An iteration in flight, as the scheduler planned it."""

    phase: str  # "prefill", "decode" or "mixed"
    instances: tuple[int, ...]
    num_decodes: int  # decode steps in it
    predicted_end: float  # seconds, on the caller's clock


class Split(NamedTuple):
    """One asynchronous decision's shape: ``decodes`` (oldest ready first) run now on
    ``decode_instances`` (one lane each, at most ``lane_cap`` per lane); prefill work goes to
    ``prefill_instances``."""

    decode_instances: tuple[int, ...]
    decodes: tuple[Request, ...]
    lane_cap: int
    prefill_instances: tuple[int, ...]


def decode_step_time(
    model: LatencyModel, num_decodes: int, load: float, scale: float = 1.0
) -> float:
    """Predicted seconds of one decode batch of ``num_decodes`` steps under cache load, times
    ``scale`` (how much slower decode iterations have been running than the model says)."""
    return scale * model.predict(DECODE, [1] * max(num_decodes, 1), load=load)


def lanes_needed(
    config: SchedulerConfig,
    model: LatencyModel,
    num_decodes: int,
    limit: int,
    load: float,
    scale: float = 1.0,
) -> int:
    """Fewest lanes (``<= limit``) whose decode batches take at most ``lane_tbt_fraction`` of
    the TBT SLO: the rest of the SLO covers a wait for a lane that is still busy.

    When even ``limit`` lanes miss that budget, the fewest whose step is within ``LANE_GAIN``
    of the ``limit`` lanes' step: a decode step is mostly the per-step fixed cost and the
    attention on every holder, whatever the lane, so extra lanes barely shorten it (measured:
    3 lanes within 3% of 1 in a fifth of the decisions on LooGLE-like and the conversation
    trace) and only take instances from prefill."""
    if num_decodes <= 0:
        return 0
    budget = config.tbt_slo * config.lane_tbt_fraction
    steps = []
    for lanes in range(1, limit + 1):
        step = decode_step_time(model, math.ceil(num_decodes / lanes), load, scale)
        if step <= budget:
            return lanes
        steps.append(step)
    return next(lanes for lanes, step in enumerate(steps, 1) if step <= steps[-1] * (1 + LANE_GAIN))


def prefill_budget(
    config: SchedulerConfig, model: LatencyModel, num_instances: int, decoding: bool = False
) -> int:
    """Prefill tokens of a decision over ``num_instances`` free instances:
    ``max_prefill_tokens`` (else ``chunk_len``) each, as a chunked-prefill size. While requests
    decode (``decoding``: elastic, whose lanes may need these instances next), few enough that
    one instance's prefill takes at most the TBT SLO, so an instance a decode may need next
    frees within one token's budget. Measured (1,000 requests, seed 0, P90 SLO attainment):
    without the cap the conversation trace misses the TBT SLO (@ 2.12 req/s: 88.7%; at 2,048
    tokens and the old lane rules 70% @ 2 req/s); at two thirds of the SLO LooGLE-like's long
    prompts run in small chunks and miss the TTFT SLO (@ 4.32: 86.0%, 94.7% at the whole SLO,
    conversation 93.5% either way; ShareGPT-like 6,000 @ 95.1: 94.7% → 97.1%)."""
    per = config.max_prefill_tokens or config.chunk_len
    if decoding and math.isfinite(config.tbt_slo):
        while per > config.segment_len and model.predict(PREFILL, [per]) > config.tbt_slo:
            per -= config.segment_len
    return max(config.segment_len, per * num_instances)


def split_free_instances(
    config: SchedulerConfig,
    model: LatencyModel,
    load: float,
    now: float,
    live: Sequence[int],
    free: Sequence[int],
    running: Sequence[Running],
    ready_decodes: Sequence[Request],
    scale: float = 1.0,
    prefill_waits: bool = False,
    homes: Mapping[int | str, int] | None = None,
) -> Split:
    """Lanes and prefill instances among ``free`` (sorted ids) for elastic and xPyD modes.

    ``running`` are the iterations in flight; ``ready_decodes`` the decode-phase requests in
    none of them; ``scale`` corrects the model's decode step time (see
    :func:`decode_step_time`); ``prefill_waits``: some request not in flight waits for its
    first chunk or has prompt left. Lanes needed for all decodes (ready and in flight), at
    most ``len(live) - 1`` in elastic mode, are opened on free instances beyond the lanes
    already busy; ready decodes beyond the new lanes' share wait for a busy lane, unless that
    wait would break the TBT SLO of the oldest of them, in which case one more lane opens
    (elastic overshoot: up to every live instance when no prefill waits, else up to
    ``len(live) - 1``, the decode share of TokenLake-1P(N-1)D; xPyD opens every free decode
    instance it needs). ``homes`` (request id -> the instance holding its newest KV): lanes
    open first where the oldest ready decodes' KV lives, so a light stream's decode steps
    read their prefix locally instead of paying a hop per layer.
    """
    if config.mode == XPYD:
        num_prefill = min(config.num_prefill_instances, len(live) - 1)
        prefill_role = set(sorted(live)[:num_prefill])
        candidates = [i for i in free if i not in prefill_role]
        prefill_pool = [i for i in free if i in prefill_role]
        max_lanes = len(live) - num_prefill
    else:
        assert config.mode == ELASTIC
        candidates, prefill_pool = list(free), []
        max_lanes = max(1, len(live) - 1)
    overshoot_max = max_lanes if prefill_waits or config.mode == XPYD else len(live)
    lanes_busy = [r for r in running if r.phase == DECODE]
    in_flight = sum(r.num_decodes for r in running)
    total = len(ready_decodes) + in_flight
    if config.mode == XPYD:
        target = max_lanes if total else 0
    else:
        target = lanes_needed(config, model, total, max_lanes, load, scale)
    cap = math.ceil(total / target) if target else 0
    ready = sorted(ready_decodes, key=lambda r: (r.ready_at, r.arrival))
    opened = 0
    if ready and candidates:
        opened = min(len(candidates), max(0, target - len(lanes_busy)), math.ceil(len(ready) / cap))
        if opened == 0:
            next_free = min(r.predicted_end for r in lanes_busy)
            step = decode_step_time(model, cap, load, scale)
            overdue = next_free - ready[0].ready_at + step > config.tbt_slo
            opened = int(overdue and len(lanes_busy) < overshoot_max)
    if homes:
        first = {}
        for k, r in enumerate(ready):
            first.setdefault(homes.get(r.request_id), k)
        candidates.sort(key=lambda i: (first.get(i, len(ready)), i))
    lanes = tuple(candidates[:opened])
    if config.mode == ELASTIC:
        prefill_pool = [i for i in free if i not in lanes]
    taken = tuple(ready[: opened * cap])
    return Split(lanes, taken, cap, tuple(prefill_pool))
