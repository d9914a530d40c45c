"""Workloads for the goodput harness: real traces and generators with published statistics."""

from tokenlake.benchmarks.workloads.generators import GENERATORS, SESSION_WORKLOADS, GeneratorConfig
from tokenlake.benchmarks.workloads.request import SimRequest, Workload, block_tokens, prompt_tokens
from tokenlake.benchmarks.workloads.trace_workload import TraceConfig, trace_workload

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
