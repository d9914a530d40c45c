"""Mooncake-format traces as simulator workloads: time scaling for rate sweeps, arrival jitter
(inside coarse timestamp buckets, or Poisson gaps), re-blocking, session grouping and ids
scoped to a session."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from tokenlake.benchmarks.workloads.request import SimRequest, Workload
from tokenlake.benchmarks.workloads.traces import TraceError, TraceRequest, read_trace

SESSION_MODES = ("open", "closed", "auto")


@dataclass(frozen=True)
class TraceConfig:
    """How to replay a trace.

    Args:
        path: Mooncake-format JSONL (plain, .gz or .xz).
        limit / offset: replay requests ``offset : offset + limit`` (file order).
        rate: target mean request rate (req/s); arrivals are scaled by one factor so the
            replayed span gives this rate. ``None`` keeps the trace's timing times
            ``time_scale``.
        time_scale: multiply the trace's timestamps (0.5 replays twice as fast); only
            without ``rate``.
        jitter_s: arrivals are bucketed every ``jitter_s`` seconds in the trace (the
            conversation trace: ~3 s); each gets a uniform offset inside its bucket, applied
            before scaling. 0 keeps the timestamps.
        poisson: redraw the gaps between arrivals as exponential with the trace's mean rate,
            keeping the order (for traces whose arrivals are a Poisson process already).
        block_size: tokens per ``hash_ids`` block; ``None`` reads it from the trace or infers
            it (:func:`tokenlake.benchmarks.workloads.traces.resolve_block_size`).
        reblock: merge this many consecutive blocks into one (exact for chained ids: a group
            takes its last block's id).
        per_session_ids: ids are only unique within ``session_id``; give each session its own
            namespace.
        sessions: ``"open"`` (every request arrives at its timestamp) or ``"closed"`` (a
            session's next turn is sent when its previous turn finished, after the gap
            between their timestamps, scaled: the trace's think time plus response time) or
            ``"auto"`` (closed when the trace has session ids, else open: an open-loop
            replay compressed in time would overlap an agent's consecutive turns).
        seed: jitter seed.
    """

    path: Path | str
    limit: int | None = None
    offset: int = 0
    rate: float | None = None
    time_scale: float = 1.0
    jitter_s: float = 0.0
    poisson: bool = False
    block_size: int | None = None
    reblock: int = 1
    per_session_ids: bool = False
    sessions: str = "open"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"TraceConfig.rate: expected > 0, got {self.rate}")
        if not self.time_scale > 0:
            raise ValueError(f"TraceConfig.time_scale: expected > 0, got {self.time_scale}")
        if self.jitter_s < 0 or self.offset < 0 or self.reblock < 1:
            raise ValueError("TraceConfig: jitter_s, offset >= 0; reblock >= 1")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"TraceConfig.block_size: expected >= 1, got {self.block_size}")
        if self.sessions not in SESSION_MODES:
            raise ValueError(
                f"TraceConfig.sessions: expected one of {SESSION_MODES}, got {self.sessions!r}"
            )


def _arrivals(rows: list[TraceRequest], config: TraceConfig) -> tuple[np.ndarray, float]:
    """Arrival seconds (from 0) after jitter or Poisson redraw and scaling, and the scale."""
    rng = np.random.default_rng(config.seed)
    t = np.array([r.arrival_ms / 1e3 for r in rows])
    if config.jitter_s > 0:
        t = t + rng.uniform(0.0, config.jitter_s, len(rows))
    t -= t.min()
    if config.poisson and len(rows) > 1:
        order = np.argsort(t, kind="stable")
        gaps = rng.exponential(t.max() / (len(rows) - 1) or 1.0, len(rows) - 1)
        t[order] = np.concatenate([[0.0], np.cumsum(gaps)])
    scale = config.time_scale
    span = float(t.max())
    if config.rate is not None and span > 0:
        scale = (len(rows) / config.rate) / span
    return t * scale, scale


def trace_workload(config: TraceConfig) -> Workload:
    """Load, validate, re-block, namespace, jitter, time-scale and group a trace."""
    end = None if config.limit is None else config.offset + config.limit
    rows, block_size = read_trace(config.path, end, config.block_size)
    rows = rows[config.offset :]
    name = Path(config.path).name
    if not rows:
        raise TraceError(f"{name}: no requests at offset {config.offset}")
    arrivals, scale = _arrivals(rows, config)
    remap: dict[tuple, int] = {}
    sessions: dict[str, int] = {}
    reqs = []
    for i, (row, t) in enumerate(zip(rows, arrivals, strict=True)):
        scope = row.session_id if config.per_session_ids else None
        keys = [(scope, h) for h in row.hash_ids]
        if len(keys) < row.num_blocks(block_size):  # unhashed partial tail: unique tokens
            keys.append(("tail", row.line_no))
        if config.reblock > 1:  # a group is identified by its last block's chained id
            k = config.reblock
            keys = [keys[min(j + k, len(keys)) - 1] for j in range(0, len(keys), k)]
        gids = tuple(remap.setdefault(key, len(remap)) for key in keys)
        session = (
            -1 if row.session_id is None else sessions.setdefault(row.session_id, len(sessions))
        )
        reqs.append(
            SimRequest(
                rid=i,
                arrival_s=float(t),
                input_len=row.input_len,
                output_len=max(1, row.output_len),
                block_ids=gids,
                session=session,
            )
        )
    mode = config.sessions
    if mode == "auto":
        mode = "closed" if sessions else "open"
    if mode == "closed":
        reqs = _close_sessions(reqs)
    reqs.sort(key=lambda r: (r.arrival_s, r.rid))
    how = "Poisson gaps" if config.poisson else f"jittered in {config.jitter_s:g} s buckets"
    note = (
        f"{len(reqs)} requests of {name} from #{config.offset}; block size {block_size}; "
        f"arrivals {how}, time x{scale:.3g}; sessions {mode}"
    )
    return Workload(name.split(".")[0], tuple(reqs), block_size * config.reblock, note)


def _close_sessions(reqs: list[SimRequest]) -> list[SimRequest]:
    """Chain each session's turns: turn k+1 waits for turn k, then the gap between them."""
    previous: dict[int, SimRequest] = {}  # session -> its latest turn (trace arrival)
    out = []
    for r in sorted(reqs, key=lambda r: (r.arrival_s, r.rid)):
        prev = previous.get(r.session) if r.session >= 0 else None
        if r.session >= 0:
            previous[r.session] = r
        if prev is not None:
            r = replace(r, after=prev.rid, delay_s=r.arrival_s - prev.arrival_s)
        out.append(r)
    return out
