"""The simulator's request: chained block ids (Mooncake schema) plus arrival information.

A request either arrives at ``arrival_s`` (open loop) or, for a later turn of a session,
``delay_s`` after the request ``after`` finishes (closed loop, as a user or an agent waits for
the answer before sending the next turn). Block ids are chained and global: equal id means
equal prefix up to and including that block, so every cache (the pool, a local radix cache)
sees the same sharing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Block ids map to disjoint token ranges (id * block_size + offset) below 2**30, so tokens fit
# int32; output tokens live above 2**30 so they never equal a prompt block.
OUTPUT_TOKEN_BASE = 2**30


@dataclass(frozen=True)
class SimRequest:
    rid: int
    arrival_s: float
    input_len: int
    output_len: int
    block_ids: tuple[int, ...]
    session: int = -1
    after: int = -1  # rid of the previous turn (closed loop), or -1
    delay_s: float = 0.0  # think time after ``after`` finishes

    def __post_init__(self) -> None:
        if self.input_len <= 0 or self.output_len <= 0:
            raise ValueError(f"request {self.rid}: input_len and output_len must be positive")


@dataclass(frozen=True)
class Workload:
    """Requests sorted by (arrival, rid); ``note`` says what was scaled or synthesized."""

    name: str
    requests: tuple[SimRequest, ...]
    block_size: int
    note: str = ""

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def offered_rate(self) -> float:
        """Requests per second over the open-loop arrival span (closed-loop turns included)."""
        firsts = [r.arrival_s for r in self.requests if r.after < 0]
        span = max(firsts) - min(firsts) if len(firsts) > 1 else 0.0
        return len(self.requests) / span if span > 0 else float("inf")


def block_tokens(block_id: int, block_size: int) -> np.ndarray:
    """The fixed token ids of one block: a range no other block id uses."""
    if not 0 <= block_id < (2**30) // block_size:
        raise ValueError(f"block_id: expected 0..{(2**30) // block_size - 1}, got {block_id}")
    return np.arange(block_id * block_size, (block_id + 1) * block_size, dtype=np.int32)


def prompt_tokens(req: SimRequest, block_size: int) -> np.ndarray:
    """Read-only int32 token ids of the prompt followed by the request's output tokens.

    Output tokens are unique to the request; the prompt is the concatenation of its blocks,
    the last one truncated to ``input_len``.
    """
    if len(req.block_ids) != -(-req.input_len // block_size):
        raise ValueError(
            f"request {req.rid}: {len(req.block_ids)} block ids for input_len {req.input_len}"
        )
    ids = np.asarray(req.block_ids, dtype=np.int64)
    prompt = (ids[:, None] * block_size + np.arange(block_size)).reshape(-1)[: req.input_len]
    out = OUTPUT_TOKEN_BASE + (req.rid * 7919 + np.arange(req.output_len)) % OUTPUT_TOKEN_BASE
    tokens = np.concatenate([prompt, out]).astype(np.int32)
    tokens.flags.writeable = False
    return tokens
