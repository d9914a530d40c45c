"""Time of TokenLake iterations in the simulator, several in flight at once (item 4 of
"Asynchronous iterations": what asynchrony costs is in the model).

Each instance runs two things on one GPU (CUDA MPS): its compute engine (the iteration whose
sub-batch it runs: forwards, its own prefix-attention part, sampling overhead) and its query
and transfer engines, which serve the other instances' iterations (their queries' partial
attention over segments held here, and puts writing their new KV here) in arrival order.
When both are busy they share the GPU: the overlapping work runs at half speed each, so an
instance's own iteration is delayed by the foreign work it overlaps and that foreign work by
the iteration (``interference`` scales this: 1 is full sharing, 0 perfect overlap). An
iteration ends when every one of its sub-batches and every remote query it sent is done, and
no earlier than its q/o and put bytes take on NVLink or InfiniBand. With one iteration at a
time this is the synchronous model (a holder serves queries after its own forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tokenlake.bench.sim.step_timer import ClusterSpec, CostModelTimer


@dataclass(eq=False)
class Flight:
    """One iteration in flight: when each of its origins' compute ends, when its remote work
    ends, and what it read per instance (KV tokens, for the load timeline)."""

    payload: object
    start: float
    origin_end: dict[int, float]
    remote_end: float
    reads: np.ndarray
    version: int = 0  # bumped whenever an end moves (stale completion events are skipped)

    @property
    def end(self) -> float:
        return max(max(self.origin_end.values()), self.remote_end)


@dataclass
class InstanceState:
    """Per instance: the flight whose sub-batch its compute engine runs, and until when its
    query/transfer engines are busy with other instances' work."""

    n: int
    owner: list[Flight | None] = field(default_factory=list)
    foreign_until: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def __post_init__(self) -> None:
        self.owner = [None] * self.n
        self.foreign_until = np.zeros(self.n)


