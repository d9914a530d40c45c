"""``tokenlake goodput --eviction``: TokenLake's pool runs the chosen eviction policy (the JSON
line says which) and a policy the pool does not know is refused."""

from __future__ import annotations

import json

import pytest
from test_goodput_traces import ROWS, write

from tokenlake.benchmarks.goodput.harness import main


def test_cli_eviction_reaches_the_pool_and_is_validated(tmp_path, capsys):
    trace = write(tmp_path / "mine.jsonl", ROWS)
    args = ["--trace", str(trace), "--time-scale", "1", "--systems", "tokenlake", "--seeds", "1"]
    for policy in ("lru", "protect"):
        assert main(args + ["--eviction", policy]) == 0
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
        assert [x["eviction"] for x in lines] == [policy] and lines[0]["finished"] == 3
    with pytest.raises(SystemExit):
        main(args + ["--eviction", "lfu"])
    assert "--eviction: invalid choice: 'lfu'" in capsys.readouterr().err
