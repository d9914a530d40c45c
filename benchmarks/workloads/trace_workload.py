"""Mooncake-schema traces as simulator workloads: time scaling for rate sweeps, arrival jitter
inside coarse timestamp buckets, re-blocking, and ids scoped to a session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.traces import load_trace
from benchmarks.workloads.request import SimRequest, Workload


@dataclass(frozen=True)
class TraceConfig:
    """How to replay a trace.

    Args:
        path: Mooncake-schema JSONL(.gz).
        limit / offset: replay requests ``offset : offset + limit`` (file order).
        rate: target mean request rate (req/s); arrivals are scaled by a constant factor so the
            replayed span gives this rate (``None`` keeps the trace's own timing).
        jitter_s: arrivals are bucketed every ``jitter_s`` seconds in the trace (the
            conversation trace: ~3 s); each gets a uniform offset inside its bucket, applied
            before scaling. 0 keeps the timestamps.
        block_size: tokens per ``hash_ids`` block in the file (512 for Mooncake traces).
        reblock: merge this many consecutive blocks into one (exact for chained ids: a group
            takes its last block's id).
        per_session_ids: ids are only unique within ``session_id``; give each session its own
            namespace.
        seed: jitter seed.
    """

    path: Path | str
    limit: int | None = None
    offset: int = 0
    rate: float | None = None
    jitter_s: float = 0.0
    block_size: int = 512
    reblock: int = 1
    per_session_ids: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"TraceConfig.rate: expected > 0, got {self.rate}")
        if self.jitter_s < 0 or self.offset < 0 or self.reblock < 1 or self.block_size < 1:
            raise ValueError("TraceConfig: jitter_s, offset >= 0; reblock, block_size >= 1")


def trace_workload(config: TraceConfig) -> Workload:
    """Load, re-block, namespace, jitter and time-scale a trace into a :class:`Workload`."""
    end = None if config.limit is None else config.offset + config.limit
    rows = load_trace(config.path, end)[config.offset :]
    if not rows:
        raise ValueError(f"trace {config.path}: no requests in the selected range")
    rng = np.random.default_rng(config.seed)
    remap: dict[tuple, int] = {}
    sessions: dict[str, int] = {}
    block = config.block_size * config.reblock
    arrivals = np.array([r.arrival_ms / 1e3 for r in rows])
    if config.jitter_s > 0:
        arrivals = arrivals + rng.uniform(0.0, config.jitter_s, len(rows))
    arrivals -= arrivals.min()
    scale = 1.0
    span = float(arrivals.max())
    if config.rate is not None and span > 0:
        scale = (len(rows) / config.rate) / span
    arrivals *= scale
    reqs = []
    for i, (row, t) in enumerate(zip(rows, arrivals, strict=True)):
        ids = list(row.hash_ids)
        if config.reblock > 1:  # a group is identified by its last block's chained id
            ids = [
                ids[min(j + config.reblock, len(ids)) - 1]
                for j in range(0, len(ids), config.reblock)
            ]
        scope = row.session_id if config.per_session_ids else None
        gids = tuple(remap.setdefault((scope, h), len(remap)) for h in ids)
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
    reqs.sort(key=lambda r: (r.arrival_s, r.rid))
    note = (
        f"{len(reqs)} requests of {Path(config.path).name} from #{config.offset}; "
        f"arrivals jittered in {config.jitter_s:g} s buckets, time x{scale:.3g}"
    )
    return Workload(Path(config.path).name.split(".")[0], tuple(reqs), block, note)
