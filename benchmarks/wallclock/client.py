"""The wall-clock bench's client: sends a request list at a rate through the OpenAI-compatible
streaming completions API (httpx, async) and records each request's send time, every token's
arrival and the cached prompt tokens the server reports.

Prompts travel as text: the SGLang router accepts only string prompts on /v1/completions. The
workloads draw token ids from :data:`ALPHABET`'s size and each id becomes one printable ASCII
character, which the byte-level tokenizer of both model shapes turns back into one token, so
the servers see exactly the workload's prefix sharing. A ``salt`` permutes the alphabet: every
rate point sends fresh text with the same sharing, so no point hits what an earlier one cached.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tokenlake.benchmarks.wallclock.workloads import TimedRequest

# printable ASCII without the space and '<' (every special token of the tokenizer starts with it)
ALPHABET = "".join(chr(c) for c in range(33, 127) if chr(c) != "<")
REQUEST_TIMEOUT_S = 300.0


@dataclass(eq=False)
class Record:
    """One request's timeline (seconds on the client's monotonic clock)."""

    request_id: str
    prompt_len: int
    max_tokens: int
    sent_s: float = float("nan")
    token_s: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    completion_tokens: int = 0  # the server's count (usage), 0 until its last event
    error: str = ""

    @property
    def num_tokens(self) -> int:
        """Tokens received: one per event, or the server's count where an event carried
        several (SGLang sends what accumulated since its last event when the client lags)."""
        return max(len(self.token_s), self.completion_tokens)

    @property
    def finished(self) -> bool:
        return not self.error and self.num_tokens >= self.max_tokens

    @property
    def ttft_s(self) -> float:
        return self.token_s[0] - self.sent_s if self.token_s else float("inf")

    @property
    def max_gap_s(self) -> float:
        """The longest wait between two consecutive tokens (0 with one token)."""
        return float(np.diff(self.token_s).max()) if len(self.token_s) > 1 else 0.0

    @property
    def tpot_s(self) -> float:
        n = self.num_tokens
        return (self.token_s[-1] - self.token_s[0]) / (n - 1) if n > 1 and self.token_s else 0.0


def prompt_text(prompt_ids: Sequence[int], salt: int) -> str:
    """The text of ``prompt_ids`` (each < ``len(ALPHABET)``) under permutation ``salt``."""
    perm = np.random.default_rng(salt).permutation(len(ALPHABET)) if salt else None
    chars = ALPHABET if perm is None else "".join(ALPHABET[k] for k in perm)
    try:
        return "".join(chars[t] for t in prompt_ids)
    except IndexError:
        bad = max(prompt_ids)
        raise ValueError(f"prompt_ids: expected ids < {len(ALPHABET)}, got {bad}") from None


async def _one(client, model: str, req: TimedRequest, text: str, rec: Record) -> None:
    body = {"model": model, "prompt": text, "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    rec.sent_s = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                rec.error = str(event["error"])[:200]
                return
            if event.get("choices"):  # one event per generated token
                rec.token_s.append(time.perf_counter())
            usage = event.get("usage") or {}
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                "cached_tokens", rec.cached_tokens
            )
            rec.completion_tokens = usage.get("completion_tokens") or rec.completion_tokens


async def _drive(url, model, requests, rate, salt, limit_s) -> list[Record]:
    import httpx

    records = [Record(r.request_id, len(r.prompt_ids), r.max_tokens) for r in requests]
    done: dict[str, asyncio.Event] = {}  # session -> its latest turn finished
    limits = httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=0)
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def run(req: TimedRequest, rec: Record, after: asyncio.Event | None, mine) -> None:
            try:
                if after is not None:
                    await after.wait()  # a session's next turn follows the previous answer
                delay = req.arrival_s / rate - (time.perf_counter() - start)
                if delay > 0:
                    await asyncio.sleep(delay)
                await _one(client, model, req, prompt_text(req.prompt_ids, salt), rec)
            except (httpx.HTTPError, json.JSONDecodeError) as e:
                rec.error = f"{type(e).__name__}: {e}"[:200]
            finally:
                if mine is not None:
                    mine.set()

        tasks = []
        for req, rec in zip(requests, records, strict=True):
            after = mine = None
            if req.session_id is not None:
                after = done.get(req.session_id)
                mine = done[req.session_id] = asyncio.Event()
            tasks.append(asyncio.ensure_future(run(req, rec, after, mine)))
        _, pending = await asyncio.wait(tasks, timeout=limit_s)
        for t in pending:  # past the run's cap: unfinished, they miss the SLO
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=STOP_GRACE_S)
    for rec in records:
        if not rec.finished and not rec.error:
            rec.error = "unfinished at the run's time cap"
    return records


STOP_GRACE_S = 10.0


def drive(
    url: str,
    model: str,
    requests: Sequence[TimedRequest],
    rate: float,
    *,
    salt: int,
    limit_s: float,
) -> list[Record]:
    """Send ``requests`` to ``url`` at ``rate`` req/s (arrivals divided by it; a session's turn
    also waits for its previous turn's answer); every request ends within ``limit_s``."""
    if not rate > 0:
        raise ValueError(f"rate: expected > 0 req/s, got {rate!r}")
    if not limit_s > 0:
        raise ValueError(f"limit_s: expected > 0, got {limit_s!r}")
    return asyncio.run(_drive(url, model, list(requests), rate, salt, limit_s))
