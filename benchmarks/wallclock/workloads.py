"""The wall-clock bench's request lists: prefix-sharing trace slices with arrival offsets at
1 req/s (the runner divides them by the rate).

- ``conversation``: multi-turn sessions of the shared Mooncake conversation trace, chosen and
  scaled as ``make demo`` does (:func:`tokenlake.benchmarks.demo.main.find_sessions`, lengths / 16
  by :class:`~tokenlake.benchmarks.workloads.traces.TokenSynth`, outputs capped at 24 tokens). Each seed
  draws its own sessions; turns keep the trace's order and relative timing (jittered inside
  its 3 s buckets), rescaled to a mean of 1 req/s. Sessions whose longest scaled prompt
  exceeds ``MAX_PROMPT_LEN`` are left out so one request fits one instance's slots.
- ``long-document``: documents shared by many requests (Zipf popularity), each request a
  document plus a fresh question, Poisson arrivals: the real-cluster bench's generator
  (:func:`tokenlake.benchmarks.real.systems.workload`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WORKLOADS = ("conversation", "long-document")
DEMO_SCALE = 16  # make demo's --scale: a 512-token trace block becomes a 32-token segment
DEMO_MAX_OUTPUT = 24  # make demo's --max-output
TRACE_WINDOW = 1000  # make demo's --window: the first requests searched for sessions
TRACE_BUCKET_S = 3.0  # the conversation trace's timestamps come in buckets of about 3 s
MAX_PROMPT_LEN = 2048  # scaled tokens


@dataclass(frozen=True)
class TimedRequest:
    request_id: str
    arrival_s: (
        float  # offset from the run's start at rate 1.0 req/s; the runner divides by the rate
    )
    prompt_ids: tuple[int, ...]
    max_tokens: int
    session_id: str | None  # conversation turns of one session share it


def build_workload(
    name: str, *, seed: int, num_requests: int, vocab_size: int
) -> list[TimedRequest]:
    """``num_requests`` requests of workload ``name``, sorted by arrival; the same arguments
    give the same list. Raises ``ValueError`` naming a bad argument."""
    if name not in WORKLOADS:
        raise ValueError(f"name: expected one of {WORKLOADS}, got {name!r}")
    for arg, value, low in (("seed", seed, 0), ("num_requests", num_requests, 1),
                            ("vocab_size", vocab_size, 2)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{arg}: expected an int >= {low}, got {value!r}")
    if name == "conversation":
        return _conversation(seed, num_requests, vocab_size)
    return _long_document(seed, num_requests, vocab_size)


def _long_document(seed: int, num_requests: int, vocab_size: int) -> list[TimedRequest]:
    from tokenlake.benchmarks.real.systems import RealClusterConfig, workload

    cfg = RealClusterConfig(num_requests=num_requests, seed=seed)
    return [
        TimedRequest(r.rid, r.arrival_s, tuple(int(t) for t in r.tokens), r.output_len, None)
        for r in workload(cfg, 1.0, vocab_size)
    ]


def _conversation(seed: int, num_requests: int, vocab_size: int) -> list[TimedRequest]:
    from tokenlake.benchmarks.demo.main import find_sessions
    from tokenlake.benchmarks.workloads.traces import TokenSynth, conversation_trace, load_trace

    trace = load_trace(conversation_trace(TRACE_WINDOW), TRACE_WINDOW)
    synth = TokenSynth(block_size=512, scale=DEMO_SCALE, vocab_size=vocab_size)
    chains = [
        c
        for c in find_sessions(trace, len(trace))
        if max(synth.input_len(trace[i]) for i in c) <= MAX_PROMPT_LEN
    ]
    rng = np.random.default_rng(seed)
    picked: list[list[int]] = []
    for k in rng.permutation(len(chains)):  # whole sessions until enough turns
        if sum(map(len, picked)) >= num_requests:
            break
        picked.append(chains[k])
    turns = sorted((i, s) for s, chain in enumerate(picked) for i in chain)[:num_requests]
    if len(turns) < num_requests:
        raise ValueError(
            f"num_requests: the trace's first {TRACE_WINDOW} requests hold {len(turns)} "
            f"session turns of at most {MAX_PROMPT_LEN} scaled tokens, got {num_requests}"
        )
    raw = np.array([trace[i].arrival_ms / 1e3 for i, _ in turns])
    raw = raw + rng.uniform(0.0, TRACE_BUCKET_S, len(turns))
    # a session's turns keep their order whatever the jitter drew
    for s in {s for _, s in turns}:
        idx = [k for k, (_, t) in enumerate(turns) if t == s]
        raw[idx] = np.sort(raw[idx])
    raw -= raw.min()
    span = float(raw.max())
    scale = (num_requests - 1) / span if span > 0 else 0.0  # mean gap 1 s
    out = [
        TimedRequest(
            f"c{i}",
            float(t * scale),
            tuple(int(x) for x in synth.prompt(trace[i])),
            min(synth.output_len(trace[i]), DEMO_MAX_OUTPUT),
            f"s{picked[s][0]}",
        )
        for (i, s), t in zip(turns, raw, strict=True)
    ]
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return out
