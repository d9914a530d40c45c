"""Validating an iteration's batches (before anything changes) and admitting new requests
(matching and pinning their cached prefix)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from tokenlake.chunk_set import ChunkSet
from tokenlake.dispatch import hungarian_dispatch
from tokenlake.errors import InvalidArgumentError, IterationStateError
from tokenlake.plans import Chunk
from tokenlake.prefix_tree import PrefixMatch, PrefixTree
from tokenlake.requests import PlannedChunk, RequestState
from tokenlake.validate import check_int, check_sequence, fail, is_int


def check_batches(batches, dops, num_live: int) -> list[int]:
    """Shape of ``batches``/``dops``; returns the dops (default 1 each). Each chunk is checked
    by :func:`scan_chunks`, ``dops[b]`` against batch ``b``'s rows by :func:`check_dops`."""
    check_sequence("batches", batches, min_len=1)
    for b, batch in enumerate(batches):
        check_sequence(f"batches[{b}]", batch, min_len=1)
    if dops is None:
        return [1] * len(batches)
    check_sequence("dops", dops, length=len(batches))
    out = [check_int(f"dops[{b}]", dop, low=1, high=num_live + 1) for b, dop in enumerate(dops)]
    if sum(out) > num_live:
        raise InvalidArgumentError(
            f"dops: expected at most {num_live} sub-batches in all (the live instances), "
            f"got {sum(out)} ({out})"
        )
    return out


def check_dops(dops: list[int], cs: ChunkSet) -> None:
    """A sub-batch has at least one row: ``dops[b]`` is at most batch ``b``'s new tokens."""
    rows = np.bincount(cs.batch, weights=cs.end - cs.start, minlength=len(dops))
    for b, dop in enumerate(dops):
        if dop > rows[b]:
            raise fail(f"dops[{b}]", f"an int in [1, {int(rows[b]) + 1}) (its rows)", dop)


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


def scan_chunks(
    batches, requests: dict, busy_requests: dict, tree: PrefixTree
) -> tuple[ChunkSet, dict]:
    """Check every chunk against the pool before anything changes, and sort them into a
    :class:`ChunkSet`: in place (a running request's chunk inside its open tail), running
    (one that fills or starts a segment) or new. Returns it and each new request's match.
    One pass, no per-chunk calls: a decode batch of thousands of requests goes through here."""
    cs, matches = ChunkSet(), {}
    seg = tree.segment_len
    entries, cols, get = cs.entries, cs.cols, requests.get
    for b, batch in enumerate(batches):
        for c in batch:
            if type(c) is not Chunk and not isinstance(c, Chunk):
                raise fail(f"batches[{b}][{list(batch).index(c)}]", "a Chunk", c)
            rid, start, end = c.request_id, c.start, c.end  # Chunk checked its own fields
            state = get(rid)
            pc = None
            if state is not None:
                if start != state.num_tokens:
                    raise InvalidArgumentError(
                        f"Chunk.start: request {rid!r} has {state.num_tokens} tokens in the "
                        f"pool, got start={start}"
                    )
                op = state.open
                if op is None:
                    pc = PlannedChunk(state, start, end, c.token_ids, False)
                    cols += (b, start, end, -1, -1, 0)
                else:
                    num_open, loc = len(op.tokens), op.location
                    if end - start + num_open >= seg:  # fills its open tail: planned
                        pc = PlannedChunk(state, start, end, c.token_ids, False)
                    cols += (b, start, end, loc[0], loc[1], num_open)
            else:
                if rid in matches:
                    _twice(rid)
                m = tree.match(c.token_ids[:start])
                if m.num_tokens < start:
                    raise InvalidArgumentError(
                        f"Chunk.start: new request {rid!r} has only {m.num_tokens} cached "
                        f"tokens, got start={start}"
                    )
                matches[rid] = m
                cs.new.append((len(entries), c))
                cols += (b, start, end, -1, -1, 0)
            entries.append((rid, state, c.token_ids, pc))
    cs.finish()
    ids = cs.request_ids
    if len(set(ids)) != len(ids):
        _twice(next(r for r, n in Counter(ids).items() if n > 1))
    if busy_requests and not busy_requests.keys().isdisjoint(ids):
        for b, batch in enumerate(batches):
            for c in batch:
                if c.request_id in busy_requests:
                    raise IterationStateError(
                        f"batches[{b}]: request {c.request_id!r} is in iteration "
                        f"{busy_requests[c.request_id]} in flight"
                    )
    return cs, matches


def _twice(rid) -> None:
    raise InvalidArgumentError(f"batches: expected each request at most once, got {rid!r} twice")


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
