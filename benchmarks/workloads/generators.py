"""Synthetic workloads with the statistics the paper (§7) and the agentic-trace study report,
each behind one long system prompt shared by every request.

- ``loogle``: shared long documents (mean sequence 24K tokens), a short question each, short
  answers; open-loop Poisson arrivals.
- ``scbench``: multi-turn sessions over one long private context (mean sequence 227K tokens,
  5 turns on average); the next turn is sent a think time (exponential, mean 5 s) after the
  previous answer is complete (``think_scale=0``: at once, as SCBench's evaluation script
  runs them).
- ``sharegpt``: short single-turn chats, sequence < 2.4K tokens (plus the system prompt).
- ``agentic``: coding-agent sessions (median 33 turns; context growing ~2.2K tokens per turn
  from ~12K; input:output about 131:1; think time median 5.2 s, p99 81 s). Every tenth
  session is a long-horizon one whose turns add ``LONG_GROWTH`` times as much (whole files,
  logs): its context outgrows one instance's KV memory (262K tokens on the default cluster)
  after ~30 turns, so a system that keeps a session on one instance must refuse its later turns.

Every length is in tokens; blocks are ``block_size`` tokens with chained global ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tokenlake.benchmarks.workloads.request import SimRequest, Workload

LONG_GROWTH = 4.0  # agentic: per-turn growth of every tenth session, times the others'


@dataclass(frozen=True)
class GeneratorConfig:
    """Args: num_requests (approximate for session workloads: whole sessions are kept),
    rate (requests/s, open-loop arrivals or session starts scaled to this request rate),
    system_prompt_len (shared by every request), block_size, seed, think_scale (session
    workloads: the think time between turns times this; 0 sends a turn as soon as the
    previous answer is complete; the random draws are the same at every scale),
    num_sessions (session workloads, 0: whole sessions until ``num_requests``; else this many
    sessions, each sending a window of about ``num_requests / num_sessions`` consecutive
    turns from a random turn on, its earlier turns' context part of the first prompt sent:
    enough sessions that a high rate overloads any system, so the goodput is bounded)."""

    num_requests: int = 200
    rate: float = 1.0
    system_prompt_len: int = 4096
    block_size: int = 512
    seed: int = 0
    think_scale: float = 1.0
    num_sessions: int = 0

    def __post_init__(self) -> None:
        if self.num_sessions < 0:
            raise ValueError(
                f"GeneratorConfig.num_sessions: expected >= 0, got {self.num_sessions}"
            )
        if self.num_requests < 1 or self.rate <= 0 or self.block_size < 1:
            raise ValueError("GeneratorConfig: num_requests >= 1, rate > 0, block_size >= 1")
        if not 0 <= self.think_scale < float("inf"):
            raise ValueError(f"GeneratorConfig.think_scale: expected >= 0, got {self.think_scale}")
        if self.system_prompt_len % self.block_size:
            raise ValueError("GeneratorConfig.system_prompt_len: expected a multiple of block_size")


class _Blocks:
    """Hands out chained block ids: a new id for every new (parent, content) pair."""

    def __init__(self) -> None:
        self.next_id = 0

    def fresh(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, size=None) -> np.ndarray:
    """Lognormal with the given mean (not median)."""
    return rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, size)


def _blocks_for(prefix_ids: list[int], prefix_len: int, total: int, b: int, ids: _Blocks):
    """Block ids of a prompt of ``total`` tokens whose first ``prefix_len`` (a multiple of
    ``b``) tokens are the blocks ``prefix_ids``; the rest is new content."""
    assert prefix_len % b == 0 and len(prefix_ids) == prefix_len // b
    return tuple(prefix_ids + ids.fresh(-(-(total - prefix_len) // b)))


def loogle(cfg: GeneratorConfig) -> Workload:
    rng, ids, b = np.random.default_rng(cfg.seed), _Blocks(), cfg.block_size
    system = ids.fresh(cfg.system_prompt_len // b)
    # LooGLE asks ~5-20 questions per long document; mean sequence 24K tokens overall.
    num_docs = max(2, cfg.num_requests // 10)
    doc_lens = np.clip(
        _lognormal(rng, 24_000 - cfg.system_prompt_len, 0.5, num_docs), 2 * b, 90_000
    )
    docs = [system + ids.fresh(int(n) // b) for n in doc_lens]
    arrivals = np.cumsum(rng.exponential(1.0 / cfg.rate, cfg.num_requests))
    reqs = []
    for i, t in enumerate(arrivals):
        d = int(rng.integers(num_docs))
        question = int(rng.integers(32, 256))
        total = len(docs[d]) * b + question
        reqs.append(
            SimRequest(
                i,
                float(t),
                total,
                int(rng.integers(16, 256)),
                _blocks_for(docs[d], len(docs[d]) * b, total, b, ids),
            )
        )
    return Workload("loogle", tuple(reqs), b, "LooGLE-like: shared documents, mean 24K tokens")


def sharegpt(cfg: GeneratorConfig) -> Workload:
    rng, ids, b = np.random.default_rng(cfg.seed), _Blocks(), cfg.block_size
    system = ids.fresh(cfg.system_prompt_len // b)
    arrivals = np.cumsum(rng.exponential(1.0 / cfg.rate, cfg.num_requests))
    reqs = []
    for i, t in enumerate(arrivals):
        # ShareGPT: prompt mean ~300, answer mean ~250 tokens; prompt + answer < 2.4K.
        out = int(np.clip(_lognormal(rng, 250, 0.8), 8, 1024))
        user = int(np.clip(_lognormal(rng, 300, 1.0), 8, 2399 - out))
        total = cfg.system_prompt_len + user
        reqs.append(
            SimRequest(i, float(t), total, out, _blocks_for(system, len(system) * b, total, b, ids))
        )
    return Workload("sharegpt", tuple(reqs), b, "ShareGPT-like: sequence < 2.4K + system prompt")


def _sessions(
    cfg: GeneratorConfig,
    name: str,
    turns_of: Callable[[np.random.Generator], int],
    first_len_of: Callable[[np.random.Generator], int],
    growth_of: Callable[[np.random.Generator, int], int],
    output_of: Callable[[np.random.Generator, int], int],
    think_of: Callable[[np.random.Generator], float],
    note: str,
) -> Workload:
    """Closed-loop sessions: turn k+1's prompt is turn k's prompt (whole blocks reused) plus
    new tokens (the previous answer, tool output or question); it is sent ``think`` seconds
    (times ``cfg.think_scale``) after turn k finishes. Session starts are Poisson, scaled so
    requests arrive at ``rate``."""
    rng, ids, b = np.random.default_rng(cfg.seed), _Blocks(), cfg.block_size
    system = ids.fresh(cfg.system_prompt_len // b)
    plans, total_turns = [], 0
    while total_turns < cfg.num_requests and not cfg.num_sessions:
        turns = max(1, turns_of(rng))
        plans.append(turns)
        total_turns += turns
    windows = [(0, turns) for turns in plans]  # (first turn sent, turns sent)
    if cfg.num_sessions:
        per = max(1, -(-cfg.num_requests // cfg.num_sessions))
        plans = [max(1, turns_of(rng)) for _ in range(cfg.num_sessions)]
        windows = [(int(rng.integers(0, max(1, t - per + 1))), min(per, t)) for t in plans]
        total_turns = sum(n for _, n in windows)
    session_rate = cfg.rate * len(plans) / total_turns
    starts = np.cumsum(rng.exponential(1.0 / session_rate, len(plans)))
    reqs: list[SimRequest] = []
    for s, ((first, num_sent), t0) in enumerate(zip(windows, starts, strict=True)):
        prefix, length, prev = list(system), max(first_len_of(rng), cfg.system_prompt_len + 1), -1
        for k in range(first + num_sent):
            if k:
                length += max(1, growth_of(rng, s))
            if k < first:  # before the window: its context is in the first prompt sent
                continue
            blocks = _blocks_for(prefix, len(prefix) * b, length, b, ids)
            rid = len(reqs)
            reqs.append(
                SimRequest(
                    rid,
                    float(t0),
                    length,
                    max(1, output_of(rng, length)),
                    blocks,
                    s,
                    after=prev,
                    delay_s=cfg.think_scale * think_of(rng) if k > first else 0.0,
                )
            )
            prefix, prev = list(blocks[: length // b]), rid
    if cfg.think_scale != 1:
        note += f"; think time x{cfg.think_scale:g}"
    if cfg.num_sessions:
        note += f"; {cfg.num_sessions} sessions, windows of {windows and max(n for _, n in windows)} turns"
    return Workload(name, tuple(reqs), b, note)


def scbench(cfg: GeneratorConfig) -> Workload:
    return _sessions(
        cfg,
        "scbench",
        turns_of=lambda r: int(r.integers(3, 8)),  # mean 5 turns
        # mean 227K; at most 245K so a session fits one TP2 A100 instance (262K KV tokens)
        first_len_of=lambda r: int(np.clip(_lognormal(r, 225_000, 0.12), 150_000, 245_000)),
        growth_of=lambda r, s: int(r.integers(100, 900)),  # previous answer + next question
        output_of=lambda r, n: int(r.integers(16, 192)),
        think_of=lambda r: float(r.exponential(5.0)),
        note="SCBench-like: 5-turn sessions over a private ~225K-token context (mean 227K)",
    )


def agentic(cfg: GeneratorConfig) -> Workload:
    # Think time: lognormal with median 5.2 s and p99 81.4 s -> sigma = ln(81.4/5.2) / 2.326.
    sigma = float(np.log(81.4 / 5.2) / 2.326)
    return _sessions(
        cfg,
        "agentic",
        turns_of=lambda r: int(np.clip(r.lognormal(np.log(33), 0.5), 3, 150)),
        first_len_of=lambda r: int(np.clip(_lognormal(r, 12_000, 0.3), 6_000, 40_000)),
        growth_of=lambda r, s: int(
            np.clip(_lognormal(r, 2_242, 0.8) * (LONG_GROWTH if s % 10 == 9 else 1), 64, 30_000)
        ),
        output_of=lambda r, n: int(np.clip(_lognormal(r, 450, 0.8), 8, 4096)),  # ~131:1
        think_of=lambda r: float(r.lognormal(np.log(5.2), sigma)),
        note="agentic-like (Codex/SWE-bench Pro statistics): median 33 turns, +2.2K tokens/turn",
    )


SESSION_WORKLOADS = ("agentic", "scbench")  # closed-loop sessions with think time
GENERATORS: dict[str, Callable[[GeneratorConfig], Workload]] = {
    "loogle": loogle,
    "scbench": scbench,
    "sharegpt": sharegpt,
    "agentic": agentic,
}
