"""One request's lifecycle: waiting → prefill (chunks) → decode → finished; a preempted request
goes back to waiting and recomputes what it knew (vLLM's recompute preemption)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from tokenlake.errors import InvalidArgumentError
from tokenlake.keys import as_tokens


class Phase(enum.Enum):
    WAITING = "waiting"  # not in the pool; its first chunk starts at the cached prefix
    PREFILL = "prefill"  # in the pool, prompt partly stored
    DECODE = "decode"  # prompt stored, generating one token per iteration
    FINISHED = "finished"  # released with pool.finish


def chunk_end(start: int, prompt_len: int, limit: int, segment_len: int) -> int:
    """End of a prefill chunk starting at ``start`` of at most ``limit`` new tokens.

    The chunk ends the prompt if it can; otherwise it ends on a multiple of ``segment_len`` so
    the segments it seals stay aligned. Returns ``start`` when ``limit`` is too small to reach
    the next boundary.
    """
    if start + limit >= prompt_len:
        return prompt_len
    return max(start, (start + limit) // segment_len * segment_len)


@dataclass(eq=False)
class Request:
    """Scheduler-side state of one request.

    ``num_stored`` tokens have KV in the pool; ``token_ids`` are the prompt and the tokens
    generated so far. A chunk that reaches the end of the known tokens (a prompt's last chunk,
    a decode step, a recompute's last chunk) yields the next token. ``arrival`` is the
    request's priority (lower first; kept across preemptions); ``ready_at`` the time its last
    token came (or it arrived), from which its next token's latency counts.
    """

    request_id: int | str
    prompt_len: int
    max_output_tokens: int
    arrival: int
    tokens: np.ndarray  # int32 [prompt_len + max_output_tokens], filled up to num_known
    phase: Phase = Phase.WAITING
    num_stored: int = 0
    num_generated: int = 0
    ready_at: float = 0.0
    num_preemptions: int = 0

    @classmethod
    def create(
        cls,
        request_id: int | str,
        prompt,
        max_output_tokens: int,
        arrival: int,
        now: float = 0.0,
    ) -> Request:
        prompt = as_tokens(prompt, "prompt")
        if not len(prompt):
            raise InvalidArgumentError("prompt: expected at least one token")
        if (
            isinstance(max_output_tokens, bool)
            or not isinstance(max_output_tokens, int)
            or max_output_tokens < 1
        ):
            raise InvalidArgumentError(
                f"max_output_tokens: expected an int >= 1, got {max_output_tokens!r}"
            )
        tokens = np.zeros(len(prompt) + max_output_tokens, dtype=np.int32)
        tokens[: len(prompt)] = prompt
        return cls(request_id, len(prompt), max_output_tokens, arrival, tokens, ready_at=now)

    @property
    def num_known(self) -> int:
        return self.prompt_len + self.num_generated

    @property
    def max_len(self) -> int:
        """Tokens the request may hold in the pool at most: prompt and every output token."""
        return self.prompt_len + self.max_output_tokens

    @property
    def token_ids(self) -> np.ndarray:
        """Read-only int32 view of the known tokens (positions below it never change)."""
        view = self.tokens[: self.num_known]
        view.flags.writeable = False
        return view

    @property
    def output_ids(self) -> np.ndarray:
        return self.tokens[self.prompt_len : self.num_known].copy()

    def advance(self, end: int, next_token: int, now: float = 0.0) -> bool:
        """Record that the pool now stores tokens ``[0, end)``; when that reaches the end of
        the known tokens, ``next_token`` is the newly generated token. Returns whether a
        token was generated."""
        if self.phase is Phase.FINISHED:
            raise InvalidArgumentError(f"request_id: {self.request_id!r} already finished")
        self.num_stored = end
        if end < self.num_known:
            self.phase = Phase.PREFILL
            return False
        self.tokens[self.num_known] = next_token
        self.num_generated += 1
        self.ready_at = now
        done = self.num_generated >= self.max_output_tokens
        self.phase = Phase.FINISHED if done else Phase.DECODE
        return True

    def preempt(self) -> None:
        """Back to waiting: the pool released it; it recomputes its known tokens (from its
        cached prefix) before generating the next one."""
        if self.phase in (Phase.WAITING, Phase.FINISHED):
            raise InvalidArgumentError(
                f"request_id: {self.request_id!r} is {self.phase.value}, not running"
            )
        self.phase = Phase.WAITING
        self.num_stored = 0
        self.num_preemptions += 1