class TokenLakeTiming:
    def __init__(
        self, timer: CostModelTimer, spec: ClusterSpec, segment_len: int, interference: float = 1.0
    ) -> None:
        if not 0.0 <= interference <= 1.0:
            raise ValueError(f"interference: expected 0..1, got {interference}")
        self.timer, self.spec, self.segment_len = timer, spec, segment_len
        self.interference = interference
        n = spec.num_instances
        self.state = InstanceState(n)
        self.q_row_bytes = 2 * spec.mp.num_layers * spec.mp.shape.q_bytes_per_token_layer
        self.node = np.array([spec.node_of(i) for i in range(n)])
        hw = timer.hardware
        self.bw_near, self.bw_far, self.mem_bw = (
            hw.intra_node_bandwidth,
            hw.inter_node_bandwidth,
            hw.mem_bandwidth,
        )

    def start(self, plans, has_prefill: bool, now: float, payload: object) -> tuple[Flight, list]:
        """Start an iteration at ``now``. Returns its :class:`Flight` and the other flights
        whose end moved (their completion events must be rescheduled)."""
        n, seg, timer = self.spec.num_instances, self.segment_len, self.timer
        own = {}  # origin -> compute seconds of its sub-batch
        foreign = np.zeros(n)  # seconds of this iteration's work on each other instance
        entries, puts = [], []
        cfg = timer.config
        overhead = cfg.prefill_overhead_s if has_prefill else cfg.decode_overhead_s
        for qp, tp in zip(plans.query_plans, plans.transfer_plans, strict=True):
            o = qp.origin
            rows = np.diff(qp.q_indptr)
            first = qp.positions - qp.prefix_lens
            pieces = list(zip(first.tolist(), (first + rows).tolist(), strict=True))
            own[o] = own.get(o, 0.0) + overhead + timer.forward_time(pieces)
            if len(qp.entry_req):
                holders = np.repeat(qp.holder_ids, np.diff(qp.holder_indptr))
                tokens = (np.diff(qp.kv_indptr) - 1) * seg + qp.last_len
                entries.append((rows[qp.entry_req], tokens, holders, np.full(len(holders), o)))
            if len(tp.dst_ids):
                cum = np.concatenate([[0], np.cumsum(tp.run_len)])
                sent = cum[tp.dst_indptr[1:]] - cum[tp.dst_indptr[:-1]]
                puts.append((np.asarray(tp.dst_ids), sent, np.full(len(sent), o)))
        near, far = np.zeros(n), np.zeros(n)  # bytes each origin sends over NVLink / IB
        reads = np.zeros(n)
        if entries:
            rows, tokens, holders, origins = (np.concatenate(x) for x in zip(*entries, strict=True))
            reads = np.bincount(holders, weights=rows * tokens, minlength=n)
            one = rows == 1  # decode rows: one batched query per (holder, origin)
            for o in np.unique(origins):
                mine = origins == o
                dk = np.bincount(holders[mine & one], weights=tokens[mine & one], minlength=n)
                for h in np.flatnonzero(dk):
                    self._add_work(own, foreign, int(o), int(h), timer.query_time(1, int(dk[h])))
                for h, r, t in zip(
                    holders[mine & ~one], rows[mine & ~one], tokens[mine & ~one], strict=True
                ):
                    self._add_work(own, foreign, int(o), int(h), timer.query_time(int(r), int(t)))
            self._add_traffic(near, far, origins, holders, rows * self.q_row_bytes)
        if puts:
            dsts, sent, origins = (np.concatenate(x) for x in zip(*puts, strict=True))
            num_bytes = sent * self.spec.kv_bytes_per_token
            self._add_traffic(near, far, origins, dsts, num_bytes)
            remote = dsts != origins
            foreign += (
                np.bincount(dsts[remote], weights=num_bytes[remote], minlength=n) / self.mem_bw
            )
        return self.place(
            own, foreign, near / self.bw_near + far / self.bw_far, now, payload, reads
        )

    def _add_work(self, own: dict, foreign: np.ndarray, origin: int, holder: int, t: float) -> None:
        if holder == origin or holder in own:  # its own part, or a part of this same iteration
            own[holder] = own.get(holder, 0.0) + t
        else:
            foreign[holder] += t

    def place(self, own, foreign, net, now, payload, reads=None) -> tuple[Flight, list]:
        """Place an iteration started at ``now``: ``own[o]`` seconds of compute on each origin
        ``o``, ``foreign[h]`` seconds of its work on other instances, ``net[o]`` seconds its
        bytes take on the links. Returns its flight and the flights it delayed."""
        reads = np.zeros(self.spec.num_instances) if reads is None else reads
        st, alpha = self.state, self.interference
        moved = []
        flight = Flight(payload, now, {}, now + float(net.max(initial=0.0)), reads)
        for o, work in own.items():  # its compute overlaps the foreign work queued there
            backlog = max(0.0, st.foreign_until[o] - now)
            shared = alpha * min(work, backlog)
            flight.origin_end[o] = now + work + shared
            st.foreign_until[o] += shared
            st.owner[o] = flight
        for h in np.flatnonzero(foreign):
            q = float(foreign[h])
            begin = max(now, st.foreign_until[h])
            other = st.owner[h]
            overlap = 0.0
            if other is not None and other is not flight:
                overlap = alpha * min(q, max(0.0, other.origin_end[h] - begin))
                if overlap > 0:
                    other.origin_end[h] += overlap
                    other.version += 1
                    moved.append(other)
            st.foreign_until[h] = begin + q + overlap
            flight.remote_end = max(flight.remote_end, float(st.foreign_until[h]))
        return flight, list(dict.fromkeys(moved))

    def finish(self, flight: Flight) -> None:
        """The iteration completed: its instances' compute engines are free."""
        for o in flight.origin_end:
            if self.state.owner[o] is flight:
                self.state.owner[o] = None

    def _add_traffic(self, near, far, src, dst, num_bytes) -> None:
        """Add ``num_bytes[i]`` sent by ``src[i]`` to ``dst[i]`` (nothing when they are equal)."""
        n, remote = len(near), src != dst
        same = self.node[src] == self.node[dst]
        near += np.bincount(src[remote & same], weights=num_bytes[remote & same], minlength=n)
        far += np.bincount(src[remote & ~same], weights=num_bytes[remote & ~same], minlength=n)
