"""Measure latency-model profile rows on a real engine.

The engine is injected, so this package does not import :mod:`tokenlake.engines`: ``execute(
plans, chunks)`` must run a (partial) :class:`~tokenlake.Plans` on the data plane, e.g.
``lambda p, c: run_iteration(cluster, p, c, model)`` with the in-process ``LocalCluster`` and
``SyntheticModel`` (deterministic K/V, real kernels, real puts and queries).

Rows measure what the latency model covers: the compute engine's work on new tokens. Every
measured request is fresh (random tokens, empty prefix), so no prefix attention is included
(that is the cache load ``L``). A decode row is a batch of one-token requests: the same
per-row work as a decode step without its prefix. A DoP-``k`` batch runs on ``k`` instances
in parallel; the in-process cluster runs its sub-batches one after another, so each is timed
alone and the row keeps the slowest.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from tokenlake.errors import InvalidArgumentError
from tokenlake.plans import Chunk, Plans
from tokenlake.pool import Pool
from tokenlake.scheduler.latency_model import DECODE, PHASES, PREFILL, ProfileRow

Execute = Callable[[Plans, Mapping[int | str, Chunk]], object]
Case = tuple[str, int, tuple[int, ...]]  # (phase, dop, new tokens per request)


def default_cases(
    dops: Sequence[int] = (1, 2), max_len: int = 512, num_prefill: int = 12, seed: int = 0
) -> list[Case]:
    """Prefill batches of 1..4 requests of 1..``max_len`` tokens at each DoP, and decode
    batches of 1..32 requests."""
    rng = np.random.default_rng(seed)
    cases: list[Case] = []
    for dop in dops:
        for _ in range(num_prefill):
            n = int(rng.integers(1, 5))
            lengths = tuple(int(x) for x in rng.integers(max(dop, 1), max_len + 1, n))
            cases.append((PREFILL, dop, lengths))
    cases += [(DECODE, 1, (1,) * bs) for bs in (1, 2, 4, 8, 16, 32)]
    return cases


def measure_rows(
    pool: Pool,
    execute: Execute,
    cases: Sequence[Case],
    repeats: int = 3,
    seed: int = 0,
    vocab: int = 32000,
    clock: Callable[[], float] = time.perf_counter,
    statistic: Callable[[Sequence[float]], float] = min,
    max_seconds: float | None = None,
) -> list[ProfileRow]:
    """One row per case: ``statistic`` (the fastest by default; the server takes the median)
    of ``repeats`` runs of ``execute`` on a fresh batch, timed on ``clock`` (wall time; a
    replay in CPU time profiles in ``time.process_time``). With ``max_seconds``, once that
    much ``clock`` time has passed the remaining cases run once each: a slow machine or
    model bounds the profile's time, not its coverage.

    Each run plans the batch with ``pool.gen_plans``, executes and commits it, then finishes
    its requests, so the pool is left without running requests.
    """
    if repeats < 1:
        raise InvalidArgumentError(f"repeats: expected >= 1, got {repeats}")
    rng = np.random.default_rng(seed)
    rows = []
    deadline = None if max_seconds is None else clock() + max_seconds
    for c, (phase, dop, lengths) in enumerate(cases):
        if phase not in PHASES or (phase == DECODE and (dop != 1 or set(lengths) != {1})):
            raise InvalidArgumentError(f"cases[{c}]: bad case {(phase, dop, lengths)!r}")
        runs = []
        for r in range(repeats):
            if runs and deadline is not None and clock() > deadline:
                break
            runs.append(
                _run_once(pool, execute, dop, lengths, rng, vocab, f"profile-{c}-{r}", clock)
            )
        rows.append(ProfileRow(phase, dop, tuple(lengths), float(statistic(runs))))
    return rows


def _run_once(pool, execute, dop, lengths, rng, vocab, tag, clock) -> float:
    chunks = [
        Chunk(f"{tag}-{i}", rng.integers(0, vocab, n).astype(np.int32), 0)
        for i, n in enumerate(lengths)
    ]
    by_id = {c.request_id: c for c in chunks}
    plans = pool.gen_plans([chunks], [dop], pool.get_prefix_tree())
    slowest = 0.0
    for qp, tp in zip(plans.query_plans, plans.transfer_plans, strict=True):
        sub = dataclasses.replace(plans, query_plans=(qp,), transfer_plans=(tp,))
        t0 = clock()
        execute(sub, by_id)
        slowest = max(slowest, clock() - t0)
    pool.commit(plans)
    for c in chunks:
        pool.finish(c.request_id)
    return slowest


def measure_hop_seconds(
    pool: Pool,
    execute: Execute,
    repeats: int = 5,
    seed: int = 0,
    vocab: int = 32000,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """The fixed cost of one remote holder per step (all layers): a one-row decode over a
    one-page prefix, run on the instance that holds the page (every part local) and on
    another instance (the page's part remote), each the fastest of ``repeats`` runs;
    ``remote - local``, at least 0 (0 with one live instance). The kernel work is the same
    in both, so the difference is the round trip, the merge and the per-layer signals.

    Leaves the pool as it was: the prompt is stored, decoded and aborted, then finished.
    """
    if repeats < 1:
        raise InvalidArgumentError(f"repeats: expected >= 1, got {repeats}")
    live = pool.live_instances
    if len(live) < 2:
        return 0.0
    rng = np.random.default_rng(seed)
    page = pool.config.segment_len
    prompt = Chunk("profile-hop", rng.integers(0, vocab, page).astype(np.int32), 0)
    plans = pool.gen_plans([[prompt]], None, pool.get_prefix_tree())
    execute(plans, {prompt.request_id: prompt})
    pool.commit(plans)
    try:
        step = Chunk(prompt.request_id, np.append(prompt.token_ids, 1).astype(np.int32), page)
        probe = pool.gen_plans([[step]], None, pool.get_prefix_tree())
        holder = min(int(h) for h in probe.query_plans[0].holder_ids)
        pool.abort(probe, executed=False)
        other = next(i for i in live if i != holder)
        best = {holder: float("inf"), other: float("inf")}
        for _ in range(repeats):
            for origin in (holder, other):
                plans = pool.gen_plans([[step]], None, pool.get_prefix_tree(), [[origin]])
                t0 = clock()
                execute(plans, {step.request_id: step})
                best[origin] = min(best[origin], clock() - t0)
                pool.abort(plans)
        return max(0.0, best[other] - best[holder])
    finally:
        pool.finish(prompt.request_id)
