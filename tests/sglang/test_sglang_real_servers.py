"""SGLang's real server (``python -m sglang.launch_server``) with ``--attention-backend
tokenlake``, as a user runs it: one ``tokenlake sglang-host`` and two servers joined to it by
their ``--tokenlake-config`` (radix cache on), against a real SGLang server with
``--attention-backend torch_native`` on the same prompts, over HTTP.

One host, two workers and the reference are started once for the module (CPU: see
``cpu_support``). After every phase SGLang's own idle check has run (it dies on ``pool memory
leak detected``) and the pool's own invariants hold (``Pool.check_invariants`` on the host).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("uvloop", reason="SGLang's server dependencies are not installed")
real_servers = pytest.importorskip("real_servers")

from tokenlake.engines.model.tiny import write_tiny_random  # noqa: E402

LOGPROB_TOL = 1e-4  # float32 on CPU; measured differences are ~1e-6
HOST_CONFIG = {"num_instances": 2, "num_slots": 32, "segment_len": 16, "max_forward_rows": 1024}
WORKER_TOKENS = 512  # each worker's --max-total-tokens: small, so SGLang evicts and queues
# SGLang admits requests conservatively, so a small KV cache alone rarely retracts; its own
# test switch retracts running decodes every few forwards (they are recomputed later)
WORKER_ENV = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "5"}


def tokens(seed: int, n: int) -> list[int]:
    """``n`` token ids of the tiny model's byte alphabet (ids 6..261), seeded."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(6, 262) for _ in range(n)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real")
    model = write_tiny_random(tmp / "tiny", seed=0)
    started = []
    try:
        host = real_servers.start_host(model, tmp, HOST_CONFIG)
        started.append(host.process)
        workers = [start_worker(tmp, model, host, i, wait=False) for i in range(2)]
        reference = real_servers.start_sglang(model, tmp, "torch_native", wait=False,
                                              max_total_tokens=4096)  # fmt: skip
        started += [s.process for s in (*workers, reference)]
        for server in (*workers, reference):
            server.wait_ready()
        yield type("World", (), dict(tmp=tmp, model=model, host=host, workers=workers,
                                     reference=reference, started=started))  # fmt: skip
    finally:
        for process in reversed(started):
            process.stop()


def start_worker(tmp, model, host, instance: int, wait: bool = True, **kwargs):
    config = host.worker_config(tmp / f"worker{instance}.json", instance)
    env = real_servers.cpu_env(**WORKER_ENV)
    return real_servers.start_sglang(model, tmp, "tokenlake", "--tokenlake-config", str(config),
                                     max_total_tokens=WORKER_TOKENS, env=env, wait=wait,
                                     **kwargs)  # fmt: skip


def settle(world) -> dict:
    """Every worker idle with SGLang's idle check passed; the pool's invariants hold and
    every used slot is a segment's replica (nothing runs or pins)."""
    for worker in world.workers:
        worker.wait_idle()
    check = world.host.call("check")
    assert check["running"] == check["in_flight"] == 0, check
    assert check["replicas"] == sum(check["slots_used"]), check
    return check


def same_as_reference(world, replies: list[dict], prompts: list[list[int]], n: int) -> float:
    """Greedy outputs equal the reference's; returns the largest logprob difference."""
    worst = 0.0
    with ThreadPoolExecutor(4) as pool:
        refs = list(pool.map(lambda p: world.reference.generate(p, n), prompts))
    for got, ref in zip(replies, refs, strict=True):
        assert got["output_ids"] == ref["output_ids"]
        for (a, *_), (b, *_) in zip(got["meta_info"]["output_token_logprobs"],
                                    ref["meta_info"]["output_token_logprobs"], strict=True):  # fmt: skip
            worst = max(worst, abs(a - b))
    assert worst <= LOGPROB_TOL
    return worst


