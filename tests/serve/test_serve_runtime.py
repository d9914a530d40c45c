"""The runtime without HTTP: the multi-process data plane, scheduler cancellation, the
command line's --help and its refusals."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

import tokenlake as tl
from tokenlake.scheduler import Coeffs, ElasticScheduler, LatencyModel, SchedulerConfig
from tokenlake.serve.build import build
from tokenlake.serve.config import ServeConfig
from tokenlake.serve.request import GenerationRequest


def run_requests(runtime, requests, timeout_s=60.0):
    done, events = threading.Event(), {r.request_id: [] for r in requests}
    left = {r.request_id for r in requests}
    lock = threading.Lock()

    def sink(event):
        with lock:
            events[event.request_id].append(event)
            if event.finish_reason:
                left.discard(event.request_id)
                if not left:
                    done.set()

    for r in requests:
        runtime.submit(r, sink)
    assert done.wait(timeout_s)
    return {rid: [e.token_id for e in evs if e.token_id is not None] for rid, evs in events.items()}


@pytest.mark.slow
def test_mp_and_compute_data_planes_give_the_local_tokens():
    """The same greedy tokens whether one process computes (local, mp) or each instance
    computes in a process of its own (compute), where an iteration's batches run in
    parallel, one per instance, at DoP 1."""
    outputs = []
    for plane in ("local", "mp", "compute"):
        config = ServeConfig(
            num_instances=2, segment_len=8, num_slots=64, chunk_len=16, max_model_len=256,
            data_plane=plane, profile=plane == "mp", torch_threads=1,
        )  # fmt: skip
        served = build(config)
        try:
            reqs = [
                GenerationRequest(f"r{i}", tuple(range(1 + i, 30 + 3 * i)), 6, ignore_eos=True)
                for i in range(4)
            ]
            outputs.append(run_requests(served.runtime, reqs))
            assert served.runtime.scheduler.pool.get_stats()["num_running_requests"] == 0
            sched = served.runtime.scheduler.config
            if plane == "compute":
                assert sched.parallel_instances == 2 and sched.max_prefill_dop == 1
                assert len(served.runtime.engine.compute.pids) == 2
            else:
                assert sched.parallel_instances == 1
        finally:
            served.runtime.close()
    assert outputs[0] == outputs[1] == outputs[2]
    assert all(len(v) == 6 for v in outputs[0].values())


def test_scheduler_cancel_releases_pins():
    shape = tl.ModelShape(1, 2, 1, 8)
    pool = tl.Pool(tl.PoolConfig(shape, 1, 16, 4))
    latency = LatencyModel({1: Coeffs(1e-3, 1e-5, 0.0)}, Coeffs(1e-3, 1e-5, 0.0))
    sched = ElasticScheduler(SchedulerConfig(1, 4, chunk_len=4), latency, pool)
    prompt = np.arange(10, dtype=np.int32)
    sched.add_request("a", prompt, 3)
    sched.add_request("b", prompt + 1, 3)
    sched.cancel("b")  # still waiting: just leaves the queue
    it = sched.step()
    with pytest.raises(tl.InvalidArgumentError, match="in flight"):
        sched.cancel("a")
    sched.complete(it, {"a": 1})
    assert "a" in pool.requests
    sched.cancel("a")
    assert not pool.requests and not sched.has_work
    pool.check_invariants()
    with pytest.raises(tl.UnknownRequestError):
        sched.cancel("a")


def test_runtime_refuses_bad_requests_before_queueing():
    served = build(ServeConfig(num_instances=1, num_slots=32, max_model_len=64, profile=False))
    try:
        rt = served.runtime
        for req, words in [
            (GenerationRequest("x", (), 4), "at least one token"),
            (GenerationRequest("x", (1, 2), 0), "max_tokens"),
            (GenerationRequest("x", (1,) * 60, 5), "maximum context length is 64"),
            (GenerationRequest("x", (1, 10**6), 2), "token ids"),
        ]:
            with pytest.raises(tl.InvalidArgumentError, match=words):
                rt.submit(req, lambda e: None)
        assert rt.num_waiting == 0
    finally:
        served.runtime.close()


def cli(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "tokenlake.serve", *args], capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def test_cli_help_and_refusals(tmp_path):
    out = cli("--help")
    assert out.returncode == 0
    for flag in ("--model", "--num-instances", "--segment-len", "--max-model-len", "--host",
                 "--port", "--data-plane", "--dtype", "tiny-random", "/v1/chat/completions"):  # fmt: skip
        assert flag in out.stdout
    bad = cli("--model", str(tmp_path / "missing"), "--no-profile")
    assert bad.returncode == 2 and "not a checkpoint directory" in bad.stderr
    bad = cli("--chunk-len", "100", "--segment-len", "32")
    assert bad.returncode == 2 and "chunk_len" in bad.stderr
