"""``tokenlake sglang-host`` as a separate process, and SGLang workers joining it knowing only
the three keys of their ``--tokenlake-config`` (endpoint, secret file, instance id): exact
against ``torch_native``, cross-worker hits on the host's ``/metrics``, one copy refused by
name for a worker whose KV pool is SGLang's own, and nothing left in shared memory after the
host stops."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import pytest

sgl_world = pytest.importorskip("sgl_world", reason="sglang is not installed")
mp_world = pytest.importorskip("mp_world")

from tokenlake.engines.model.tiny import write_tiny_random  # noqa: E402
from tokenlake.engines.sglang.config import SGLangPoolConfig  # noqa: E402
from tokenlake.engines.sglang.model_check import UnsupportedFeatureError  # noqa: E402

TOL = sgl_world.TOLERANCE
tokens = sgl_world.tokens
TINY = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, num_layers=4, seed=3)  # tiny-random


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("host")
    model = write_tiny_random(tmp / "tiny", seed=0)
    config = tmp / "tokenlake.json"
    config.write_text(json.dumps({"num_instances": 2, "num_slots": 40, "segment_len": 8,
                                  "max_forward_rows": 256}))  # fmt: skip
    secret, port, metrics = str(tmp / "secret"), _free_port(), _free_port()
    cmd = [sys.executable, "-m", "tokenlake.serve.sglang_host", "--model-path", str(model),
           "--config", str(config), "--port", str(port), "--secret-file", secret,
           "--one-copy", "--metrics-port", str(metrics)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line, deadline = "", time.monotonic() + 120
        while "ready" not in line and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
                assert line or proc.poll() is None, "the host exited"
        assert "ready" in line, "the host did not start"
        endpoint = f"tcp://127.0.0.1:{port}"
        assert endpoint in line
        ns = SimpleNamespace(proc=proc, endpoint=endpoint, secret=secret, metrics=metrics)
        ns.segments = _segments_of(ns)
        yield ns
    finally:
        if proc.poll() is None:  # SIGTERM first: the host removes its shared memory
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.wait(30)


def test_one_copy_host_refuses_a_worker_with_its_own_kv_pool(host) -> None:
    config = SGLangPoolConfig(control_endpoint=host.endpoint, secret_file=host.secret,
                              instance_id=0)  # fmt: skip
    runner = sgl_world.make_runner(**{k: v for k, v in TINY.items() if k != "seed"})
    from tokenlake.engines.sglang.backend import TokenLakeAttnBackend

    with pytest.raises(UnsupportedFeatureError, match=r"--one-copy.*SlotKVPool"):
        TokenLakeAttnBackend(runner, config)


def test_workers_join_a_host_process_by_config_keys(host) -> None:
    cluster = SimpleNamespace(secret_path=host.secret, layout=SimpleNamespace(num_instances=2))
    service = SimpleNamespace(endpoint=host.endpoint)
    w = mp_world.Workers(cluster, service, TINY, join=True)
    try:
        st = w.call(0, "kv_storage")
        assert st["same_storage"]  # one copy, over the host's named shared memory
        doc = tokens(21, 35)
        w.call(0, "add", rid="a", tokens=doc + tokens(22, 3))
        assert w.call(0, "step", work={"a": 38}) <= TOL
        n = w.call(1, "load_add", rid="b", tokens=doc + tokens(23, 9))
        assert n == 32  # a's sealed segments (its open tail is its own while it runs)
        assert w.call(1, "step", work={"b": 44 - n}) <= TOL  # the document read on worker 0
        assert w.call(1, "step", work={"b": 1}) <= TOL
        stats = w.call(1, "stats")
        assert stats["cross_worker_hit_tokens"] == 32  # whole segments, worker 0's
        assert max(w.call(i, "max_err") for i in range(2)) <= TOL
        text = urllib.request.urlopen(f"http://127.0.0.1:{host.metrics}/metrics", timeout=10)
        body = text.read().decode()
        assert "tokenlake:sglang_cross_worker_hit_tokens_total 32.0" in body
        assert "tokenlake:sglang_workers 2.0" in body
    finally:
        w.close()


def test_join_keys_and_the_dp_rank_as_instance() -> None:
    from sglang.srt.runtime_context import get_parallel

    from tokenlake.engines.sglang.backend import joining_instance
    from tokenlake.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="expected both"):
        SGLangPoolConfig(control_endpoint="tcp://127.0.0.1:7600")
    with pytest.raises(InvalidArgumentError, match="expected both"):
        SGLangPoolConfig(instance_id=1)
    with pytest.raises(InvalidArgumentError, match="control_endpoint: expected 'tcp://"):
        SGLangPoolConfig(control_endpoint="127.0.0.1:7600", secret_file="s", instance_id=0)
    with pytest.raises(InvalidArgumentError, match="instance_id: expected an int >= 0"):
        SGLangPoolConfig(control_endpoint="tcp://h:1", secret_file="s", instance_id=-1)
    shared = SGLangPoolConfig(control_endpoint="tcp://h:1", secret_file="s")
    assert joining_instance(SGLangPoolConfig(control_endpoint="tcp://h:1", secret_file="s",
                                             instance_id=3)) == 3  # fmt: skip
    with get_parallel().override(dp_rank=2):  # a --dp-size worker: its DP rank
        assert joining_instance(shared) == 2
    with pytest.raises(UnsupportedFeatureError, match="no data-parallel replica"):
        joining_instance(shared)


def test_host_stops_on_sigterm_and_leaves_no_shared_memory(host) -> None:
    segments = host.segments
    assert segments and all(os.path.exists(f"/dev/shm/{s}") for s in segments)
    host.proc.send_signal(signal.SIGTERM)
    assert host.proc.wait(60) == 0
    assert not any(os.path.exists(f"/dev/shm/{s}") for s in segments)


def _segments_of(host) -> list[str]:
    """The host's shared memory segments, from its ``attach`` answer."""
    import zmq

    from tokenlake.engines.sglang.shared_runtime import ControlClient
    from tokenlake.engines.transport.auth import ClusterSecret, FrameAuth

    ctx = zmq.Context()
    try:
        client = ControlClient(
            ctx, host.endpoint, FrameAuth(ClusterSecret.from_file(host.secret)), 10
        )
        info = client.call("attach", instance=0)
        client.close()
    finally:
        ctx.destroy(linger=0)
    return [name.lstrip("/") for b in info["buffers"] for name in b["names"].values()]
