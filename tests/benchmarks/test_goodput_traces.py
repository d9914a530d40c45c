"""Traces as they come: plain, gzip or xz; whole-block hashing with an unhashed tail; the block
size read, given or inferred; every malformed line named by line and field; sessions."""

import gzip
import json
import lzma

import numpy as np
import pytest

from tokenlake.benchmarks.goodput.harness import main
from tokenlake.benchmarks.workloads import TraceConfig, trace_workload
from tokenlake.benchmarks.workloads.request import prompt_tokens
from tokenlake.benchmarks.workloads.traces import TokenSynth, TraceError, load_trace, read_trace


def row(t, n, ids, out=4, **extra):
    return {"timestamp": t, "input_length": n, "output_length": out, "hash_ids": ids, **extra}


def write(path, rows, opener=open):
    with opener(path, "wt") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


ROWS = [row(0, 1100, [0, 1, 2]), row(1000, 1300, [0, 1, 3]), row(2500, 300, [9])]


@pytest.mark.parametrize("suffix, opener", [("", open), (".gz", gzip.open), (".xz", lzma.open)])
def test_plain_gzip_and_xz_load_alike(tmp_path, suffix, opener):
    rows, b = read_trace(write(tmp_path / f"t.jsonl{suffix}", ROWS, opener))
    assert b == 512  # inferred: 1100 -> 3 blocks, 1300 -> 3, 300 -> 1 fit only 512
    assert [r.hash_ids for r in rows] == [(0, 1, 2), (0, 1, 3), (9,)]


def test_unhashed_partial_tail_loads_and_is_unique(tmp_path):
    # Only whole 512-token blocks are hashed: 1100 tokens -> 2 ids, the 76-token tail unhashed.
    path = write(tmp_path / "t.jsonl", [row(0, 1100, [0, 1]), row(10, 1100, [0, 1])])
    w = trace_workload(TraceConfig(path, block_size=512))
    a, b = w.requests
    assert len(a.block_ids) == len(b.block_ids) == 3  # two hashed blocks + the tail
    assert a.block_ids[:2] == b.block_ids[:2] and a.block_ids[2] != b.block_ids[2]
    ta, tb = prompt_tokens(a, 512)[:1100], prompt_tokens(b, 512)[:1100]
    assert (ta[:1024] == tb[:1024]).all() and not (ta[1024:] == tb[1024:]).any()
    synth = TokenSynth(512)
    pa, pb = (synth.prompt(r) for r in load_trace(path, block_size=512))
    assert len(pa) == 1100 and (pa[:1024] == pb[:1024]).all() and (pa[1024:] != pb[1024:]).any()


def test_block_size_read_given_or_refused(tmp_path):
    own = write(tmp_path / "own.jsonl", [row(0, 130, [0, 1, 2], block_size=64)])
    assert read_trace(own)[1] == 64
    with pytest.raises(TraceError, match="block_size' is 64, but 512 was given"):
        read_trace(own, block_size=512)
    ambiguous = write(tmp_path / "amb.jsonl", [row(0, 600, [0, 1])])  # 512 (ceil) or 256
    with pytest.raises(TraceError, match="cannot infer the block size.*pass --block-size"):
        read_trace(ambiguous)
    assert read_trace(ambiguous, block_size=256)[1] == 256
    mixed = write(
        tmp_path / "mix.jsonl",
        [row(0, 130, [0, 1, 2], block_size=64), row(1, 5, [3], block_size=32)],
    )
    with pytest.raises(TraceError, match="differs between lines"):
        read_trace(mixed)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"line 2: not valid JSON"),
        ("[1, 2]", r"line 2: expected a JSON object"),
        (json.dumps({"input_length": 5, "output_length": 1, "hash_ids": [1]}), "'timestamp'"),
        (json.dumps(row(1, True, [1])), r"line 2: field 'input_length': expected an int"),
        (json.dumps(row(1, 5, [1], out=-1)), r"line 2: field 'output_length'"),
        (json.dumps(row(float("nan"), 5, [1])), r"line 2: field 'timestamp'"),
        (json.dumps(row("12", 5, [1])), r"line 2: field 'timestamp'"),
        (json.dumps(row(1, 5, "1,2")), r"line 2: field 'hash_ids': expected a list"),
        (json.dumps(row(1, 5, [1, -3])), r"line 2: field 'hash_ids'\[1\]"),
        (json.dumps(row(1, 5, [1], session_id=[1])), r"line 2: field 'session_id'"),
        (json.dumps(row(1, 1100, [1])), r"line 2: field 'hash_ids': 1 ids for input_length 1100"),
    ],
)
def test_malformed_lines_name_line_and_field(tmp_path, line, message):
    path = write(tmp_path / "bad.jsonl", [row(0, 1100, [0, 1, 2]), line])
    with pytest.raises(TraceError, match=message):
        read_trace(path, block_size=512)


