"""Reproducible results: TokenLake's control plane is charged by a calibrated cost model, so
the same ``tokenlake goodput`` command gives byte-identical summaries however fast or busy
the machine is; the live measurement (``--control-plane live``) does not."""

from __future__ import annotations

import json

import pytest

from tokenlake.benchmarks.goodput.harness import main
from tokenlake.benchmarks.sim.control_plane_cost import (
    DEFAULT_PATH,
    FEATURES,
    KINDS,
    ControlPlaneCost,
    ControlPlaneCostError,
    fit_control_plane_cost,
    load_control_plane_cost,
)
from tokenlake.benchmarks.workloads.traces import CONVERSATION_TRACE
from tokenlake.scheduler import ElasticScheduler

# two rates of the conversation trace: summary.json holds each one's attainment, latencies,
# hit rate and load CV
ARGV = ["--workload", "conversation", "--requests", "40", "--systems", "tokenlake",
        "--prefill-tokens", "2048", "--rates", "1.5,3", "--seeds", "1"]  # fmt: skip


def _slow_control_plane(monkeypatch, loops: int) -> None:
    """Every scheduler step burns ``loops`` more iterations of CPU: a slower or busier
    machine."""
    step = ElasticScheduler.step

    def slow(self, *args, **kwargs):
        for _ in range(loops):
            pass
        return step(self, *args, **kwargs)

    monkeypatch.setattr(ElasticScheduler, "step", slow)


def _summary(tmp_path, name: str, extra=()) -> bytes:
    if not CONVERSATION_TRACE.exists():
        pytest.skip(
            f"needs the full conversation trace {CONVERSATION_TRACE} (../shared, not in a clone)"
        )
    out = tmp_path / name
    assert main([*ARGV, *extra, "--out", str(out)]) == 0
    return (out / "summary.json").read_bytes()


def test_same_command_same_summary_on_a_slower_machine(tmp_path, monkeypatch, capsys):
    first = _summary(tmp_path, "a")
    _slow_control_plane(monkeypatch, 20_000)
    assert _summary(tmp_path, "b") == first
    assert len(json.loads(first)["sweep"]["tokenlake"]) == 2


def test_live_measurement_follows_the_machine(tmp_path, monkeypatch, capsys):
    """The option the model replaces: a slower step shows in the simulated results."""
    fast = _summary(tmp_path, "a", ["--control-plane", "live"])
    _slow_control_plane(monkeypatch, 20_000)
    assert _summary(tmp_path, "b", ["--control-plane", "live"]) != fast


def test_the_fit_recovers_a_linear_cost():
    """Non-negative least squares on calls priced by known coefficients gives them back."""
    truth = {k: [1e-4 * (i + 1), 2e-6, 3e-6 * i, 0.0, 1e-5, 4e-8] for i, k in enumerate(KINDS)}
    samples = []
    for kind, coef in truth.items():
        for n in range(40):
            features = (1, n % 7, n % 5 + 1, 3 * n, n % 3 + 1, 100 * (n % 11))
            samples.append(
                (kind, features, sum(c * f for c, f in zip(coef, features, strict=True)))
            )
    cost = fit_control_plane_cost(samples)
    for kind, coef in truth.items():
        assert dict(cost.coefficients)[kind] == pytest.approx(coef, rel=1e-4, abs=1e-12)
    again = ControlPlaneCost.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert again == cost


def test_the_checked_in_model_and_bad_files(tmp_path):
    cost = load_control_plane_cost()
    assert sorted(dict(cost.coefficients)) == sorted(KINDS)
    assert all(len(c) == len(FEATURES) for _, c in cost.coefficients)
    assert cost.seconds("decode", (1, 10, 4, 100, 1, 4)) > 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "tokenlake-control-plane-cost/1", "coefficients": {}}))
    with pytest.raises(ControlPlaneCostError, match="bad.json"):
        load_control_plane_cost(bad)
    with pytest.raises(ControlPlaneCostError, match="missing.json"):
        load_control_plane_cost(tmp_path / "missing.json")
    assert DEFAULT_PATH.name == "control_plane_cost.json"
