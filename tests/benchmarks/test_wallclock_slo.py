"""The wall-clock bench's fixed SLO: flags, then the file, else measured once and written;
``--calibrate`` measures again. No server is started (the measurement is a stand-in)."""

from __future__ import annotations

import json

import pytest

from tokenlake.benchmarks.wallclock import slo_file
from tokenlake.benchmarks.wallclock.measure import Slo
from tokenlake.benchmarks.wallclock.run import parse_args


def _measure(calls: list):
    def measure():
        calls.append(1)
        return Slo(0.2, 0.02), 0.05

    return measure


def test_measured_once_then_fixed_from_the_file(tmp_path):
    path = tmp_path / "slo.json"
    args = parse_args(["--quick", "--slo-file", str(path)])
    calls = []
    slo, solo, source = slo_file.resolve(args, "tiny-random", "conversation", _measure(calls))
    assert (slo, solo) == (Slo(0.2, 0.02), 0.05) and "first use" in source and calls == [1]
    assert json.loads(path.read_text())["tiny-random"]["conversation"]["tpot_s"] == 0.02
    again = slo_file.resolve(args, "tiny-random", "conversation", _measure(calls))
    assert again[:2] == (slo, solo) and "fixed" in again[2] and calls == [1]
    calibrate = parse_args(["--quick", "--slo-file", str(path), "--calibrate"])
    assert "calibrated" in slo_file.resolve(calibrate, "tiny-random", "conversation",
                                            _measure(calls))[2]  # fmt: skip
    assert calls == [1, 1]


def test_flags_win_and_must_come_together(tmp_path):
    args = parse_args(["--ttft-slo-ms", "300", "--tpot-slo-ms", "30", "--slo-file",
                       str(tmp_path / "none.json")])  # fmt: skip
    slo, solo, source = slo_file.resolve(args, "bench-model", "long-document", _measure([]))
    assert slo == Slo(0.3, 0.03) and solo > 0 and "--ttft-slo-ms" in source
    assert not (tmp_path / "none.json").exists()
    with pytest.raises(SystemExit):
        parse_args(["--ttft-slo-ms", "300"])


def test_a_malformed_entry_is_refused(tmp_path):
    path = tmp_path / "slo.json"
    path.write_text(json.dumps({"tiny-random": {"conversation": {"ttft_s": -1}}}))
    args = parse_args(["--slo-file", str(path)])
    with pytest.raises(ValueError, match="tiny-random/conversation"):
        slo_file.resolve(args, "tiny-random", "conversation", _measure([]))
