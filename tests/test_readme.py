"""Every command the README and docs/*.md show is run here with tiny arguments, or names the
test that runs it, or says why it cannot run on this machine. The one table below must list
exactly the commands those pages show: a page edit without a matching table edit fails
:func:`test_table_matches_readme_and_docs`. The README's API example and the metrics example of
docs/serving.md are run too. Links are checked by ``tests/test_docs.py``.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from readme_commands import COMMANDS, Covered, Served, Tiny

from tokenlake.benchmarks.workloads.traces import CONVERSATION_TRACE, SYNTHETIC_TRACE

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
SERVING = ROOT / "docs" / "serving.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent


def readme_commands(text: str) -> list[str]:
    """Commands of the README's ```bash blocks: comments dropped, continuations joined."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", "", block)
        for line in joined.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(re.sub(r"\s+", " ", line))
    return out


def shown_commands() -> dict[str, list[str]]:
    """Each command of the README's and the docs' bash blocks -> the pages that show it."""
    shown: dict[str, list[str]] = {}
    for page in PAGES:
        for command in readme_commands(page.read_text()):
            shown.setdefault(command, []).append(page.name)
    return shown


def test_table_matches_readme_and_docs():
    shown = shown_commands()
    twice = {c: pages for c, pages in shown.items() if len(pages) != len(set(pages))}
    assert not twice, f"a page shows a command twice: {twice}"
    missing = {c: pages for c, pages in shown.items() if c not in COMMANDS}
    stale = [c for c in COMMANDS if c not in shown]
    assert not missing, f"commands shown without a test entry here: {missing}"
    assert not stale, f"entries for commands no page shows any more: {stale}"


def test_table_check_sees_docs_commands():
    """The docs' commands are part of the check: one only a doc shows is found."""
    shown = shown_commands()
    assert "serving.md" in shown["curl http://127.0.0.1:8000/metrics"]
    assert "goodput.md" in shown[".venv/bin/tokenlake bench sim-crosscheck"]
    assert shown["make demo"] == ["README.md"]


def test_covering_tests_exist():
    for how in COMMANDS.values():
        if isinstance(how, Covered):
            path, name = how.test.split("::")
            assert f"def {name}(" in (ROOT / path).read_text(), how.test


def _tiny_trace(path: Path) -> None:
    rows = []
    for i in range(10):  # five two-turn sessions over a shared 2-block document
        n = 1100 + 300 * (i % 2)
        ids = [7, 8, 100 + i // 2, 200 + i][: -(-n // 512)]
        rows.append({"timestamp": 400 * i, "input_length": n, "output_length": 6,
                     "hash_ids": ids, "session_id": i // 2})  # fmt: skip
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _argv(command: str, extra: str = "") -> list[str]:
    env_b = "router,router-tbt,router-tbt-cascade,mooncake-1p3d,mooncake-3p1d"  # docs' $B
    env_t = "tokenlake,tokenlake-no-groups"  # docs' $T
    command = command.replace("$B", env_b).replace("$T", env_t)
    argv = shlex.split(command) + shlex.split(extra)
    if argv[0].startswith(".venv/bin/"):
        argv[0] = str(BIN / argv[0].removeprefix(".venv/bin/"))
    return argv


TINY = [c for c, how in COMMANDS.items() if isinstance(how, Tiny)]


@pytest.mark.parametrize("command", TINY, ids=[c[:60] for c in TINY])
def test_readme_command_runs(command, tmp_path):
    how = COMMANDS[command]
    for workload, trace in (("conversation", CONVERSATION_TRACE), ("synthetic", SYNTHETIC_TRACE)):
        if f"--workload {workload}" in command and not trace.exists():
            pytest.skip(f"needs the full {workload} trace {trace} (../shared, not in a clone)")
    _tiny_trace(tmp_path / "my_trace.jsonl.gz")
    if command.startswith("echo "):  # a shell line: run it in a shell
        done = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0 and json.loads((tmp_path / "tokenlake.json").read_text())
        return
    done = subprocess.run(
        _argv(command, how.extra), cwd=tmp_path, capture_output=True, text=True,
        timeout=how.timeout_s,
    )  # fmt: skip
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), "printed nothing"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_serving_commands(tmp_path):
    pytest.importorskip("fastapi")
    port = _free_port()
    serve = next(c for c, how in COMMANDS.items() if isinstance(how, Served) and "serve" in c)
    tiny = f"--num-slots 64 --segment-len 16 --no-profile --torch-threads 1 --port {port}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        _argv(serve, tiny), cwd=tmp_path, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while True:
            probe = subprocess.run(
                ["curl", "-sf", f"http://127.0.0.1:{port}/health"], capture_output=True
            )
            if probe.returncode == 0:
                break
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        for command in (c for c, how in COMMANDS.items() if isinstance(how, Served)):
            if not command.startswith("curl"):
                continue
            argv = _argv(command.replace(":8000", f":{port}"))
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            if "completions" in command:
                assert json.loads(done.stdout)["usage"]["completion_tokens"] == 16
            else:
                assert "tokenlake:pool_hit_tokens_total" in done.stdout
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_readme_api_example_runs(capsys):
    """The README's API example as shown: the second turn reuses the first one's 100 tokens
    (six sealed 16-token segments and the 4-token partial tail), and the pool counts them."""
    code = re.search(r"```python\n(import tokenlake as tl\n.*?)```", README.read_text(), re.S)[1]
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    printed = capsys.readouterr().out.splitlines()
    assert printed[:2] == ["req-0 reused 0 tokens", "req-1 reused 100 tokens"]
    stats = scope["pool"].get_stats()
    assert float(printed[2]) == pytest.approx(100 / (100 + 130)) == stats["hit_rate"]
    assert stats["num_hit_tokens"] == 100


def test_serving_metrics_example_runs():
    """The plain-Python exporter of docs/serving.md (port 0 instead of 9400), scraped."""
    pytest.importorskip("prometheus_client")
    import urllib.request

    import tokenlake as tl
    from tokenlake.engines.clusters.local import LocalCluster

    code = re.search(r"```python\n(from prometheus_client.*?)```", SERVING.read_text(), re.S)[1]
    code = code.replace("start_http_server(9400", "server, _ = start_http_server(0")
    shape = tl.ModelShape(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8)
    pool = tl.Pool(tl.PoolConfig(shape, num_instances=2, num_slots=16, segment_len=4))
    scope = {"pool": pool, "cluster": LocalCluster(pool.config)}
    exec(compile(code, "docs/serving.md", "exec"), scope)
    server = scope["server"]
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        text = urllib.request.urlopen(url, timeout=30).read().decode()
    finally:
        server.shutdown()
    assert "tokenlake:pool_segments 0.0" in text
    assert "tokenlake:engine_latency_seconds" in text


def test_ci_runs_the_readme_test_command():
    """CI (``.ci/run``) runs exactly the README's test command, which runs ruff and pytest."""
    ci = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ci[-1] == "make test" and "make test" in readme_commands(README.read_text())
    recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)[1]
    assert "ruff check" in recipe and "ruff format --check" in recipe and "pytest" in recipe
