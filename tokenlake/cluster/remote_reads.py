"""Which segments small decodes read on another instance, by reader: the balancer copies a
hot one beside the instance that reads it remotely most, once hops are priced (see
:func:`tokenlake.cluster.balancer.plan_replications`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from tokenlake.tree.segment_table import SegmentTable

# a segment is copied to a reader that read it remotely at least this often (decayed)
MIN_REMOTE_READS = 2.0


class RemoteReads:
    """Decayed counts of the segments small decodes read on another instance, per reading
    instance (by segment key, at most ``max_keys``; the least read are forgotten first): the
    balancer copies a hot one beside its main reader (see ``plan_replications``). Each
    :meth:`record` ages every count by ``decay`` (a scale, as in ``AccessStats``)."""

    def __init__(self, num_instances: int, decay: float = 0.95, max_keys: int = 4096) -> None:
        self.num_instances, self.decay, self.max_keys = num_instances, decay, max_keys
        self.scale = 1.0
        self.counts: dict[int, np.ndarray] = {}

    def record(self, keys: Sequence[int], origin: int) -> None:
        """One small decode on ``origin`` read the segments ``keys`` on other instances."""
        self.scale /= self.decay
        if self.scale > 1e100:  # renormalise before overflow
            for counts in self.counts.values():
                counts /= self.scale
            self.scale = 1.0
        for key in keys:
            counts = self.counts.get(key)
            if counts is None:
                counts = self.counts[key] = np.zeros(self.num_instances)
            counts[origin] += self.scale
        if len(self.counts) > self.max_keys:
            keep = sorted(self.counts, key=lambda k: -self.counts[k].max())[: self.max_keys // 2]
            self.counts = {k: self.counts[k] for k in keep}

    def top_reader(self, key: int) -> tuple[int, float]:
        """``(instance, decayed reads)`` of the instance that read ``key`` remotely most
        (ties: the lowest id), or ``(-1, 0.0)``."""
        counts = self.counts.get(key)
        if counts is None:
            return -1, 0.0
        best = int(np.argmax(counts))
        return best, float(counts[best]) / self.scale


def record_remote_reads(
    remote: RemoteReads,
    table: SegmentTable,
    node_key: Callable[[int], int],
    origin: int,
    rows: np.ndarray,
    chosen_idx: np.ndarray,
    chosen_inst: np.ndarray,
) -> None:
    """Book a committed small decode: the table ``rows`` it read whose replica read (the
    chosen one where there were several) is not on ``origin`` and that are in the tree;
    ``node_key(row)`` names one."""
    rows = np.asarray(rows, dtype=np.int64)
    rows = rows[rows >= 0]
    rows = rows[table.in_tree[rows]]  # only shared segments can be copied
    if not len(rows):
        return
    where = table.rep_inst[rows, 0].astype(np.int64)
    chosen = dict(
        zip(np.asarray(chosen_idx).tolist(), np.asarray(chosen_inst).tolist(), strict=True)
    )
    if chosen:
        where = np.array(
            [chosen.get(r, w) for r, w in zip(rows.tolist(), where.tolist(), strict=True)]
        )
    far = rows[where != origin]
    if len(far):
        remote.record([node_key(int(r)) for r in far.tolist()], origin)
