"""Harness fixes: hit rate and CV at each system's own goodput, a run cut by the wall budget
never a failure, session traces closed-loop by default, session generators with a set number
of sessions, and ``--jobs`` workers ending with their parent."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tokenlake.benchmarks.goodput.harness import main, make_workload, parse_args
from tokenlake.benchmarks.goodput.runs import RunKey, simulate_key
from tokenlake.benchmarks.sim.step_timer import ClusterSpec
from tokenlake.benchmarks.workloads import GeneratorConfig, TraceConfig, trace_workload
from tokenlake.benchmarks.workloads.generators import agentic

TINY = ["--workload", "sharegpt", "--requests", "30", "--seeds", "1", "--max-evals", "1"]


def _runs(out: str) -> list[dict]:
    return [json.loads(x) for x in out.splitlines() if x.startswith("{") and '"stop"' in x]


def test_hit_rate_and_cv_are_at_each_systems_own_goodput(tmp_path, capsys):
    args = TINY + ["--systems", "tokenlake,router", "--prefill-tokens", "2048"]
    args += ["--router-balance", "64:1.5", "--goodput", "--lo", "4", "--hi", "8"]
    assert main(args + ["--out", str(tmp_path)]) == 0
    runs = _runs(capsys.readouterr().out)
    summary = json.loads((tmp_path / "summary.json").read_text())
    goodputs = {s: r["p90_goodput"] for s, r in summary["systems"].items()}
    assert goodputs["tokenlake"] != goodputs["router"]  # else the test shows nothing
    for system, row in summary["systems"].items():
        assert row["rates"] == [row["p90_goodput"]]
        at_own = [
            r for r in runs if r["system"] == system and abs(r["rate"] - row["p90_goodput"]) < 1e-3
        ]
        assert at_own and row["hit_rate"] == at_own[-1]["hit_rate"]
        assert row["load_cv"] == at_own[-1]["load_cv"]


def test_a_run_cut_by_the_wall_budget_is_rerun_then_unresolved(tmp_path, capsys):
    args = parse_args(TINY + ["--systems", "router", "--wall-budget", "1e-9"])
    args.wall_retries = 1
    res = simulate_key(args, make_workload, RunKey("router", 4.0, 0, 2048, ClusterSpec()))
    assert res.stop_reason == "wall_budget" and res.extra["wall_retries"] == 1
    argv = TINY + ["--systems", "router", "--baseline-prefill-tokens", "2048", "--goodput"]
    argv += ["--wall-budget", "1e-9", "--wall-retries", "0", "--out", str(tmp_path)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "unresolved" in summary["systems"]["router"]  # no goodput, not a goodput of 0
    assert "p90_goodput" not in summary["systems"]["router"] and "unresolved" in err


def _trace(path: Path, with_sessions: bool) -> Path:
    with gzip.open(path, "wt") as f:
        for i in range(12):
            row = {
                "timestamp": i * 100,
                "input_length": 600 + 10 * i,
                "output_length": 4,
                "block_size": 512,
            }
            row["hash_ids"] = [i % 3, 100 + i]
            if with_sessions:
                row["session_id"] = f"s{i % 3}"
            f.write(json.dumps(row) + "\n")
    return path


def test_a_session_trace_is_closed_loop_by_default(tmp_path):
    for with_sessions in (True, False):
        path = _trace(tmp_path / f"t{with_sessions}.jsonl.gz", with_sessions)
        args = parse_args(["--trace", str(path)])
        assert args.sessions == "auto"
        w = trace_workload(TraceConfig(path, sessions=args.sessions))
        chained = [r for r in w.requests if r.after >= 0]
        if with_sessions:  # every turn but each session's first waits for the previous one
            assert len(chained) == 12 - 3 and "sessions closed" in w.note
            by_rid = {r.rid: r for r in w.requests}
            assert all(by_rid[r.after].session == r.session for r in chained)
        else:
            assert not chained and "sessions open" in w.note


def test_num_sessions_sets_how_many_sessions_a_generator_sends():
    w = agentic(GeneratorConfig(200, 1.0, num_sessions=50, seed=3))
    sessions: dict[int, list] = {}
    for r in w.requests:
        sessions.setdefault(r.session, []).append(r)
    assert len(sessions) == 50
    assert all(1 <= len(turns) <= 4 for turns in sessions.values())
    for turns in sessions.values():
        turns.sort(key=lambda r: r.rid)
        assert turns[0].after == -1 and all(
            b.after == a.rid for a, b in zip(turns, turns[1:], strict=False)
        )
        assert all(b.input_len > a.input_len for a, b in zip(turns, turns[1:], strict=False))
    # whole sessions (the default) give far fewer sessions for as many requests
    assert len({r.session for r in agentic(GeneratorConfig(200, 1.0, seed=3)).requests}) < 20


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_ends_the_jobs_workers(tmp_path):
    cmd = [sys.executable, "-m", "tokenlake.benchmarks.goodput.harness", "--workload", "sharegpt"]
    cmd += ["--requests", "4000", "--systems", "tokenlake,router", "--prefill-tokens", "2048"]
    cmd += ["--seeds", "1", "--goodput", "--jobs", "2", "--lo", "1", "--hi", "2"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        workers: list[int] = []
        for _ in range(600):  # up to 60 s for the pool to start its workers
            workers = [
                c
                for c in _children(proc.pid)
                if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()
            ]
            if len(workers) == 2 or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert len(workers) == 2, "the workers never started"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) != 0
        for _ in range(300):  # their end within 30 s
            if not any(_alive(w) for w in workers):
                break
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_new_options_are_checked():
    import pytest

    for bad in (
        ["--router-balance", "x"],
        ["--router-balance", "8:0.5"],
        ["--num-sessions", "5"],  # not a session workload
        ["--workload", "agentic", "--num-sessions", "-1"],
        ["--wall-budget", "0"],
        ["--systems", "router-nope"],
        ["--page-groups", "maybe"],
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)
    a = parse_args([])
    assert a.baseline_prefill_tokens == [256, 512, 1024, 2048, 4096, 8192]
    assert parse_args(["--prefill-tokens", "1024"]).baseline_prefill_tokens == [1024]
    assert isinstance(a, argparse.Namespace) and a.page_groups == "on"
