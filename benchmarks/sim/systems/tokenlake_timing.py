"""Time of TokenLake iterations in the simulator, several in flight at once (item 4 of
"Asynchronous iterations": what asynchrony costs is in the model).

Each instance runs three engines on one GPU (CUDA MPS, paper §3.3): the compute engine (the
sub-batch an iteration runs there: forwards, its own part of the prefix attention, sampling
overhead), and the query and transfer engines serving other instances' iterations (partial
attention over the segments held here, puts writing new KV here), on concurrent streams.
Everything running on an instance at once shares its GPU equally (processor sharing): a
decode lane slows down while it serves a long prefill's prefix queries, and that prefill's
queries wait for the lane's share. An iteration ends when all of its work on every instance
is done. How its distributed attention is priced (``PricingConfig.dist_attn``): ``layered``
(the default, :mod:`.layered`): layer by layer, the origin waits for its holders' parts
(latency, link shares, launches, merge), and every link is processor-shared like a GPU;
``overlap`` (the older pricing): no earlier than its q/o and put bytes take on NVLink or
InfiniBand, links not shared. Either way the control plane's time before the iteration
(``delay``: its CPU time and the dispatch RPC) shifts its end. With one iteration at a time
this is close to the synchronous model, where a holder's queries and its own forward add up.

A decode iteration may run several steps per request (the scheduler's ``decode_steps``):
its steps are priced one after another, each reading every context once.
"""

from __future__ import annotations

import numpy as np

from tokenlake.benchmarks.sim.step_timer import ClusterSpec, CostModelTimer
from tokenlake.benchmarks.sim.systems.layered import (
    LAYERED,
    NUM_LINKS,
    LayeredPricing,
    PricingConfig,
)
from tokenlake.benchmarks.sim.systems.shared_servers import (  # noqa: F401 (SharedGPU re-exported)
    _EPS,
    HOST,
    Flight,
    SharedGPU,
    SharedHost,
)


