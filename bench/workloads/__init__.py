"""Workloads for the goodput harness: real traces and generators with published statistics."""

from tokenlake.bench.workloads.generators import GENERATORS, SESSION_WORKLOADS, GeneratorConfig
from tokenlake.bench.workloads.request import SimRequest, Workload, block_tokens, prompt_tokens
from tokenlake.bench.workloads.trace_workload import TraceConfig, trace_workload

__all__ = [
    "GENERATORS",
    "GeneratorConfig",
    "SESSION_WORKLOADS",
    "SimRequest",
    "TraceConfig",
    "Workload",
    "block_tokens",
    "prompt_tokens",
    "trace_workload",
]
