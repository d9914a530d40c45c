"""Test helper: a checkpoint served the way ``tokenlake serve`` serves it (``serve.build``:
config, dtype, max_model_len, pool, scheduler, runtime), and greedy generation through the
runtime's public ``submit``."""

from __future__ import annotations

import queue
from pathlib import Path

from tokenlake.serve.build import Served, build
from tokenlake.serve.config import ServeConfig
from tokenlake.serve.request import GenerationRequest, TokenEvent

WAIT_S = 120  # a dead runtime fails the test instead of hanging it


def serve(path: Path, **overrides) -> Served:
    """``path`` served on a small pool, without profiling; the caller closes the runtime."""
    config = dict(
        num_instances=2, segment_len=8, num_slots=64, chunk_len=16, max_num_seqs=4,
        profile=False, torch_threads=1, port=0,
    )  # fmt: skip
    return build(ServeConfig(model=str(path), **{**config, **overrides}))


def greedy(served: Served, prompt: list[int], max_tokens: int) -> list[int]:
    """The tokens the server generates for ``prompt`` at temperature 0."""
    events: queue.Queue[TokenEvent] = queue.Queue()
    request = GenerationRequest("greedy", tuple(prompt), max_tokens, ignore_eos=True)
    served.runtime.submit(request, events.put)
    tokens = []
    while True:
        event = events.get(timeout=WAIT_S)
        assert event.error is None, event.error
        if event.token_id is not None:
            tokens.append(event.token_id)
        if event.finish_reason is not None:
            assert event.finish_reason == "length", event
            return tokens
