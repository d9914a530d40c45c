"""Validating an iteration's batches (before anything changes) and admitting new requests
(matching and pinning their cached prefix)."""

from __future__ import annotations

import numpy as np

from tokenlake.dispatch import hungarian_dispatch
from tokenlake.errors import InvalidArgumentError, IterationStateError
from tokenlake.plans import Chunk
from tokenlake.prefix_tree import PrefixMatch, PrefixTree
from tokenlake.requests import PlannedChunk, RequestState
from tokenlake.validate import check_int, check_sequence, fail, is_int


def check_batches(batches, dops, num_live: int) -> list[int]:
    """Shape of ``batches``/``dops``; returns the dops (default 1 each)."""
    check_sequence("batches", batches, min_len=1)
    for b, batch in enumerate(batches):
        check_sequence(f"batches[{b}]", batch, min_len=1)
        for i, chunk in enumerate(batch):
            if not isinstance(chunk, Chunk):
                raise fail(f"batches[{b}][{i}]", "a Chunk", chunk)
    if dops is None:
        dops = [1] * len(batches)
    check_sequence("dops", dops, length=len(batches))
    out = []
    for b, (dop, batch) in enumerate(zip(dops, batches, strict=True)):
        rows = sum(c.num_new_tokens for c in batch)
        out.append(check_int(f"dops[{b}]", dop, low=1, high=min(rows, num_live) + 1))
    if sum(out) > num_live:
        raise InvalidArgumentError(
            f"dops: expected at most {num_live} sub-batches in all (the live instances), "
            f"got {sum(out)} ({out})"
        )
    return out


def check_instances(instances, batches, dops: list[int], live, busy) -> None:
    """``instances[b]``: ``None`` or distinct live instance ids, at least ``dops[b]`` of them;
    sub-batches go to free (not ``busy``) instances only, and an assignment must exist."""
    free = sorted(i for i in live if i not in busy)
    if sum(dops) > len(free):
        raise IterationStateError(
            f"dops: {sum(dops)} sub-batches need as many free instances; only {free} are free "
            f"(instances {sorted(busy)} run iterations in flight)"
        )
    if instances is None:
        return
    check_sequence("instances", instances, length=len(batches))
    for b, allowed in enumerate(instances):
        if allowed is None:
            continue
        name = f"instances[{b}]"
        check_sequence(name, allowed, min_len=dops[b])
        for i, instance_id in enumerate(allowed):
            if not is_int(instance_id) or int(instance_id) not in live:
                raise fail(
                    f"{name}[{i}]", f"a live instance id (one of {sorted(live)})", instance_id
                )
        if len(set(allowed)) != len(allowed):
            raise fail(name, "distinct instance ids", allowed)
        taken = sorted(int(i) for i in allowed if int(i) in busy)
        if taken:
            raise IterationStateError(
                f"{name}: instances {taken} run iterations in flight; free ones: {free}"
            )
    # every sub-batch needs its own allowed instance: a matching must exist (checked here,
    # before anything changes, with a zero-cost assignment)
    num_sub = sum(dops)
    allowed = np.ones((num_sub, max(live) + 1), dtype=bool)
    u = 0
    for b, dop in enumerate(dops):
        if instances[b] is not None:
            allowed[u : u + dop] = False
            allowed[u : u + dop, [int(i) for i in instances[b]]] = True
        u += dop
    hungarian_dispatch(np.zeros(allowed.shape), free, allowed)


def check_not_in_flight(batches, busy_requests: dict) -> None:
    """No request may be in two iterations in flight at once."""
    for b, batch in enumerate(batches):
        for c in batch:
            epoch = busy_requests.get(c.request_id)
            if epoch is not None:
                raise IterationStateError(
                    f"batches[{b}]: request {c.request_id!r} is in iteration {epoch} in flight"
                )


def check_chunks(batches, requests: dict, tree: PrefixTree) -> dict:
    """Per-chunk checks; returns the prefix match of every new request."""
    seen, matches = set(), {}
    for batch in batches:
        for c in batch:
            rid = c.request_id  # Chunk checked its own fields when it was built
            if rid in seen:
                raise InvalidArgumentError(
                    f"batches: expected each request at most once, got {rid!r} twice"
                )
            seen.add(rid)
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
    """A new request: pin the cached prefix it starts from (``match``). Its LRU touch waits
    for the commit."""
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
    return pc


def release(chunks: list[PlannedChunk], requests: dict, tree: PrefixTree) -> None:
    """Undo :func:`admit` for the new requests among ``chunks``."""
    for pc in chunks:
        if pc.is_new:
            for node in pc.state.nodes + ([pc.source] if pc.source else []):
                tree.unpin(node)
            requests.pop(pc.state.request_id, None)
