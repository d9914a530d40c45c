"""A stream's ``token_ids`` (``return_token_ids``) add up to exactly the generated ids, also
when several tokens of one choice arrive together: the events of a batch are detokenized
together, so a choice's text already holds its later tokens when its first delta is sent."""

from __future__ import annotations

import asyncio
import json

from tokenlake.serve.api import routes
from tokenlake.serve.api.generation import Choice
from tokenlake.serve.api.protocol import CompletionRequest
from tokenlake.serve.api.text import TextStream


def test_batched_events_send_every_token_id_once(monkeypatch):
    choice = Choice(0, "r0", [1, 2, 3], TextStream(None, []))
    batch = [[10, 11, 12], [13], [14, 15]]  # ids that arrived together, batch by batch

    async def events(state, choices, queue, request):
        for ids in batch:
            deltas = [choice.text.add(i) for i in ids]  # the whole batch first, as events()
            for delta in deltas:
                yield choice, delta

    monkeypatch.setattr(routes, "events", events)
    body = CompletionRequest(model="m", prompt="x", stream=True, return_token_ids=True)

    async def collect() -> list[str]:
        return [c async for c in routes._completion_chunks(None, body, None, {}, [choice], None)]

    sent = []
    for chunk in asyncio.run(collect()):
        if chunk.startswith("data: {"):
            for c in json.loads(chunk[len("data: ") :])["choices"]:
                sent += c.get("token_ids", [])
    assert sent == [10, 11, 12, 13, 14, 15]
