"""Heavy-hitter-aware load balancing (paper §4.3): per-instance load over a sliding window,
decayed per-segment access counts, the top ``k·N·log N`` segments found by best-first search
from the root, and replication orders that move load off overloaded instances."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from tokenlake.cluster.remote_reads import MIN_REMOTE_READS, RemoteReads
from tokenlake.tree.prefix_tree import Location, Node, PrefixTree
from tokenlake.validate import check_bool, check_float, check_int


def coefficient_of_variation(values: np.ndarray) -> float:
    """std / mean (0 when the mean is 0)."""
    values = np.asarray(values, dtype=np.float64)
    mean = float(values.mean()) if values.size else 0.0
    return float(values.std() / mean) if mean > 0 else 0.0


@dataclass(frozen=True)
class BalancerConfig:
    """Args:
    window: iterations in the per-instance load window.
    decay: per-iteration decay of segment access counts (``0 < decay <= 1``).
    overload_factor: an instance is overloaded when its window load exceeds the mean by it.
    heavy_hitter_k: the heavy hitters are the top ``k·N·ln N`` segments (at least ``k·N``).
    max_replications: replication orders per decision (bounds copy traffic).
    interval: iterations between replication decisions (the heavy-hitter search costs).
    replicate: turn replication off to measure its effect.
    max_replica_fraction: extra copies stop being made once they hold this share of the
        pool's slots (replicas cost hit rate).
    recent_decay: per-iteration decay of the short-horizon load that replica choice uses
        (the window load lags; choosing on it herds every access to one replica).
    hop_bytes: what the fixed cost of one remote holder is worth in the dispatcher's
        traffic bytes (its measured seconds times the link's bytes per second); 0 prices
        traffic bytes only.
    small_decode_rows: with ``hop_bytes > 0``, an iteration that is one decode batch of at
        most this many requests reads replicas on its home instance
        (:mod:`tokenlake.cluster.locality`).
    """

    window: int = 64
    decay: float = 0.95
    overload_factor: float = 1.15
    heavy_hitter_k: float = 4.0
    max_replications: int = 32
    interval: int = 4
    replicate: bool = True
    max_replica_fraction: float = 0.1
    recent_decay: float = 0.9
    hop_bytes: float = 0.0
    small_decode_rows: int = 8

    def __post_init__(self) -> None:
        name = "BalancerConfig."
        ints = {
            "window": (1, 2**20),
            "max_replications": (0, 2**20),
            "interval": (1, 2**20),
            "small_decode_rows": (0, 2**20),
        }
        for field, (low, high) in ints.items():
            value = check_int(name + field, getattr(self, field), low=low, high=high + 1)
            object.__setattr__(self, field, value)
        floats = {  # field: (low, high, low_open, high_open)
            "decay": (0.0, 1.0, True, False),
            "overload_factor": (1.0, 1e6, False, False),
            "heavy_hitter_k": (0.0, 1e6, True, False),
            "max_replica_fraction": (0.0, 1.0, False, False),
            "recent_decay": (0.0, 1.0, False, True),
            "hop_bytes": (0.0, 1e15, False, False),
        }
        for field, (low, high, low_open, high_open) in floats.items():
            value = check_float(
                name + field,
                getattr(self, field),
                low=low,
                high=high,
                low_open=low_open,
                high_open=high_open,
            )
            object.__setattr__(self, field, value)
        object.__setattr__(self, "replicate", check_bool(name + "replicate", self.replicate))

    def num_heavy_hitters(self, num_instances: int) -> int:
        n = max(num_instances, 2)
        return max(1, math.ceil(self.heavy_hitter_k * n * math.log(n)))


class AccessStats:
    """Decayed access counts live in ``table.access`` scaled by ``table.access_scale``
    (= decay^-t), so an access adds ``rows · scale`` and nothing is rescanned each
    iteration; counts stay comparable and a read divides by the scale.

    Everything here changes only when an iteration commits (an aborted one leaves no trace):
    the decay step, the accesses, the per-instance load window, the short-horizon load and
    the history of per-window load CVs, of which the last ``history_len`` are kept (a ring
    buffer; their count and mean cover all of them).
    """

    def __init__(
        self,
        num_instances: int,
        tree: PrefixTree,
        config: BalancerConfig,
        history_len: int = 1024,
    ) -> None:
        self.config = config
        self.table = tree.table
        self.total_access_tokens = 0.0  # scaled, like table.access
        self._window: deque[np.ndarray] = deque(maxlen=config.window)
        self._window_sum = np.zeros(num_instances)
        self.cv_history: deque[float] = deque(maxlen=history_len)  # CV per block of `window`
        self.num_cv_windows = 0  # every block so far, also those the ring buffer dropped
        self._cv_sum = 0.0
        self._block = np.zeros(num_instances)
        self._block_len = 0
        self.recent_load = np.zeros(num_instances)  # EWMA over a few iterations, for PoT

    @property
    def scale(self) -> float:
        return self.table.access_scale

    @property
    def mean_cv(self) -> float:
        """Mean per-window load CV over every completed window (0 before the first)."""
        return self._cv_sum / self.num_cv_windows if self.num_cv_windows else 0.0

    def begin_iteration(self) -> None:
        table = self.table
        table.access_scale /= self.config.decay
        if table.access_scale > 1e100:  # renormalise before overflow
            table.access /= table.access_scale
            self.total_access_tokens /= table.access_scale
            table.access_scale = 1.0

    def record_accesses(self, idx: np.ndarray, rows: np.ndarray, access_tokens: float) -> None:
        """Segments ``idx`` (repeats add up) were read by ``rows`` query rows each;
        ``access_tokens`` is the sum of query rows × tokens read over those reads."""
        scale = self.table.access_scale
        np.add.at(self.table.access, idx, rows * scale)
        self.total_access_tokens += float(access_tokens) * scale

    def record_load(self, load: np.ndarray, live: list[int]) -> None:
        if len(self._window) == self._window.maxlen:
            self._window_sum -= self._window[0]
        self._window.append(load)
        self._window_sum += load
        self._block += load
        self._block_len += 1
        if self._block_len == self.config.window:
            cv = coefficient_of_variation(self._block[live])
            self.cv_history.append(cv)
            self.num_cv_windows += 1
            self._cv_sum += cv
            self._block[:] = 0
            self._block_len = 0
        self.recent_load = self.config.recent_decay * self.recent_load + load

    @property
    def window_load(self) -> np.ndarray:
        return self._window_sum.copy()

    def access_count(self, node: Node) -> float:
        return float(self.table.access[node.idx]) / self.table.access_scale


def heavy_hitters(tree: PrefixTree, k: int) -> list[Node]:
    """The ``k`` most accessed segments in the tree, best first (ties: lower table row first).

    One vectorized pass over the segment table's access counts (a partial sort), which beats
    walking the tree in Python once ``k`` is in the hundreds (``k·N·ln N`` at 64 instances
    is over 1,000).
    """
    table = tree.table
    rows = np.flatnonzero(table.in_tree & (table.access > 0) & (table.num_replicas > 0))
    if len(rows) > k:
        top = np.argpartition(-table.access[rows], k - 1)[:k]
        rows = rows[top]
    rows = rows[np.lexsort((rows, -table.access[rows]))]
    return [tree.node_at(i) for i in rows.tolist()]


class ReplicationOrder(NamedTuple):
    """Copy ``node`` from its replica ``source`` to instance ``destination`` (the pool
    reserves the slot there)."""

    node: Node
    source: Location
    destination: int


def plan_replications(
    tree: PrefixTree,
    stats: AccessStats,
    live: list[int],
    config: BalancerConfig,
    capacity_slots: int | None = None,
    failover: frozenset[int] | set[int] = frozenset(),
    remote: RemoteReads | None = None,
    light: bool = False,
) -> list[ReplicationOrder]:
    """This iteration's replication orders.

    Fail-over first: each heavy hitter whose key is in ``failover`` (it lost a replica with
    a dropped instance) gets one copy on the least-loaded live instance without one, whatever
    the load. Then, for each overloaded instance, its heavy hitters (most accessed first) are
    copied to the least-loaded live instance without a copy, while the estimated load says it
    helps. Last, with ``remote`` (hops priced), each heavy hitter that small decodes read
    remotely at least ``MIN_REMOTE_READS`` times gets a copy on its main reader, unless that
    reader holds one or is overloaded. All share the budget. ``light`` (at most one running
    request per instance): nobody queues, so load is not balanced and no reader counts as
    overloaded; only fail-over and hop copies are made.
    """
    if not config.replicate or len(live) < 2:
        return []
    budget = config.max_replications
    if capacity_slots is not None:
        in_pool = tree.num_nodes  # segments with a replica (not only in the host tier)
        if tree.tier.enabled:
            in_pool = int((tree.table.num_replicas > 0)[tree.table.in_tree].sum())
        extra = tree.num_replicas - in_pool
        budget = min(budget, int(config.max_replica_fraction * capacity_slots) - extra)
    if budget <= 0:
        return []
    load = stats.window_load
    mean = float(load[live].mean())
    threshold = np.inf if light else config.overload_factor * mean
    over = [i for i in sorted(live, key=lambda i: -load[i]) if load[i] > threshold]
    hop_pass = remote is not None and bool(remote.counts)
    if (not over and not failover and not hop_pass) or stats.total_access_tokens <= 0:
        return []
    hot = heavy_hitters(tree, config.num_heavy_hitters(len(live)))
    if not hot:
        return []
    table = tree.table
    idx = np.array([n.idx for n in hot], dtype=np.int64)
    num_rep = table.num_replicas[idx]
    rep_inst = table.rep_inst[idx]  # [k, max_replicas], -1 past num_rep
    tokens = np.array([len(n.tokens) for n in hot], dtype=np.float64)
    total = float(load[live].sum())
    node_loads = (table.access[idx] * tokens / stats.total_access_tokens * total).tolist()
    est = load.astype(np.float64)
    dead = np.ones(len(est), dtype=bool)
    dead[live] = False
    orders: list[ReplicationOrder] = []
    planned = np.zeros((len(hot), len(est)), dtype=bool)  # destinations ordered this time
    for h in [h for h, node in enumerate(hot) if node.key in failover]:
        n = int(num_rep[h])
        taken = dead.copy()
        taken[rep_inst[h, :n]] = True
        if len(orders) >= budget or taken.all():
            continue
        dst = int(np.argmin(np.where(taken, np.inf, est)))
        orders.append(ReplicationOrder(hot[h], hot[h].replicas[0], dst))
        planned[h, dst] = True
        est[rep_inst[h, :n]] -= node_loads[h] / n - node_loads[h] / (n + 1)
        est[dst] += node_loads[h] / (n + 1)
    for src in over:
        for h in np.flatnonzero((rep_inst == src).any(axis=1)).tolist():
            if len(orders) >= budget or est[src] <= threshold:
                break
            n = int(num_rep[h])
            taken = dead | planned[h]
            taken[rep_inst[h, :n]] = True
            if taken.all():
                continue
            node_load = node_loads[h]
            dst = int(np.argmin(np.where(taken, np.inf, est)))
            gain = node_load / n - node_load / (n + 1)
            if est[dst] + node_load / (n + 1) >= est[src] - gain:
                continue  # the copy would not lower the maximum
            r = int(np.flatnonzero(rep_inst[h, :n] == src)[0])
            source = Location(int(src), int(table.rep_slot[idx[h], r]))
            orders.append(ReplicationOrder(hot[h], source, dst))
            planned[h, dst] = True
            est[src] -= gain
            est[dst] += node_load / (n + 1)
    for h in range(len(hot)) if hop_pass else ():
        reader, reads = remote.top_reader(hot[h].key)
        n = int(num_rep[h])
        if len(orders) >= budget:
            break
        if reads < MIN_REMOTE_READS or dead[reader] or planned[h, reader]:
            continue
        if reader in rep_inst[h, :n] or est[reader] > threshold:
            continue
        orders.append(ReplicationOrder(hot[h], hot[h].replicas[0], reader))
        planned[h, reader] = True
        est[reader] += node_loads[h] / (n + 1)
    return orders
