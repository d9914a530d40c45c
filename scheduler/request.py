"""One request's lifecycle: waiting → prefill (chunks) → decode → finished; a preempted request
goes back to waiting and recomputes what it knew (vLLM's recompute preemption)."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tokenlake.errors import InvalidArgumentError
from tokenlake.keys import as_tokens
from tokenlake.plans import Chunk

VOCAB = 32000  # synthetic next tokens, when the caller supplies none


def synthetic_token(last: int) -> int:
    """The deterministic token that follows ``last`` when no model samples one."""
    return (int(last) * 7919 + 17) % VOCAB


def next_tokens(
    chunks: Sequence[Chunk], requests: Mapping[int | str, Request], given: Mapping[int | str, int]
) -> dict[int | str, int]:
    """The token each chunk's request samples next: ``given[request_id]``, checked to be an int
    in ``[0, 2**31)``, else the synthetic one. A chunk past the known tokens (multi-step
    decode on synthetic tokens) can be given none. Raises before anything is used."""
    tokens = {}
    for chunk in chunks:
        req = requests[chunk.request_id]
        if chunk.end > req.num_known and chunk.request_id in given:
            raise InvalidArgumentError(
                f"new_token_ids: request {chunk.request_id!r} ran {chunk.num_new_tokens} "
                "decode steps on synthetic tokens (decode_steps > 1); none can be given"
            )
        token = given.get(chunk.request_id, synthetic_token(req.tokens[chunk.end - 1]))
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
            raise InvalidArgumentError(f"new_token_ids: expected int tokens, got {token!r}")
        if not 0 <= token < 2**31:
            raise InvalidArgumentError(f"new_token_ids: token {token} out of [0, 2**31)")
        tokens[chunk.request_id] = int(token)
    return tokens


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
    a decode step, a recompute's last chunk) yields the next token. ``arrival`` numbers the
    requests in arrival order; ``deadline`` is when its first token is due (arrival time +
    the input-token SLO × prompt length; ``inf`` without that SLO); ``priority`` orders
    admission, prefill and preemption (earliest deadline first, then arrival; kept across
    preemptions). ``ready_at`` is the time its last token came (or it arrived), from which
    its next token's latency counts.
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
    deadline: float = math.inf
    num_preemptions: int = 0

    @classmethod
    def create(
        cls,
        request_id: int | str,
        prompt,
        max_output_tokens: int,
        arrival: int,
        now: float = 0.0,
        input_token_slo: float = math.inf,
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
        deadline = (
            now + input_token_slo * len(prompt) if math.isfinite(input_token_slo) else math.inf
        )
        return cls(
            request_id,
            len(prompt),
            max_output_tokens,
            arrival,
            tokens,
            ready_at=now,
            deadline=deadline,
        )

    @property
    def priority(self) -> tuple[float, int]:
        """Lower first: earliest deadline, then earliest arrival."""
        return (self.deadline, self.arrival)

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

    def lookahead(self, num_steps: int) -> np.ndarray:
        """Token ids for ``num_steps`` decode steps in one iteration (multi-step decoding):
        the known tokens and the ``num_steps - 1`` synthetic ones the steps before the last
        will produce (read-only int32). Only for synthetic tokens (the simulator)."""
        end = self.num_known + num_steps - 1
        if not 1 <= num_steps <= self.max_output_tokens - self.num_generated:
            raise InvalidArgumentError(f"num_steps: expected 1..remaining outputs, got {num_steps}")
        for i in range(self.num_known, end):
            self.tokens[i] = synthetic_token(self.tokens[i - 1])
        view = self.tokens[:end]
        view.flags.writeable = False
        return view

    def advance(self, end: int, next_token: int, now: float = 0.0) -> int:
        """Record that the pool now stores tokens ``[0, end)``; when that reaches the end of
        the known tokens (or of a :meth:`lookahead`), ``next_token`` is the newly generated
        token. Returns how many tokens were generated (the lookahead ones included)."""
        if self.phase is Phase.FINISHED:
            raise InvalidArgumentError(f"request_id: {self.request_id!r} already finished")
        self.num_stored = end
        if end < self.num_known:
            self.phase = Phase.PREFILL
            return 0
        ahead = end - self.num_known  # lookahead tokens that are now generated
        self.num_generated += ahead
        self.tokens[self.num_known] = next_token
        self.num_generated += 1
        self.ready_at = now
        done = self.num_generated >= self.max_output_tokens
        self.phase = Phase.FINISHED if done else Phase.DECODE
        return ahead + 1

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