def test_prefixes_shared_across_servers_are_exact_and_hit_across_workers(world) -> None:
    w0, w1 = world.workers
    docs = [tokens(d, 70 + 9 * d) for d in range(3)]
    prompts, replies = [], []
    # one server computes a document; the other reuses it from the pool (its own radix
    # tree never saw it), then both at once on documents each half knows
    for d, doc in enumerate(docs):
        first, second = (w0, w1) if d % 2 == 0 else (w1, w0)
        for server, question in ((first, tokens(100 + d, 5)), (second, tokens(200 + d, 7))):
            prompts.append(doc + question)
            replies.append(server.generate(prompts[-1], 8))
    loaded = [r["meta_info"]["cached_tokens"] for r in replies[1::2]]
    assert all(n >= 64 for n in loaded), loaded  # the second server reused the document
    settle(world)
    mixed = [docs[i % 3] + tokens(300 + i, 3 + i % 4) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        replies += list(pool.map(lambda i: world.workers[i % 2].generate(mixed[i], 6), range(8)))
    prompts += mixed
    worst = same_as_reference(world, replies[:6], prompts[:6], 8)
    worst = max(worst, same_as_reference(world, replies[6:], prompts[6:], 6))
    check = settle(world)
    metrics = world.host.metrics()
    cross = metrics["tokenlake:sglang_cross_worker_hit_tokens_total"]
    assert cross > 0
    print(json.dumps({"test": "real_servers_exactness", "requests": len(prompts),
                      "max_logprob_diff": worst, "cross_worker_hit_tokens": cross,
                      "pool_hit_tokens": metrics["tokenlake:pool_hit_tokens_total"],
                      "slots_used": check["slots_used"]}))  # fmt: skip


@pytest.mark.slow
def test_soak_of_reuse_aborts_disconnects_and_retractions_accounts_for_every_page(world):
    """300 short requests over both servers: prefixes reused across them, requests aborted
    by id and by a client that goes away, decodes retracted under KV pressure. Every
    completed one equals the reference; at the end SGLang's idle check passes on both and
    the pool's invariants hold with every used slot a segment's replica."""
    docs = [tokens(50 + d, 40 + 11 * d) for d in range(5)]
    num_requests, done, outcome = 300, {}, Counter()
    lock = threading.Lock()

    def one(i: int) -> None:
        server = world.workers[i % 2]
        prompt = docs[i % 5] + tokens(1000 + i, 2 + i % 5)
        sampling = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
        if i % 10 == 3:  # a client that goes away mid-stream
            body = json.dumps({"input_ids": prompt, "stream": True, "sampling_params": sampling})
            request = urllib.request.Request(server.url + "/generate", body.encode(),
                                             {"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(request, timeout=120) as reply:
                reply.readline()
            with lock:
                outcome["disconnected"] += 1
        elif i % 10 == 7:  # aborted by id
            rid = f"soak-{i}"
            body = {"rid": rid, "input_ids": prompt, "sampling_params": sampling}
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(server.post, "/generate", body)
                time.sleep(0.05)
                server.post("/abort_request", {"rid": rid})
                reply = pending.result()
            with lock:
                outcome[reply["meta_info"]["finish_reason"]["type"]] += 1
        else:
            n = 4 + (i % 4) * 12
            done[i] = (prompt, n, server.generate(prompt, n))

    start = time.monotonic()
    with ThreadPoolExecutor(12) as pool:
        list(pool.map(one, range(num_requests)))
    elapsed = time.monotonic() - start
    check = settle(world)
    retractions = sum(r["meta_info"]["num_retractions"] for _, _, r in done.values())
    worst = 0.0
    for n in sorted({n for _, n, _ in done.values()}):
        same = [v for v in done.values() if v[1] == n]
        replies, prompts = [r for *_, r in same], [p for p, *_ in same]
        worst = max(worst, same_as_reference(world, replies, prompts, n))
    metrics = world.host.metrics()
    print(json.dumps({"test": "real_servers_soak", "requests": num_requests,
                      "completed": len(done), **outcome, "retractions": retractions,
                      "seconds": round(elapsed, 1), "max_logprob_diff": worst,
                      "cross_worker_hit_tokens":
                          metrics["tokenlake:sglang_cross_worker_hit_tokens_total"],
                      **check}))  # fmt: skip
    assert outcome["disconnected"] == 30 and retractions > 0


def test_a_killed_worker_rejoins_and_a_live_instance_is_refused_by_name(world) -> None:
    """Worker 1 is killed (SIGKILL, its whole process group): the host drops its instance,
    worker 0 goes on. A server given instance 0 (live) is refused, naming it; one with
    SGLang's default dtype is refused, naming the flag; then a worker joins instance 1
    again without restarting the host or worker 0, and serves exactly, reusing worker 0's
    prefixes."""
    tmp, host = world.tmp, world.host
    world.workers[1].process.stop(signal.SIGKILL)
    real_servers.wait_until(lambda: host.call("stats")["lost"] == [1], 60, "instance 1 dropped")
    doc = tokens(900, 60)
    prompts = [doc + tokens(901, 3), doc + tokens(902, 4)]
    first = world.workers[0].generate(prompts[0], 6)  # worker 0 goes on
    live = start_worker(tmp, world.model, host, 0, wait=False)
    default_dtype = start_worker(tmp, world.model, host, 1, wait=False,
                                 flags=("--device", "cpu", "--max-total-tokens"))  # fmt: skip
    world.started += [live.process, default_dtype.process]
    for server, message in ((live, "instance: 0 is held by a live worker"),
                            (default_dtype, "start SGLang with --dtype float32")):  # fmt: skip
        real_servers.wait_for_line(server.process, message, real_servers.START_TIMEOUT_S)
        real_servers.wait_until(lambda s=server: not s.process.alive(), 120, "refused exits")
    start = time.monotonic()
    again = start_worker(tmp, world.model, host, 1)
    world.started.append(again.process)
    world.workers[1] = again
    ready_s = time.monotonic() - start
    second = again.generate(prompts[1], 6)
    assert second["meta_info"]["cached_tokens"] >= 48  # worker 0's segments, from the pool
    # and the other way: worker 0 reads what the new worker computed, on its new engines
    doc2 = tokens(903, 50)
    prompts += [doc2 + tokens(904, 2), doc2 + tokens(905, 3)]
    third = again.generate(prompts[2], 6)
    fourth = world.workers[0].generate(prompts[3], 6)
    assert fourth["meta_info"]["cached_tokens"] >= 48
    same_as_reference(world, [first, second, third, fourth], prompts, 6)
    check = settle(world)
    print(json.dumps({"test": "real_servers_rejoin", "host_rejoin_s": check["last_rejoin_s"],
                      "worker_start_to_ready_s": round(ready_s, 1)}))  # fmt: skip


def test_a_host_killed_with_sigkill_leaves_nothing_once_started_again(world) -> None:
    host = world.host
    for worker in world.workers:
        worker.process.stop()
    record = world.tmp / f"tokenlake-host-{host.port}.run.json"
    segments = json.loads(record.read_text())["segments"]
    assert segments and all(os.path.exists(f"/dev/shm/{s}") for s in segments)
    host.process.stop(signal.SIGKILL)
    assert all(os.path.exists(f"/dev/shm/{s}") for s in segments)  # what -9 leaves
    again = real_servers.start_host(world.model, world.tmp, HOST_CONFIG, port=host.port)
    try:
        left = [s for s in segments if os.path.exists(f"/dev/shm/{s}")]
        removed = f"removed {len(segments)} shared memory segments"
        assert left == [] and removed in again.process.log_text()
        mine = json.loads(record.read_text())["segments"]
    finally:
        again.process.stop()
    assert not any(os.path.exists(f"/dev/shm/{s}") for s in mine) and not record.exists()
    print(json.dumps({"test": "real_servers_host_kill9", "segments_left_by_kill9":
                      len(segments), "segments_left_after_restart": len(left)}))  # fmt: skip
