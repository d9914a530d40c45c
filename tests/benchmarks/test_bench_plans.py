"""bench_plans' side-by-side mode: the child interpreter really imports the control plane of
the directory it is given, and returns the same cases."""

from __future__ import annotations

import shutil
from pathlib import Path

from tokenlake.benchmarks.micro import plans as bench_plans

ROOT = Path(__file__).resolve().parents[2]


def test_baseline_runs_the_given_tree(tmp_path):
    # the child asserts that its tokenlake is tmp_path's copy, else baseline_cases exits
    shutil.copytree(
        ROOT / "tokenlake", tmp_path / "tokenlake", ignore=shutil.ignore_patterns("*.so")
    )
    cases = [[2, 8, 3]]
    (res,) = bench_plans.baseline_cases(str(tmp_path), cases)
    assert res["case"] == "gen_plans" and res["num_instances"] == 2 and res["num_requests"] == 8
    assert res["p50_ms"] > 0 and res["p50_cpu_ms"] > 0
    (here,) = bench_plans.latency_cases(cases)
    assert here["num_prefix_segments"] == res["num_prefix_segments"]