class TokenLakeTiming:
    def __init__(
        self,
        timer: CostModelTimer,
        spec: ClusterSpec,
        segment_len: int,
        page_groups: bool = True,
        pricing: PricingConfig | None = None,
        host: SharedHost | None = None,
    ) -> None:
        """``page_groups`` False: decode rows each read their own pages (no shared-page
        groups), to show what the groups alone are worth. ``pricing``: how distributed
        attention is priced (default: layer by layer). ``host``: the instances run in one
        thread on this CPU host (``tokenlake serve``'s in-process data plane) instead of
        each on its own device: an iteration's work on every instance, its links and its
        waits for remote parts add up to one task there."""
        self.timer, self.spec, self.segment_len = timer, spec, segment_len
        self.page_groups = page_groups
        self.host = host
        n = spec.num_instances
        pricing = pricing or PricingConfig()
        self.layers = None
        if pricing.dist_attn == LAYERED:
            self.layers = LayeredPricing(spec, timer.hardware, pricing)
        num_links = NUM_LINKS * n if self.layers else 0
        self.servers = [SharedGPU() for _ in range(n + num_links)]  # GPUs, then links
        self.gpus = self.servers[:n]
        self.q_row_bytes = 2 * spec.mp.num_layers * spec.mp.shape.q_bytes_per_token_layer
        self.node = np.array([spec.node_of(i) for i in range(n)])
        self.kv_bytes_per_token = spec.kv_bytes_per_token
        self._query_time = timer.cost.query_time
        self._decode_step: dict[int, float] = {}  # batch size -> overhead + forward (memo)
        hw = timer.hardware
        self.bw_near, self.bw_far, self.mem_bw = (
            hw.intra_node_bandwidth,
            hw.inter_node_bandwidth,
            hw.mem_bandwidth,
        )

    def start(
        self,
        plans,
        has_prefill: bool,
        now: float,
        payload: object,
        delay: float = 0.0,
        host_extra_s: float = 0.0,
    ) -> tuple[Flight, list]:
        """Start an iteration at ``now``, ``delay`` seconds of control plane ahead of it.
        Returns its :class:`Flight` and the other flights whose end moved (their completion
        events must be rescheduled). ``host_extra_s``: more work of the same thread on a
        shared host (the serving path's, for the tokens this iteration streams)."""
        n, seg, timer = self.spec.num_instances, self.segment_len, self.timer
        work = np.zeros(n)  # seconds of this iteration's work on each instance (full speed)
        entries, puts, num_steps = [], [], 1
        cfg = timer.config
        overhead = cfg.prefill_overhead_s if has_prefill else cfg.decode_overhead_s
        dense = np.zeros(n)  # each origin's forwards (fixed cost, dense layers)
        all_pieces, step_rows = [], np.zeros(0, dtype=np.int64)  # every sub-batch's rows
        for qp, tp in zip(plans.query_plans, plans.transfer_plans, strict=True):
            o = qp.origin
            rows = qp.q_indptr[1:] - qp.q_indptr[:-1]
            if has_prefill:
                first = qp.positions - qp.prefix_lens
                pieces = list(zip(first.tolist(), (first + rows).tolist(), strict=True))
                dense[o] += overhead + timer.forward_time(pieces)
                all_pieces += pieces
            else:  # decode steps, one after another (several per request: multi-step)
                batch = np.bincount(rows, minlength=int(rows.max()) + 1)[::-1].cumsum()[::-1]
                num_steps = max(num_steps, len(batch) - 1)
                for num in batch[1:].tolist():  # requests still decoding at each step
                    dense[o] += self._decode_step_time(num, overhead)
                step_rows = _add_padded(step_rows, batch[1:])
            if len(qp.entry_req):
                holders = np.repeat(qp.holder_ids, qp.holder_indptr[1:] - qp.holder_indptr[:-1])
                tokens = (qp.kv_indptr[1:] - qp.kv_indptr[:-1] - 1) * seg + qp.last_len
                read = None
                if not has_prefill and self.page_groups:
                    read = self.grouped_reads(qp, rows[qp.entry_req], holders)
                entries.append((rows[qp.entry_req], tokens, holders, o, read))
            if len(tp.dst_ids):
                cum = np.concatenate([[0], np.cumsum(tp.run_len)])
                sent = cum[tp.dst_indptr[1:]] - cum[tp.dst_indptr[:-1]]
                puts.append((np.asarray(tp.dst_ids), sent, np.full(len(sent), o)))
        work += dense
        near, far = np.zeros(n), np.zeros(n)  # bytes each origin sends over NVLink / IB
        reads = np.zeros(n)
        att, q_rows, put_bytes = np.zeros((n, n)), np.zeros((n, n)), np.zeros((n, n))
        if entries:
            self._queries(att, entries, has_prefill)
            work += att.sum(axis=0)
            rows = np.concatenate([e[0] for e in entries])
            tokens = np.concatenate([e[1] for e in entries])
            holders = np.concatenate([e[2] for e in entries])
            origins = np.repeat([e[3] for e in entries], [len(e[2]) for e in entries])
            reads = np.bincount(holders, weights=rows * tokens, minlength=n)
            self._add_traffic(near, far, origins, holders, rows * self.q_row_bytes)
            np.add.at(q_rows, (origins, holders), rows)
        if puts:
            dsts, sent, origins = (np.concatenate(x) for x in zip(*puts, strict=True))
            num_bytes = sent * self.kv_bytes_per_token
            self._add_traffic(near, far, origins, dsts, num_bytes)
            np.add.at(put_bytes, (origins, dsts), num_bytes)
            remote = dsts != origins
            work += np.bincount(dsts[remote], weights=num_bytes[remote], minlength=n) / self.mem_bw
        if self.host is not None:
            # one process runs every sub-batch's rows in one ragged forward (the in-process
            # data plane): one fixed cost and one pass over the weights per step, not one
            # per instance; the queries and puts stay as they are
            work = work - dense
            work[0] += host_extra_s
            if has_prefill:
                work[0] += overhead + timer.forward_time(all_pieces)
            else:
                work[0] += sum(self._decode_step_time(int(k), overhead) for k in step_rows)
        if self.layers is None:
            net = near / self.bw_near + far / self.bw_far
            return self.place(work, float(net.max(initial=0.0)), now, payload, reads, delay=delay)
        load = np.array([len(s.tasks) + 1 for s in self._advanced(now)])
        extra, stall = self.layers.stalls(att, q_rows, num_steps, load)
        links = self.layers.link_work(q_rows, put_bytes)
        work = np.concatenate([work + extra, links])
        return self.place(work, 0.0, now, payload, reads, stall, delay)

    def _advanced(self, now: float) -> list[SharedGPU]:
        for server in self.servers:
            server.advance(now)
        return self.servers

    def _decode_step_time(self, batch_size: int, overhead: float) -> float:
        t = self._decode_step.get(batch_size)
        if t is None:
            t = overhead + self.timer.forward_time([(0, 1)] * batch_size)
            self._decode_step[batch_size] = t
        return t

    def _queries(self, att: np.ndarray, entries: list, has_prefill: bool) -> None:
        """Add each holder's prefix-attention time to ``att[origin, holder]``: decode rows as
        one batched query per (origin, holder) and step, prefill rows one query per request."""
        n, query_time = len(att), self._query_time
        for o in sorted({e[3] for e in entries}):
            mine = [e for e in entries if e[3] == o]
            rows = np.concatenate([e[0] for e in mine])
            tokens = np.concatenate([e[1] for e in mine])
            holders = np.concatenate([e[2] for e in mine])
            if not has_prefill:
                dk = np.bincount(holders, weights=tokens * rows, minlength=n)
                grouped = [e[4] for e in mine if e[4] is not None]
                read = sum(grouped) if grouped else dk
                for h in np.flatnonzero(dk).tolist():
                    att[o, h] += query_time(1, int(dk[h]), int(read[h]))
                continue
            one = rows == 1
            dk = np.bincount(holders[one], weights=(tokens * rows)[one], minlength=n)
            for h in np.flatnonzero(dk).tolist():
                att[o, h] += query_time(1, int(dk[h]))
            many = ~one
            for h, r, t in zip(
                holders[many].tolist(), rows[many].tolist(), tokens[many].tolist(), strict=True
            ):
                att[o, h] += query_time(r, t)

    def grouped_reads(self, qp, steps: np.ndarray, holders: np.ndarray) -> np.ndarray:
        """KV tokens each holder reads for one decode sub-batch whose rows that read the same
        page run as one group (the data plane's shared-page grouping): every distinct
        (page, valid length) once per step, for as many steps as its longest reader. (The data
        plane runs a part as it is when its rows would take part in more than
        ``MAX_STATES_PER_ROW`` groups each, which decode parts rarely do; not modelled.)"""
        seg, n = self.segment_len, self.spec.num_instances
        num_pages = qp.kv_indptr[1:] - qp.kv_indptr[:-1]
        if not len(qp.kv_indices):
            return np.zeros(n)
        entry = np.repeat(np.arange(len(num_pages)), num_pages)
        valid = np.full(len(qp.kv_indices), seg, dtype=np.int64)
        has = num_pages > 0
        valid[qp.kv_indptr[1:][has] - 1] = qp.last_len[has]
        key = (holders[entry].astype(np.int64) << 32 | qp.kv_indices.astype(np.int64)) * (
            seg + 1
        ) + valid
        # distinct keys ascending, each with the most steps of its readers: one sort
        order = np.argsort(key, kind="stable")
        key = key[order]
        first = np.empty(len(key), dtype=bool)
        first[0] = True
        np.not_equal(key[1:], key[:-1], out=first[1:])
        starts = np.flatnonzero(first)
        unique = key[starts]
        most = np.maximum.reduceat(steps[entry][order], starts)
        holder = (unique // (seg + 1)) >> 32
        return np.bincount(holder, weights=(unique % (seg + 1)) * most, minlength=n)

    def place(
        self,
        work,
        net: float,
        now: float,
        payload: object = None,
        reads=None,
        stall: dict[int, float] | None = None,
        delay: float = 0.0,
    ):
        """Place an iteration started at ``now`` with ``work[i]`` seconds (at full speed) on
        each server (instances, then links), ``net`` seconds of bytes on the wire, each
        origin's ``stall`` after its work and ``delay`` before it. Returns its flight and
        the flights it delayed."""
        reads = np.zeros(len(self.gpus)) if reads is None else reads
        if self.host is not None:  # one thread does it all, one thing after another
            total = float(np.sum(work)) + net + sum((stall or {}).values())
            flight = Flight(payload, now, now, reads, delay=delay)
            work, servers = {HOST: total}, {HOST: self.host}
        else:
            flight = Flight(payload, now, now + net, reads, stall=stall or {}, delay=delay)
            servers = self.servers
        moved: dict[int, Flight] = {}
        busy = list(work) if self.host is not None else np.flatnonzero(np.asarray(work) > 0)
        for i in busy:
            gpu = servers[int(i)]
            gpu.advance(now)
            gpu.add(flight, float(work[i]))
            for f, end in gpu.finishes().items():
                if f is not flight and end > f.work_end.get(int(i), end) + _EPS:
                    f.version += 1
                    moved[f.id] = f
                f.work_end[int(i)] = end
        return flight, list(moved.values())

    def finish(self, flight: Flight) -> list[Flight]:
        """The iteration completed at its end: its work is done everywhere. Returns the
        flights on a shared host that now end earlier (their completion events must be
        rescheduled; on devices a leaving task's speed-up is not passed on)."""
        moved = []
        for i in flight.work_end:
            gpu = self.host if i == HOST else self.servers[i]
            gpu.advance(flight.end)
            gpu.tasks.pop(flight, None)
            if i != HOST:
                continue
            for f, end in gpu.finishes().items():
                if end < f.work_end.get(HOST, end) - _EPS:
                    f.version += 1
                    f.work_end[HOST] = end
                    moved.append(f)
        return moved

    def _add_traffic(self, near, far, src, dst, num_bytes) -> None:
        """Add ``num_bytes[i]`` sent by ``src[i]`` to ``dst[i]`` (nothing when they are equal)."""
        remote = src != dst
        if not remote.any():
            return
        n, same = len(near), self.node[src] == self.node[dst]
        for out, mask in ((near, remote & same), (far, remote & ~same)):
            out += np.bincount(src[mask], weights=num_bytes[mask], minlength=n)


def _add_padded(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise sum of two vectors, the shorter padded with zeros."""
    out = np.zeros(max(len(a), len(b)), dtype=np.int64)
    out[: len(a)] += a
    out[: len(b)] += b
    return out
