"""Helpers of the Ray launch tests: waiting for processes and conditions, one completion
request, the ``tokenlake.serve.ray.cli`` command line, and what a launch leaves on the machine
(its shared memory and secret directories, its processes), found by its own launch id or pid
so that other runs on the machine are never counted."""

from __future__ import annotations

import glob
import os
import sys
import time
from pathlib import Path

from process_helpers import descendants, gone  # noqa: F401 (the ray tests import them here)

from tokenlake.serve.ray import buffers as ray_buffers

C = 16  # segment length of every launch here
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.2)


def complete(url: str, prompt, n: int) -> dict:
    import httpx  # a test dependency: the modules importing this skip without it

    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def launch_command(name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tokenlake.serve.ray.cli", "--name", name, "--instances", "1",
            "--cpus-per-instance", "0.5", "--segment-len", str(C), "--num-slots", "64",
            "--chunk-len", "64", "--no-profile", "--port", "0", "--host", "127.0.0.1",
            *extra]  # fmt: skip


def launch_files(launch_id: str) -> list[str]:
    """A launch's shared memory and secret directories still on this machine."""
    return glob.glob(f"{ray_buffers.SHM_DIR}/{ray_buffers.PREFIX}{launch_id}-*") + glob.glob(
        str(Path(ray_buffers.secret_root()) / f"{ray_buffers.PREFIX}{launch_id}-*")
    )
