"""Keeping a small decode where its pages are, once hops are priced.

A decode step computes one token per request, so its kernel work is small and each remote
holder's fixed cost (round trip, merge, per-layer signals) dominates it. Replica choice
(power of two choices on load, ``csrc/replica_choice.h``) spreads reads over replicas, which
suits big batches but costs a small decode one hop per replica it picks away from the
instance it runs on. With ``BalancerConfig.hop_bytes > 0``, an iteration that is one small
decode batch therefore reads a replica on an instance it reads anyway (one holding a page of
it with one replica, or its open tail; the one holding most first) whenever the two replicas
drawn include one (always, with two replicas), unless that instance's load exceeds the
balancer's ``overload_factor`` times the mean: no replica choice adds a holder then, and the
hop-priced dispatcher runs the batch on its home. With ``hop_bytes == 0`` nothing changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenlake.cluster.balancer import BalancerConfig
from tokenlake.planning.chunk_set import ChunkSet
from tokenlake.tree.segment_table import SegmentTable

# below any real load (between -1e300 and -2e300, finite): the replica choice's lower-load
# rule then takes a preferred instance over any other, and the loads it adds while choosing
# cannot lift one (they are absorbed)
_PREFERRED = -1e300


def is_small_decode(cs: ChunkSet, dops: Sequence[int], max_rows: int) -> bool:
    """One batch at DoP 1, every chunk one new token, at most ``max_rows`` of them."""
    return (
        len(dops) == 1
        and int(dops[0]) == 1
        and 0 < len(cs) <= max_rows
        and bool(np.all(cs.end - cs.start == 1))
    )


def fixed_tokens(
    cs: ChunkSet, table: SegmentTable, segment_len: int, num_instances: int
) -> np.ndarray:
    """``[N]`` prefix tokens the batch must read on each instance whatever the replica
    choice: its pages with one replica and its open tails."""
    fixed = np.zeros(num_instances)
    for i, state in enumerate(cs.states):
        pages = np.asarray(state.page_idx[: int(cs.start[i]) // segment_len], dtype=np.int64)
        one = pages[table.num_replicas[pages] == 1]
        np.add.at(fixed, table.rep_inst[one, 0], segment_len)
        if cs.open_len[i] > 0:
            fixed[int(cs.open_inst[i])] += int(cs.open_len[i])
    return fixed


def prefer_home(
    base_load: np.ndarray,
    cs: ChunkSet,
    dops: Sequence[int],
    table: SegmentTable,
    segment_len: int,
    live: Sequence[int],
    config: BalancerConfig,
    light: bool = False,
) -> np.ndarray:
    """The load the replica choice sees: ``base_load``, or for a small decode with hops
    priced, every instance it reads anyway marked preferred (the more it holds there, the
    more preferred), except those whose load exceeds ``overload_factor`` times the mean,
    unless the pool is ``light`` (at most one running request per instance: the recent
    load of a light stream sits on the instances that served it, and no instance queues
    behind another)."""
    if config.hop_bytes <= 0 or not is_small_decode(cs, dops, config.small_decode_rows):
        return base_load
    fixed = fixed_tokens(cs, table, segment_len, len(base_load))
    load = np.asarray(base_load, dtype=np.float64)
    mean = float(load[list(live)].mean()) if len(live) else 0.0
    ok = fixed > 0
    if mean > 0 and not light:
        ok &= load <= config.overload_factor * mean
    if not ok.any():
        return base_load
    out = load.copy()
    out[ok] = _PREFERRED * (1.0 + fixed[ok] / fixed.sum())
    return out
