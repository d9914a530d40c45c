"""Measure TokenLake's control-plane cost model once, on this machine
(``tokenlake bench calibrate-control-plane``; :mod:`tokenlake.benchmarks.sim.control_plane_cost`).

TokenLake runs in the simulator on the conversation trace and SCBench-like sessions at rates
below, at and above their knees, every ``step()`` and ``complete()`` timed on this thread's
CPU clock; a linear model per kind of call is fitted to those times and written to ``--out``
(default: the checked-in host profile the simulator charges by default), or into a CPU
hardware profile (``--hardware-profile FILE``, its ``control_plane`` entry). The simulator's
results then depend on the file, not on the machine that runs them.

    python -m tokenlake.benchmarks.calibrate.control_plane [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from tokenlake.benchmarks.sim.control_plane_cost import (
    DEFAULT_PATH,
    LIVE,
    fit_control_plane_cost,
)
from tokenlake.benchmarks.sim.cpu_profile import load_cpu_profile
from tokenlake.benchmarks.sim.runner import RunConfig, simulate
from tokenlake.benchmarks.sim.step_timer import ClusterSpec, make_timer
from tokenlake.benchmarks.sim.systems.layered import PricingConfig
from tokenlake.benchmarks.workloads import GENERATORS, GeneratorConfig, TraceConfig, trace_workload
from tokenlake.benchmarks.workloads.traces import conversation_trace

CONVERSATION_REQUESTS, CONVERSATION_RATES = 300, (1.0, 1.7, 2.5)  # many short decodes
SCBENCH_REQUESTS, SCBENCH_RATES = 40, (0.2, 0.4)  # long contexts: large plans


def workloads():
    """(name, workload) of every calibration run, seed 0 (the harness's presets: the
    conversation trace from request 3,000, jittered in 3-s buckets)."""
    path = conversation_trace(3000 + CONVERSATION_REQUESTS)
    for rate in CONVERSATION_RATES:
        cfg = TraceConfig(path, limit=CONVERSATION_REQUESTS, offset=3000, rate=rate, jitter_s=3.0)
        yield f"conversation @ {rate:g}", trace_workload(cfg)
    for rate in SCBENCH_RATES:
        yield f"scbench @ {rate:g}", GENERATORS["scbench"](GeneratorConfig(SCBENCH_REQUESTS, rate))


def measure(prefill_tokens: int = 2048) -> list:
    """Every control-plane call of TokenLake's calibration runs: (kind, features, seconds)."""
    spec = ClusterSpec()
    samples: list = []
    cfg = RunConfig("tokenlake", prefill_tokens=prefill_tokens,
                    pricing=PricingConfig(control_plane=LIVE))  # fmt: skip
    for _, workload in workloads():
        simulate(workload, spec, make_timer(spec), cfg, control_samples=samples)
    return samples


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_PATH, help="where to write the model")
    p.add_argument("--hardware-profile", type=Path, default=None, metavar="FILE",
                   help="write the model into this CPU hardware profile instead")  # fmt: skip
    args = p.parse_args(argv)
    profile = load_cpu_profile(args.hardware_profile) if args.hardware_profile else None
    samples = measure()
    cost = fit_control_plane_cost(samples)
    if profile is not None:
        data = dataclasses.replace(profile, control_plane=cost).to_json()
        args.hardware_profile.write_text(json.dumps(data, indent=1) + "\n")
    else:
        args.out.write_text(json.dumps(cost.to_dict(), indent=1) + "\n")
    measured = sum(s for _, _, s in samples)
    charged = sum(cost.seconds(k, f) for k, f, _ in samples)
    line = {"out": str(args.hardware_profile or args.out), "calls": len(samples),
            "measured_s": round(measured, 4), "model_s": round(charged, 4), "r2": dict(cost.r2)}  # fmt: skip
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
