"""With a cache that never evicts, the simulator's prefix hit rate equals the trace's own
infinite-cache strict prefix hit rate, computed here independently from the raw ``hash_ids``."""

import dataclasses
import gzip
import json

import pytest

from tokenlake.benchmarks.sim.runner import RunConfig, simulate
from tokenlake.benchmarks.sim.step_timer import ClusterSpec, make_timer
from tokenlake.benchmarks.workloads import TraceConfig, trace_workload
from tokenlake.benchmarks.workloads.traces import conversation_trace

NUM = 150
B = 512

CONVERSATION_TRACE = conversation_trace(1000)  # the shared trace, or the bundled excerpt


def expected_block_hit(num: int) -> tuple[int, int]:
    """Strict prefix hit over the first ``num`` requests: a block hits if its chained id was
    seen before and every block before it hit too."""
    seen, hits, total = set(), 0, 0
    with gzip.open(CONVERSATION_TRACE, "rt") as f:
        for _, line in zip(range(num), f, strict=False):
            ids = json.loads(line)["hash_ids"]
            for h in ids:
                if h not in seen:
                    break
                hits += 1
            total += len(ids)
            seen.update(ids)
    return hits, total


@pytest.mark.parametrize(
    "system, n, segment_len", [("tokenlake", 2, 512), ("tokenlake", 2, 256), ("router", 1, 512)]
)
def test_infinite_cache_reproduces_trace_hit_rate(system, n, segment_len):
    # TokenLake's segment length is its own configuration, independent of the trace's blocks
    w = trace_workload(TraceConfig(CONVERSATION_TRACE, limit=NUM))
    # One request at a time (100 s apart, one output token) so each sees all earlier ones,
    # as the trace statistic assumes.
    reqs = tuple(
        dataclasses.replace(r, arrival_s=100.0 * i, output_len=1) for i, r in enumerate(w.requests)
    )
    w = dataclasses.replace(w, requests=reqs)
    spec = ClusterSpec(num_instances=n, cache_tokens=4_000_000 // n)
    res = simulate(w, spec, make_timer(spec), RunConfig(system, segment_len=segment_len))
    assert all(r.finished for r in res.records)
    hits = sum(-(-r.cached_tokens // B) for r in res.records)
    total = sum(len(r.block_ids) for r in w.requests)
    assert (hits, total) == expected_block_hit(NUM)
