"""Bring your own trace through the ``tokenlake`` command: ``tokenlake trace`` (counts, length
percentiles, infinite-cache hit rate against a brute-force recount, conversion) and
``tokenlake goodput --trace`` (table, JSON lines, plots) on plain, .gz and .xz files; a
malformed line is named by line and field and exits 2."""

from __future__ import annotations

import gzip
import json
import lzma

import numpy as np
import pytest

from tokenlake.benchmarks.workloads.traces import read_trace
from tokenlake.cli.main import main

BLOCK = 512
OPENERS = {"": open, ".gz": gzip.open, ".xz": lzma.open}


def tiny_rows() -> list[dict]:
    """12 requests of 4 sessions; each session's prompts share their first blocks."""
    rows = []
    for i in range(12):
        n = 1100 + (i % 3) * 512
        num_blocks = -(-n // BLOCK)
        base = 100 * (i % 4)
        ids = [base + k for k in range(num_blocks - 1)] + [base + 50 + i]  # unique last block
        rows.append(
            {"timestamp": 500 * i, "input_length": n, "output_length": 8 + i,
             "hash_ids": ids, "session_id": f"s{i % 4}"}
        )  # fmt: skip
    return rows


def write(path, rows, opener=open):
    with opener(path, "wt") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def brute_force_hit_rate(rows: list[dict]) -> float:
    """Tokens of each prompt in leading blocks some earlier request had (at most n - 1)."""
    seen, hit, total = set(), 0, 0
    for r in sorted(rows, key=lambda r: r["timestamp"]):
        k = 0
        while k < len(r["hash_ids"]) and r["hash_ids"][k] in seen:
            k += 1
        hit += min(k * BLOCK, r["input_length"] - 1)
        total += r["input_length"]
        seen.update(r["hash_ids"])
    return hit / total


def json_lines(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.startswith("{")]


@pytest.mark.parametrize("suffix", sorted(OPENERS))
def test_trace_reports_counts_lengths_and_hit_rate(tmp_path, capsys, suffix):
    rows = tiny_rows()
    path = write(tmp_path / f"t.jsonl{suffix}", rows, OPENERS[suffix])
    assert main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    (s,) = json_lines(out)
    inputs = [r["input_length"] for r in rows]
    assert s["requests"] == 12 and s["sessions"] == 4 and s["block_size"] == BLOCK
    assert s["span_s"] == pytest.approx(5.5)
    assert s["input_len"]["p50"] == pytest.approx(np.percentile(inputs, 50))
    assert s["input_len"]["max"] == max(inputs)
    assert s["output_len"]["p90"] == pytest.approx(np.percentile([8 + i for i in range(12)], 90))
    assert s["prompt_tokens"] == sum(inputs)
    assert s["infinite_cache_hit_rate"] == pytest.approx(brute_force_hit_rate(rows), abs=1e-4)
    assert 0 < s["infinite_cache_hit_rate"] < 1
    assert "infinite-cache hit rate" in out  # the human-readable lines come first


@pytest.mark.parametrize("suffix", [".xz", ".gz", ""])
def test_trace_converts_a_slice(tmp_path, capsys, suffix):
    src = write(tmp_path / "t.jsonl", tiny_rows())
    dst = tmp_path / f"slice.jsonl{suffix}"
    args = ["trace", str(src), "--offset", "2", "--max-requests", "5"]
    assert main([*args, "--out", str(dst), "--time-scale", "0.5"]) == 0
    capsys.readouterr()
    got, block = read_trace(dst)
    want = tiny_rows()[2:7]
    assert block == BLOCK and len(got) == 5
    assert [r.hash_ids for r in got] == [tuple(r["hash_ids"]) for r in want]
    assert [r.arrival_ms for r in got] == [0.5 * r["timestamp"] for r in want]
    assert [r.session_id for r in got] == [r["session_id"] for r in want]


def test_trace_names_a_malformed_line(tmp_path, capsys):
    rows = tiny_rows()[:3]
    rows[1] = dict(rows[1], input_length="long")
    bad = write(tmp_path / "bad.jsonl.gz", rows, gzip.open)
    assert main(["trace", str(bad)]) == 2
    assert "bad.jsonl.gz line 2: field 'input_length'" in capsys.readouterr().err
    broken = write(tmp_path / "broken.jsonl", [tiny_rows()[0], "{not json"])
    assert main(["trace", str(broken)]) == 2
    assert "broken.jsonl line 2: not valid JSON" in capsys.readouterr().err
    assert main(["trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", sorted(OPENERS))
def test_goodput_on_your_own_trace_writes_table_json_and_plots(tmp_path, capsys, suffix):
    pytest.importorskip("matplotlib")
    path = write(tmp_path / f"mine.jsonl{suffix}", tiny_rows(), OPENERS[suffix])
    out_dir = tmp_path / "out"
    args = ["goodput", "--trace", str(path), "--systems", "tokenlake,router", "--goodput"]
    args += ["--seeds", "1", "--prefill-tokens", "2048", "--max-evals", "2", "--lo", "1"]
    args += ["--hi", "2", "--block-size", str(BLOCK), "--sessions", "closed"]
    assert main([*args, "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "P90 goodput" in out and "system" in out  # the table
    lines = json_lines(out)
    runs = [x for x in lines if "slo_attainment" in x]
    assert {r["system"] for r in runs} == {"tokenlake", "router"}
    assert all(
        r["total"] == 12 and r["finished"] + r["rejected"] + r["stalled"] == 12 for r in runs
    )
    summary = {x["system"]: x for x in lines if "p90_goodput" in x}
    assert set(summary) == {"tokenlake", "router"}
    for s in summary.values():
        assert 0 <= s["hit_rate"] <= 1 and s["load_cv"] >= 0
    assert (out_dir / "summary.json").exists() and (out_dir / "runs.jsonl").exists()
    for plot in ("mine_attainment.png", "mine_systems.png", "mine_load.png"):
        assert (out_dir / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot


def test_goodput_replays_your_trace_at_its_own_timing(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = write(tmp_path / "mine.jsonl", tiny_rows(), OPENERS[""])
    out_dir = tmp_path / "out"
    args = ["goodput", "--trace", str(path), "--systems", "tokenlake,router", "--seeds", "1"]
    args += ["--time-scale", "2", "--block-size", str(BLOCK), "--out", str(out_dir)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "time x2;" in out.splitlines()[0]  # the header describes the replay itself
    assert "Replay at the trace's own timing" in out  # the table
    runs = [x for x in json_lines(out) if "slo_attainment" in x]
    assert {r["system"] for r in runs} == {"tokenlake", "router"}
    assert all(r["rate"] is None and r["total"] == 12 for r in runs)
    assert (out_dir / "mine_replay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_goodput_names_a_malformed_line(tmp_path, capsys):
    rows = tiny_rows()[:4]
    rows[2] = dict(rows[2], hash_ids=[1, -3, 2])
    bad = write(tmp_path / "bad.jsonl.xz", rows, lzma.open)
    args = ["goodput", "--trace", str(bad), "--systems", "router", "--time-scale", "1"]
    assert main(args) == 2
    assert "bad.jsonl.xz line 3: field 'hash_ids'[1]" in capsys.readouterr().err
