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
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("uvloop", reason="SGLang's server dependencies are not installed")
real_servers = pytest.importorskip("real_servers")

from tokenlake.engines.model.tiny import write_tiny_random  # noqa: E402

LOGPROB_TOL = 1e-4  # float32 on CPU; measured differences are ~1e-6
HOST_CONFIG = {"num_instances": 2, "num_slots": 32, "segment_len": 16, "max_forward_rows": 1024}
WORKER_TOKENS = 1024  # each worker's --max-total-tokens


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
        workers = [
            real_servers.start_sglang(
                model,
                tmp,
                "tokenlake",
                "--tokenlake-config",
                str(host.worker_config(tmp / f"worker{i}.json", i)),
                max_total_tokens=WORKER_TOKENS,
                wait=False,
            )  # fmt: skip
            for i in range(2)
        ]
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
