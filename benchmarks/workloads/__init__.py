"""Workloads for the goodput harness: real traces and generators with published statistics."""

from benchmarks.workloads.generators import GENERATORS, GeneratorConfig
from benchmarks.workloads.request import SimRequest, Workload, block_tokens, prompt_tokens
from benchmarks.workloads.trace_workload import TraceConfig, trace_workload

__all__ = [
    "GENERATORS",
    "GeneratorConfig",
    "SimRequest",
    "TraceConfig",
    "Workload",
    "block_tokens",
    "prompt_tokens",
    "trace_workload",
]
