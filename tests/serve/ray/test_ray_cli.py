"""``tokenlake launch`` as a user first tries it: no ``--address`` (a Ray of its own, on
loopback without being told), in the foreground, stopped by Ctrl-C. Needs no test cluster,
so it has a module of its own; the launches on the test cluster are in test_ray_launch.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest
from ray_helpers import C, complete, descendants, gone, launch_command, launch_files, wait_until

pytest.importorskip("ray")
pytest.importorskip("httpx")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow


def test_cli_launch_serves_until_ctrl_c_then_removes_everything(reference):
    """``tokenlake launch`` as the README's first try: no ``--address`` (a local Ray of its
    own, on loopback without being told), in the foreground; serves, and Ctrl-C (SIGINT)
    ends it with exit code 0, no process of it (Ray's included) and no shared memory left.
    Started with SIGINT ignored, as a parent that ignores it (this test process, after some
    libraries ran) would hand down: Ctrl-C must work all the same."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}  # fmt: skip
    proc = subprocess.Popen(
        launch_command("tlint", "--log-level", "info"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    try:
        lines = []
        for line in proc.stdout:  # ends if the launch exits; start-up is bounded by itself
            lines.append(line)
            if "TokenLake serving" in line:
                break
        found = re.search(r"serving tiny-random at (http://127\.0\.0\.1:\d+)", "".join(lines))
        assert found, "".join(lines)[-3000:]
        (launch_id,) = set(re.findall(r"launch (\w+): serving at", "".join(lines)))  # the log
        assert launch_files(launch_id)
        started = descendants(proc.pid)
        assert started, "the local Ray's processes"
        prompt = list(range(70, 70 + 2 * C))
        assert complete(found.group(1), prompt, 6)["token_ids"] == reference(prompt, 6)
        proc.send_signal(signal.SIGINT)
        try:
            rest = proc.communicate(timeout=180)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            rest = proc.communicate()[0]
            raise AssertionError(f"no exit 180 s after Ctrl-C; its log:\n{rest[-3000:]}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, rest[-3000:]
    assert "interrupted; shutting down" in rest
    wait_until(lambda: all(gone(p) for p in started), 60, "the launch's processes exit")
    assert not launch_files(launch_id)
