"""benchmarks/micro/attention.py runs end to end on tiny cases (its timings are not checked:
performance lives in the benchmark's own output), including the soft-cap timing and a
baseline core loaded next to this build's -- here this build's own file, so outputs match."""

from __future__ import annotations

import json

from tokenlake import _C
from tokenlake.benchmarks.micro import attention as bench_attention


def test_tiny_run_prints_one_json_line_per_case(capsys):
    bench_attention.main(
        ["--prefix-lens", "64", "--repeats", "1", "--warmup", "0", "--flush-mib", "1",
         "--decode-heads", "4", "2", "16", "--prefill-heads", "4", "2", "16",
         "--boundary-prefix-lens", "16", "--boundary-calls", "2", "--logit-cap", "5",
         "--baseline-core", _C.__file__]
    )  # fmt: skip
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    assert [(r["case"], r["dtype"]) for r in rows[:4]] == [
        (case, dtype) for case in ("decode", "prefill") for dtype in ("float32", "bfloat16")
    ]
    assert sorted({r["case"] for r in rows[4:]}) == ["boundary_merge", "boundary_partial_attention"]
    for r in rows[:4]:
        assert r["cpp_softcap_ms"] > 0 and r["core_vs_baseline_max_abs_diff"] == 0.0
        assert r["max_abs_diff_vs_sdpa"] < 0.05
