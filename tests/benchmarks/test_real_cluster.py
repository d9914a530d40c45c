"""The real mini-cluster's replay (benchmarks/real/cluster.py): both systems serve every request of
a small workload through the real model, in virtual time that only moves forward, and the
shared documents hit the caches."""

from __future__ import annotations

import pytest

from tokenlake.benchmarks.real.replay import Solo, run
from tokenlake.benchmarks.real.systems import (
    LATENCY,
    SYSTEMS,
    Env,
    RealClusterConfig,
    Timing,
)
from tokenlake.engines.model.llama import LlamaModel
from tokenlake.engines.model.tiny import write_tiny_random

CFG = RealClusterConfig(
    num_instances=4, segment_len=16, num_slots=24, chunk_len=64, num_docs=3, doc_len=64,
    question_len=8, output_len=3, num_requests=12,
)  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return LlamaModel.from_dir(write_tiny_random(tmp_path_factory.mktemp("tiny") / "m", seed=0))


# the routers' lanes are single instances: DoP, holders and sync settings change nothing there
CASES = [
    ("tokenlake", t)
    for t in (Timing(dop_speedup=False, parallel_holders=False), Timing(sync_iterations=True))
]
CASES += [(system, Timing()) for system in SYSTEMS]


@pytest.mark.parametrize(("system", "timing"), CASES, ids=str)
def test_every_request_is_served_in_forward_time(model, system, timing):
    solo = Solo((1.0, 0.0), (1.0, 0.0))  # an SLO no run can miss: this checks the replay
    env = Env(slo={}, latency={1: LATENCY, CFG.num_instances: LATENCY})
    records, load, spent = run(system, model, CFG, 20.0, solo, env, 120.0, timing)
    assert len(records) == CFG.num_requests
    for r in records:
        assert r.finished and r.num_tokens == CFG.output_len, r
        assert r.arrival_s < r.first_token_s <= r.finish_s
        assert r.meets_slo()
    # 12 requests over 3 documents of 4 whole segments each: at most 3 must compute theirs,
    # a few more when they overlap an earlier one's prefill; most find theirs cached
    assert sum(r.hit_tokens >= CFG.doc_len for r in records) >= CFG.num_requests // 2
    assert spent["iterations"] >= CFG.output_len and spent["compute_s"] > 0
    assert load.matrix()[1].sum() > 0
