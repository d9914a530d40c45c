"""Synchronous iterations with a TBT SLO (``tokenlake serve --tbt-slo-ms``): every decode
waits for the whole iteration, so while decodes run the prefill chunks are cut to the largest
whole-segment size the latency model predicts within the SLO; without decodes, or without an
SLO, the chunk is the configured one."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scheduler_cases import SHAPE, C

import tokenlake as tl
from tokenlake.scheduler import Coeffs, ElasticScheduler, LatencyModel, SchedulerConfig
from tokenlake.scheduler.latency_model import PREFILL

# a prefill of n new tokens: 1 ms + 0.1 ms per token
MODEL = LatencyModel({1: Coeffs(1e-3, 1e-4, 0.0)}, Coeffs(1e-3, 1e-5, 0.0))


def _prefill_tokens(tbt: float, decoding: bool) -> int:
    pool = tl.Pool(tl.PoolConfig(SHAPE, 2, 64, segment_len=C))
    config = SchedulerConfig(2, C, chunk_len=16 * C, compute_lanes=1, tbt_slo=tbt)
    sched = ElasticScheduler(config, MODEL, pool)
    rng = np.random.default_rng(0)
    if decoding:
        sched.add_request("d", rng.integers(0, 1000, 2 * C).astype(np.int32), 8)
        it = sched.step()
        sched.complete(it, {"d": 1})
    sched.add_request("p", rng.integers(0, 1000, 16 * C).astype(np.int32), 2)
    d = sched.decide()
    return sum(c.end - c.start for b, ph in zip(d.batches, d.phases, strict=True)
               for c in b if ph == PREFILL)  # fmt: skip


@pytest.mark.parametrize("tbt", [0.008, 0.015, 0.03])
def test_prefill_chunks_fit_the_tbt_slo_while_decodes_run(tbt):
    got = _prefill_tokens(tbt, decoding=True)
    fits = max(n for n in range(C, 16 * C + 1, C) if MODEL.predict(PREFILL, [n]) <= tbt or n == C)
    assert got == fits
    assert _prefill_tokens(tbt, decoding=False) == 16 * C  # nobody waits: the whole chunk
    assert _prefill_tokens(math.inf, decoding=True) == 16 * C  # no SLO: the whole chunk
