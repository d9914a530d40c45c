"""No request can stop the runtime through sampling: temperatures down to the smallest float
sample as greedy would, extreme logits sample without inf / NaN, and a sampling error ends
only the request it happened in while the others finish as they would alone."""

from __future__ import annotations

import math
import threading

import pytest
import torch

import tokenlake as tl
from tokenlake.engines.clusters.local import LocalCluster
from tokenlake.engines.model.engine import ModelEngine
from tokenlake.engines.model.llama import LlamaModel
from tokenlake.engines.model.sampling import SamplingParams, sample
from tokenlake.engines.model.tiny import write_tiny_random
from tokenlake.scheduler import Coeffs, ElasticScheduler, LatencyModel, SchedulerConfig
from tokenlake.serve.build import build
from tokenlake.serve.config import ServeConfig
from tokenlake.serve.request import GenerationRequest
from tokenlake.serve.runtime import Runtime

TINY_TEMPERATURES = (1e-40, 5e-324, 1e-30, 1e-12, 1e-6, 2e-5, 1e-4)
SEGMENT_LEN = 8


def logits_with_clear_winner(seed: int, vocab: int = 1000) -> torch.Tensor:
    """Random float32 logits whose best entry leads the runner-up by at least 1."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g) * 5
    logits[int(torch.argmax(logits))] += 1.0
    return logits.to(torch.float32)


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_tiny_temperature_samples_the_argmax(temperature):
    """Reference: argmax. At T <= 1e-4 with a lead of 1 every other token has probability
    below exp(-1e4), so sampling (seeded with any seed) must give the argmax."""
    for seed in range(5):
        logits = logits_with_clear_winner(seed)
        expected = int(torch.argmax(logits))
        for top_k, top_p in ((0, 1.0), (50, 0.9)):
            params = SamplingParams(temperature, top_p, top_k, seed=seed)
            got = sample(logits, params, torch.Generator().manual_seed(seed))
            assert got == expected, (temperature, seed, top_k, top_p)


def test_extreme_logits_sample_a_finite_choice():
    """float32's largest logits at small and large temperatures: no inf / NaN reaches the
    draw; the top token wins when it leads by float32's range, and ties share the draws."""
    big = torch.finfo(torch.float32).max
    logits = torch.full((64,), -big, dtype=torch.float32)
    logits[7] = big
    for temperature in (1e-5, 0.5, 1.0, 100.0):
        params = SamplingParams(temperature)
        for seed in range(3):
            assert sample(logits, params, torch.Generator().manual_seed(seed)) == 7
    tied = torch.full((4,), big, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    draws = {sample(tied, SamplingParams(1e-5), g) for _ in range(200)}
    assert draws == {0, 1, 2, 3}


def test_sampling_follows_softmax_at_temperature_one():
    """Reference: softmax of [0, log 3] is [1/4, 3/4]; 4000 seeded draws within 4 sigma."""
    logits = torch.tensor([0.0, math.log(3.0)], dtype=torch.float32)
    g = torch.Generator().manual_seed(123)
    ones = sum(sample(logits, SamplingParams(1.0), g) for _ in range(4000))
    sigma = math.sqrt(4000 * 0.75 * 0.25)
    assert abs(ones - 3000) < 4 * sigma


def test_non_finite_logits_raise_when_sampling():
    logits = torch.tensor([0.0, float("nan"), 1.0])
    with pytest.raises(ValueError, match="inf or NaN"):
        sample(logits, SamplingParams(0.7), torch.Generator().manual_seed(0))


def run_requests(runtime, requests, timeout_s=60.0):
    """Submit ``requests``; returns ``{request_id: (tokens, finish_reason, error)}``."""
    done, lock = threading.Event(), threading.Lock()
    tokens = {r.request_id: [] for r in requests}
    ends: dict[str, tuple[str, str | None]] = {}

    def sink(event):
        with lock:
            if event.token_id is not None:
                tokens[event.request_id].append(event.token_id)
            if event.finish_reason:
                ends[event.request_id] = (event.finish_reason, event.error)
                if len(ends) == len(requests):
                    done.set()

    for r in requests:
        runtime.submit(r, sink)
    assert done.wait(timeout_s), f"unfinished: {set(tokens) - set(ends)}"
    return {rid: (tokens[rid], *ends[rid]) for rid in tokens}


def test_tiny_temperature_request_returns_greedy_tokens_and_runtime_lives():
    """The request that used to end the runtime loop: T=1e-40, 4 tokens. Reference: the same
    prompt at temperature 0 on the same runtime."""
    served = build(ServeConfig(num_instances=2, segment_len=8, num_slots=64, chunk_len=16,
                               max_model_len=128, profile=False, torch_threads=1))  # fmt: skip
    rt = served.runtime
    try:
        prompt = tuple(range(11, 30))
        tiny = GenerationRequest("tiny", prompt, 4, SamplingParams(1e-40), ignore_eos=True)
        got = run_requests(rt, [tiny])["tiny"]
        greedy = GenerationRequest("greedy", prompt, 4, SamplingParams(0.0), ignore_eos=True)
        want = run_requests(rt, [greedy])["greedy"]
        assert got == want and len(got[0]) == 4 and got[1] == "length"
        assert rt.alive
        assert rt.scheduler.pool.get_stats()["num_running_requests"] == 0
    finally:
        rt.close()


class FailingSampler:
    """The real sampler, except that it raises for requests seeded with ``bad_seed``."""

    def __init__(self, bad_seed: int) -> None:
        self.bad_seed = bad_seed
        self.num_failures = 0

    def __call__(self, logits, params, generator):
        if params.seed == self.bad_seed:
            self.num_failures += 1
            raise RuntimeError("injected sampling failure")
        return sample(logits, params, generator)


def make_runtime(tmp_path, sampler=sample) -> Runtime:
    """A 2-instance tiny-random runtime on the in-process data plane, with ``sampler``."""
    model = LlamaModel.from_dir(write_tiny_random(tmp_path / "tiny", seed=0))
    pool = tl.Pool(tl.PoolConfig(model.shape, 2, 64, SEGMENT_LEN))
    engine = ModelEngine(model, LocalCluster(pool))
    latency = LatencyModel({1: Coeffs(1e-3, 1e-5, 1e-9)}, Coeffs(1e-3, 1e-5, 0.0))
    scheduler = ElasticScheduler(SchedulerConfig(2, SEGMENT_LEN, chunk_len=16), latency, pool)
    return Runtime(engine, scheduler, max_model_len=128, sampler=sampler).start()


def test_a_sampling_error_ends_only_its_request(tmp_path):
    """Three requests in the same iterations; the middle one's sampling raises. It ends with
    an error; the others give what they give without it (reference: a runtime serving only
    them with the real sampler); the runtime serves on and the pool holds no pin."""

    def requests():
        return [
            GenerationRequest("a", tuple(range(3, 40)), 6, SamplingParams(0.8, seed=1),
                              ignore_eos=True),
            GenerationRequest("bad", tuple(range(5, 30)), 6, SamplingParams(0.8, seed=666),
                              ignore_eos=True),
            GenerationRequest("c", tuple(range(9, 21)), 6, SamplingParams(0.0), ignore_eos=True),
        ]  # fmt: skip

    sampler = FailingSampler(bad_seed=666)
    rt = make_runtime(tmp_path, sampler)
    try:
        got = run_requests(rt, requests())
        assert sampler.num_failures == 1
        assert got["bad"][1] == "error" and "injected sampling failure" in got["bad"][2]
        assert got["bad"][0] == []
        assert rt.alive
        again = run_requests(rt, [GenerationRequest("d", (1, 2, 3), 2, ignore_eos=True)])
        assert again["d"][1] == "length" and len(again["d"][0]) == 2
        pool = rt.scheduler.pool
        assert pool.get_stats()["num_running_requests"] == 0
        assert rt.counters["finished_error"] == 1
    finally:
        rt.close()
    pool.check_invariants()
    reference_rt = make_runtime(tmp_path / "ref")
    try:
        want = run_requests(reference_rt, [r for r in requests() if r.request_id != "bad"])
    finally:
        reference_rt.close()
    for rid in ("a", "c"):
        assert got[rid] == want[rid] and got[rid][1] == "length" and len(got[rid][0]) == 6
