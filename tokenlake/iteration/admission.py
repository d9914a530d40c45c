"""Validating an iteration's batches (before anything changes) and admitting new requests
(matching and pinning their cached prefix)."""

from __future__ import annotations

from collections import Counter
from itertools import chain, repeat
from operator import attrgetter, is_not

import numpy as np

from tokenlake.errors import InvalidArgumentError, IterationStateError
from tokenlake.iteration.requests import PlannedChunk, RequestState
from tokenlake.planning.chunk_set import ChunkSet
from tokenlake.planning.dispatch import hungarian_dispatch
from tokenlake.plans import Chunk
from tokenlake.tree.prefix_tree import PrefixMatch, PrefixTree
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
    # before anything changes, with a zero-cost assignment; one sub-batch has one: its
    # allowed instances, at least one, are all free)
    num_sub = sum(dops)
    if num_sub == 1:
        return
    allowed = np.ones((num_sub, max(live) + 1), dtype=bool)
    u = 0
    for b, dop in enumerate(dops):
        if instances[b] is not None:
            allowed[u : u + dop] = False
            allowed[u : u + dop, [int(i) for i in instances[b]]] = True
        u += dop
    hungarian_dispatch(np.zeros(allowed.shape), free, allowed)


_REQUEST_ID, _START, _END = attrgetter("request_id"), attrgetter("start"), attrgetter("end")
_TOKEN_IDS, _NUM_TOKENS = attrgetter("token_ids"), attrgetter("num_tokens")
_OPEN_LOCATION = attrgetter("open.location")


def scan_chunks(
    batches, requests: dict, busy_requests: dict, tree: PrefixTree
) -> tuple[ChunkSet, dict]:
    """Check every chunk against the pool before anything changes, and sort them into a
    :class:`ChunkSet`: in place (a running request's chunk inside its open tail), running
    (one that fills or starts a segment) or new. Returns it and each new request's match.

    A decode batch of thousands of requests goes through here, so the running requests are
    read column by column (``map`` over attribute getters, array arithmetic), with no Python
    statement per chunk; only new requests (a prefix match each) are handled one by one.
    A running request's open tail holds ``num_tokens % segment_len`` tokens (an invariant
    of committed requests; requests of iterations in flight are refused first)."""
    chunks = [c for batch in batches for c in batch]
    n = len(chunks)
    if set(map(type, chunks)) != {Chunk}:
        for b, batch in enumerate(batches):
            for i, c in enumerate(batch):
                if not isinstance(c, Chunk):
                    raise fail(f"batches[{b}][{i}]", "a Chunk", c)
    request_ids = list(map(_REQUEST_ID, chunks))  # Chunk checked its own fields
    if len(set(request_ids)) != n:
        rid = next(r for r, k in Counter(request_ids).items() if k > 1)
        raise InvalidArgumentError(
            f"batches: expected each request at most once, got {rid!r} twice"
        )
    if busy_requests and not busy_requests.keys().isdisjoint(request_ids):
        for b, batch in enumerate(batches):
            for c in batch:
                if c.request_id in busy_requests:
                    raise IterationStateError(
                        f"batches[{b}]: request {c.request_id!r} is in iteration "
                        f"{busy_requests[c.request_id]} in flight"
                    )
    cols = np.zeros((6, n), dtype=np.int64)  # batch, start, end, open inst, slot, len
    cols[0] = np.repeat(np.arange(len(batches)), [len(batch) for batch in batches])
    cols[1] = np.fromiter(map(_START, chunks), dtype=np.int64, count=n)
    cols[2] = np.fromiter(map(_END, chunks), dtype=np.int64, count=n)
    token_ids = list(map(_TOKEN_IDS, chunks))
    states = list(map(requests.get, request_ids))
    running = np.fromiter(map(is_not, states, repeat(None)), dtype=bool, count=n)
    r_idx = np.flatnonzero(running)
    r_states = [states[i] for i in r_idx.tolist()]
    num_tokens = np.fromiter(map(_NUM_TOKENS, r_states), dtype=np.int64, count=len(r_idx))
    wrong = np.flatnonzero(num_tokens != cols[1, r_idx])
    if len(wrong):
        i = int(r_idx[wrong[0]])
        raise InvalidArgumentError(
            f"Chunk.start: request {request_ids[i]!r} has {int(num_tokens[wrong[0]])} tokens "
            f"in the pool, got start={int(cols[1, i])}"
        )
    seg = tree.segment_len
    open_len = num_tokens % seg
    with_open = np.flatnonzero(open_len)
    if len(with_open):
        opens = [r_states[k] for k in with_open.tolist()]
        o_idx, m = r_idx[with_open], len(with_open)
        # one pass over the (instance_id, slot_id) locations, flattened
        locs = np.fromiter(chain.from_iterable(map(_OPEN_LOCATION, opens)), np.int64, 2 * m)
        cols[3:5, o_idx] = locs.reshape(m, 2).T
        cols[5, o_idx] = open_len[with_open]
    fits = (open_len > 0) & (cols[2, r_idx] - cols[1, r_idx] + open_len < seg)
    in_place = np.zeros(n, dtype=bool)
    in_place[r_idx[fits]] = True
    planned: list = [None] * n
    for i in r_idx[~fits].tolist():  # a running chunk that fills or starts a segment
        planned[i] = PlannedChunk(states[i], int(cols[1, i]), int(cols[2, i]), token_ids[i], False)
    new, matches = [], {}
    for i in np.flatnonzero(~running).tolist():
        c = chunks[i]
        m = tree.match(c.token_ids[: c.start])
        if m.num_tokens < c.start:
            raise InvalidArgumentError(
                f"Chunk.start: new request {c.request_id!r} has only {m.num_tokens} cached "
                f"tokens, got start={c.start}"
            )
        matches[c.request_id] = m
        new.append((i, c))
    return ChunkSet(request_ids, states, token_ids, planned, cols, in_place, new), matches


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
