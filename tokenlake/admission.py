"""Validating an iteration's batches (before anything changes) and admitting new requests
(matching and pinning their cached prefix)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenlake.dispatch import hungarian_dispatch
from tokenlake.errors import InvalidArgumentError
from tokenlake.plans import Chunk
from tokenlake.prefix_tree import PrefixMatch, PrefixTree
from tokenlake.requests import PlannedChunk, RequestState


def check_batches(batches, dops, num_live: int) -> list[int]:
    """Shape of ``batches``/``dops``; returns the dops (default 1 each)."""
    if not isinstance(batches, Sequence) or isinstance(batches, str) or not batches:
        raise InvalidArgumentError("batches: expected a non-empty list of batches")
    for b, batch in enumerate(batches):
        if not isinstance(batch, Sequence) or not batch:
            raise InvalidArgumentError(f"batches[{b}]: expected a non-empty list of Chunk")
        for chunk in batch:
            if not isinstance(chunk, Chunk):
                raise InvalidArgumentError(
                    f"batches[{b}]: expected Chunk items, got {type(chunk).__name__}"
                )
    dops = [1] * len(batches) if dops is None else list(dops)
    if len(dops) != len(batches):
        raise InvalidArgumentError(f"dops: expected {len(batches)} entries, got {len(dops)}")
    for b, (dop, batch) in enumerate(zip(dops, batches, strict=True)):
        rows = sum(c.num_new_tokens for c in batch)
        if isinstance(dop, bool) or not isinstance(dop, int) or not 1 <= dop <= max(rows, 1):
            raise InvalidArgumentError(f"dops[{b}]: expected an int in 1..{rows}, got {dop!r}")
    if sum(dops) > num_live:
        raise InvalidArgumentError(
            f"dops: {sum(dops)} sub-batches exceed the {num_live} live instances"
        )
    return dops


def check_instances(instances, batches, dops: list[int], live) -> None:
    """``instances[b]``: ``None`` or distinct live instance ids, at least ``dops[b]`` of them."""
    if instances is None:
        return
    if not isinstance(instances, Sequence) or len(instances) != len(batches):
        raise InvalidArgumentError(f"instances: expected {len(batches)} entries (one per batch)")
    for b, allowed in enumerate(instances):
        if allowed is None:
            continue
        ids = list(allowed)
        if len(set(ids)) != len(ids) or not all(isinstance(i, int) and i in live for i in ids):
            raise InvalidArgumentError(
                f"instances[{b}]: expected distinct live instance ids, got {ids!r}"
            )
        if len(ids) < dops[b]:
            raise InvalidArgumentError(
                f"instances[{b}]: {len(ids)} instances cannot host DoP {dops[b]}"
            )
    # every sub-batch needs its own allowed instance: a matching must exist (checked here,
    # before anything changes, with a zero-cost assignment)
    live = sorted(live)
    num_sub = sum(dops)
    allowed = np.ones((num_sub, max(live) + 1), dtype=bool)
    u = 0
    for b, dop in enumerate(dops):
        if instances[b] is not None:
            allowed[u : u + dop] = False
            allowed[u : u + dop, list(instances[b])] = True
        u += dop
    hungarian_dispatch(np.zeros(allowed.shape), live, allowed)


def check_chunks(batches, requests: dict, tree: PrefixTree) -> dict:
    """Per-chunk checks; returns the prefix match of every new request."""
    seen, matches = set(), {}
    for batch in batches:
        for c in batch:
            rid = c.request_id
            if not isinstance(rid, int | str) or isinstance(rid, bool):
                raise InvalidArgumentError(f"Chunk.request_id: expected an int or str, got {rid!r}")
            if rid in seen:
                raise InvalidArgumentError(f"batches: request {rid!r} appears twice")
            seen.add(rid)
            if not 0 <= c.start < c.end <= len(c.token_ids):
                raise InvalidArgumentError(
                    f"Chunk.start/end: expected 0 <= start < end <= len(token_ids)="
                    f"{len(c.token_ids)}, got start={c.start}, end={c.end} ({rid!r})"
                )
            state = requests.get(rid)
            if state is not None:
                if c.start != state.num_tokens:
                    raise InvalidArgumentError(
                        f"Chunk.start: request {rid!r} has {state.num_tokens} tokens in the "
                        f"pool, got start={c.start}"
                    )
                continue
            m = tree.match(c.token_ids[: c.start])
            if m.num_tokens < c.start:
                raise InvalidArgumentError(
                    f"Chunk.start: new request {rid!r} has only {m.num_tokens} cached tokens, "
                    f"got start={c.start}"
                )
            matches[rid] = m
    return matches


def admit(chunk: Chunk, match: PrefixMatch, tree: PrefixTree) -> PlannedChunk:
    """A new request: pin (and touch) the cached prefix it starts from (``match``)."""
    pc = PlannedChunk(
        RequestState(chunk.request_id), chunk.start, chunk.end, chunk.token_ids, is_new=True
    )
    full, rest = divmod(chunk.start, tree.segment_len)
    path = list(match.nodes[:full])
    pc.state.append_nodes(path)
    if rest:
        pc.source = match.nodes[full] if full < len(match.nodes) else match.partial
        pc.source_len = rest
        path.append(pc.source)
    for node in path:
        tree.pin(node)
    tree.touch(path)
    return pc


def release(chunks: list[PlannedChunk], requests: dict, tree: PrefixTree) -> None:
    """Undo :func:`admit` for the new requests among ``chunks``."""
    for pc in chunks:
        if pc.is_new:
            for node in pc.state.nodes + ([pc.source] if pc.source else []):
                tree.unpin(node)
            requests.pop(pc.state.request_id, None)
