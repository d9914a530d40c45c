"""``make demo`` (``tokenlake demo``) end to end on a small replay: server process, HTTP streaming, the
transformers check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_runs_and_matches_transformers():
    out = subprocess.run(
        [str(Path(sys.executable).with_name("tokenlake")), "demo", "--sessions", "3", "--max-output", "4",
         "--verify", "2", "--speedup", "1000"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["verified_identical"] == summary["verified"] == 2
    assert summary["turns"] >= 6 and summary["output_tokens"] > 0
    assert summary["cached_prompt_tokens"] > 0  # later turns reuse earlier ones
    assert "HTTP Request:" not in out.stderr  # httpx's per-request INFO lines stay quiet
