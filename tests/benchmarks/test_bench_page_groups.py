"""`tokenlake bench page-groups --quick`: a table and one JSON line per case; the grouped
part reads the shared pages once and agrees with the plain part."""

from __future__ import annotations

import json

from tokenlake.benchmarks.micro import page_groups as bench_page_groups


def test_quick_run_reports_reads_and_agreement(capsys):
    bench_page_groups.main(["--quick"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert len(lines) == 1
    (case,) = lines
    # 8 requests x (256 shared + 256 private tokens, the last page half full)
    assert case["plain_read_tokens"] == 8 * (256 + 256 - 16)
    assert case["grouped_read_tokens"] == 256 + 8 * (256 - 16)
    assert case["max_abs_diff"] < 1e-4 and case["max_lse_diff"] < 1e-4
    assert case["plain_ms"] > 0 and case["grouped_ms"] > 0