def test_blank_lines_are_skipped_and_line_numbers_stay_true(tmp_path):
    path = write(tmp_path / "t.jsonl", [row(0, 600, [0, 1]), "", "  ", row(1, 5, [7, 8])])
    with pytest.raises(TraceError, match="line 4: field 'hash_ids'"):
        read_trace(path, block_size=512)


def test_closed_sessions_chain_turns_with_the_trace_gaps(tmp_path):
    rows = [
        row(0, 600, [0, 1], session_id="s"),
        row(500, 700, [5], session_id="other"),
        row(3000, 1100, [0, 1, 2], session_id="s"),
        row(4000, 1200, [0, 1, 3], session_id="s"),
    ]
    path = write(tmp_path / "t.jsonl", rows)
    w = trace_workload(TraceConfig(path, block_size=512, sessions="closed", time_scale=2.0))
    by_rid = {r.rid: r for r in w.requests}
    assert [by_rid[i].after for i in range(4)] == [-1, -1, 0, 2]
    assert by_rid[2].delay_s == pytest.approx(6.0) and by_rid[3].delay_s == pytest.approx(2.0)
    assert by_rid[1].arrival_s == pytest.approx(1.0)  # open requests keep the scaled timestamp


def test_poisson_redraw_keeps_order_and_rate(tmp_path):
    rows = [row(1000 * i, 600, [2 * i, 2 * i + 1]) for i in range(400)]
    path = write(tmp_path / "t.jsonl", rows)
    w = trace_workload(TraceConfig(path, block_size=512, poisson=True, rate=4.0, seed=3))
    arrivals = [r.arrival_s for r in sorted(w.requests, key=lambda r: r.rid)]
    assert (np.diff(arrivals) >= 0).all()
    gaps = np.diff(arrivals)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.15)  # exponential: CV 1
    assert w.offered_rate == pytest.approx(4.0, rel=1e-6)


def test_cli_replays_a_users_trace_and_reports_bad_lines(tmp_path, capsys):
    good = write(tmp_path / "mine.jsonl.xz", ROWS, lzma.open)
    args = ["--trace", str(good), "--time-scale", "1", "--systems", "router", "--seeds", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    runs = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert len(runs) == 1 and runs[0]["finished"] == runs[0]["total"] == 3
    bad = write(tmp_path / "bad.jsonl", [row(0, 1100, [0, 1, 2]), row(1, 5, [1], out=True)])
    assert main(["--trace", str(bad), "--time-scale", "1", "--systems", "router"]) == 2
    assert "bad.jsonl line 2: field 'output_length'" in capsys.readouterr().err


def test_cli_horizon_stops_runs_and_is_validated(tmp_path, capsys):
    good = write(tmp_path / "mine.jsonl", ROWS)
    args = ["--trace", str(good), "--time-scale", "1", "--systems", "router", "--seeds", "1"]

    def runs(extra):
        assert main(args + extra) == 0
        return [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]

    # a horizon too short for the last request (arrives at 2.5 s): stopped at the horizon
    (short,) = runs(["--horizon", "0.001"])
    assert short["stop"] == "horizon" and short["stalled"] > 0
    (long,) = runs(["--horizon", "20000"])
    assert long["stop"] == "done" and long["finished"] == 3
    for bad in ("0", "-5"):
        with pytest.raises(SystemExit):
            main(args + ["--horizon", bad])
        assert f"--horizon: expected > 0, got {float(bad)}" in capsys.readouterr().err
