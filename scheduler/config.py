"""The scheduler's frozen, validated configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenlake.errors import InvalidArgumentError

ELASTIC = "elastic"
XPYD = "xpyd"
COLOCATED = "colocated"
MODES = (ELASTIC, XPYD, COLOCATED)


def _positive_int(name: str, value: object, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidArgumentError(
            f"SchedulerConfig.{name}: expected an int >= {low}, got {value!r}"
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler batches one iteration.

    Args:
        num_instances: instances ``N`` (the pool's ``num_instances``).
        segment_len: segment length ``C`` (the pool's ``segment_len``).
        mode: ``"elastic"`` (PD-disaggregated batches, prefill DoP 1..N, the default);
            ``"xpyd"`` (fixed PD, the paper's TokenLake-xPyD: per iteration, prefill batches
            use at most ``P = num_prefill_instances`` instances in total and decode batches at
            most ``D = N - P``; which instances is still the pool dispatcher's choice, so the
            split is of capacity, not of fixed instance ids); ``"colocated"`` (no PD: mixed
            prefill/decode batches of DoP 1, Sarathi-style token budget).
        chunk_len: most new tokens of one prefill chunk; a multiple of ``C``. In colocated mode
            also the token budget of one instance per iteration (decode tokens included).
        max_prefill_tokens: prefill tokens admitted per iteration; 0 means ``chunk_len`` × the
            instances prefill may use. Asynchronous iterations: per instance of the decision
            (as the baselines' chunked-prefill size), not a share of a cluster-wide budget
            (which left one free instance of four elastic ones a quarter of it: ShareGPT-like
            at 16.8 req/s queued prompts for 2 s, 57% attainment; 95% per instance).
        num_prefill_instances: ``P`` of xPyD (``1 <= P < N``); ignored in other modes.
        tbt_slo: seconds allowed between two output tokens (``inf``: no SLO).
        input_token_slo: seconds allowed per input token of a prefill chunk (``inf``: no SLO).
        sync_iterations: one iteration at a time over the whole cluster (it lasts as long as
            its slowest batch, so while any decode runs every batch must also meet
            ``tbt_slo``). False: asynchronous iterations (docs/architecture.md#the-floors), one per batch, each on
            its own instances, decided as instances free up (:mod:`tokenlake.scheduler.lanes`).
        lane_tbt_fraction: asynchronous decode lanes are sized so a decode batch takes at most
            this share of ``tbt_slo`` alone on its GPUs. The rest covers waiting for a busy
            lane and the GPU share taken by other iterations' prefix queries on the same
            instances (a decode's attention runs on every holder). Measured (1,000 requests,
            elastic with one instance kept for prefill): at 1/2 ShareGPT-like at 16 req/s
            missed the TBT SLO (58% attainment, vs 99% at 1/3 and 1/4); at 1/4 the
            conversation trace at 2 req/s missed first-token deadlines (more lanes, less
            prefill: 43%, vs 99% at 1/3); LooGLE-/synthetic-like alike within 3 points.
        decode_steps: most decode steps one asynchronous decode iteration runs (vLLM's
            multi-step scheduling), fewer when its lane would then make a newly ready decode
            wait past the TBT SLO. Above 1 the steps before the last run on synthetic tokens
            (known ahead), so it is a simulator setting: it cuts the control-plane work per
            generated token, not what the hardware does.
        kv_watermark: share of the pool's slots left free when admitting a new request
            (vLLM's watermark), so running requests can grow before anything is preempted.
        output_reserve: share of a request's remaining output the admission reserves for it
            (1: the whole ``max_output_tokens``, as SGLang's admission; 0: only its prompt,
            as vLLM's, relying on preemption).
        admission_backfill: a new request that does not fit in memory yet is passed over by
            later ones that do (EDF order otherwise kept), until its first-token deadline
            passes; then admission blocks behind it, so it cannot starve. Without an
            input-token SLO (no deadline) admission always blocks (FCFS).
        defer_pending_prefix: a new request whose next uncached segment a prefill chunk in
            flight (or chosen before it in the same decision) is computing waits for that
            chunk's commit instead of computing the segment again (SGLang's in-batch prefix
            caching; :mod:`tokenlake.scheduler.pending`).
        compute_lanes: batches one synchronous iteration computes in parallel (0: one per
            instance). ``tokenlake serve`` on one host runs every instance's dense layers in
            one process, so there 1: an iteration is at most one prefill and one decode batch
            (DoP 1), their attention still spread over the instances holding their KV;
            splitting a batch would only add parts and merges, never parallel compute.
        max_dop: largest DoP of a prefill batch (0: every prefill instance). 1 where a batch
            cannot span instances' compute processes (``tokenlake serve --data-plane compute``).
    """

    num_instances: int
    segment_len: int
    mode: str = ELASTIC
    chunk_len: int = 4096
    max_prefill_tokens: int = 0
    num_prefill_instances: int = 0
    tbt_slo: float = math.inf
    input_token_slo: float = math.inf
    sync_iterations: bool = True
    lane_tbt_fraction: float = 1 / 3
    decode_steps: int = 1
    kv_watermark: float = 0.01
    output_reserve: float = 1.0
    admission_backfill: bool = True
    defer_pending_prefix: bool = True
    compute_lanes: int = 0
    max_dop: int = 0

    def __post_init__(self) -> None:
        _positive_int("num_instances", self.num_instances)
        _positive_int("segment_len", self.segment_len)
        _positive_int("chunk_len", self.chunk_len)
        _positive_int("max_prefill_tokens", self.max_prefill_tokens, 0)
        _positive_int("decode_steps", self.decode_steps)
        _positive_int("compute_lanes", self.compute_lanes, 0)
        _positive_int("max_dop", self.max_dop, 0)
        if self.mode not in MODES:
            raise InvalidArgumentError(
                f"SchedulerConfig.mode: expected one of {MODES}, got {self.mode!r}"
            )
        if self.chunk_len % self.segment_len:
            raise InvalidArgumentError(
                f"SchedulerConfig.chunk_len: expected a multiple of segment_len="
                f"{self.segment_len}, got {self.chunk_len}"
            )
        if self.mode == XPYD:
            _positive_int("num_prefill_instances", self.num_prefill_instances)
            if self.num_prefill_instances >= self.num_instances:
                raise InvalidArgumentError(
                    f"SchedulerConfig.num_prefill_instances: expected < num_instances="
                    f"{self.num_instances} (xPyD needs a decode instance), "
                    f"got {self.num_prefill_instances}"
                )
        for name in ("tbt_slo", "input_token_slo"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidArgumentError(
                    f"SchedulerConfig.{name}: expected positive seconds, got {value!r}"
                )
        for name in ("sync_iterations", "admission_backfill", "defer_pending_prefix"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(
                    f"SchedulerConfig.{name}: expected a bool, got {getattr(self, name)!r}"
                )
        for name, low_open in (
            ("lane_tbt_fraction", True),
            ("kv_watermark", False),
            ("output_reserve", False),
        ):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not (0 < value <= 1 if low_open else 0 <= value <= 1):
                allowed = "a number in (0, 1]" if low_open else "a number in [0, 1]"
                raise InvalidArgumentError(
                    f"SchedulerConfig.{name}: expected {allowed}, got {value!r}"
                )

    @property
    def parallel_instances(self) -> int:
        """Instances whose batches compute in parallel (``compute_lanes``, at most all)."""
        lanes = self.compute_lanes or self.num_instances
        return min(lanes, self.num_instances)

    @property
    def prefill_instances(self) -> int:
        """Instances prefill batches may use in total."""
        if self.mode == XPYD:
            return min(self.num_prefill_instances, self.parallel_instances)
        return self.parallel_instances

    @property
    def decode_instances(self) -> int:
        """Instances (= batches) decode batches may use in total; 0 in colocated mode."""
        if self.mode == COLOCATED:
            return 0
        return (
            min(self.num_instances - self.num_prefill_instances, self.parallel_instances)
            if self.mode == XPYD
            else self.parallel_instances
        )

    @property
    def max_prefill_dop(self) -> int:
        if self.mode == COLOCATED:
            return 1
        return min(self.prefill_instances, self.max_dop or self.prefill_instances)

    @property
    def prefill_token_budget(self) -> int:
        """Prefill tokens admitted per iteration (colocated: minus the decode tokens)."""
        if self.max_prefill_tokens:
            return self.max_prefill_tokens
        return self.chunk_len * self.prefill_instances
