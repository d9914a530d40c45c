"""Step times of one instance: the :class:`StepTimer` interface the simulator needs, the
cluster's hardware/model spec, and the adapter to the scheduler's roofline cost model
(``tokenlake.scheduler.CostModel``, built on ``tokenlake.cluster.profiles``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenlake.cluster.profiles import HARDWARE, MODELS, HardwareProfile, ModelProfile

GPUS_PER_NODE = 8


class StepTimer(Protocol):
    def prefill_time(self, new_lens: Sequence[int], prefix_lens: Sequence[int]) -> float:
        """Seconds for one prefill iteration: request i computes ``new_lens[i]`` tokens after
        ``prefix_lens[i]`` cached ones."""
        ...

    def decode_time(self, ctx_lens: Sequence[int]) -> float:
        """Seconds for one decode iteration of requests with these context lengths."""
        ...

    def transfer_time(self, num_bytes: float) -> float:
        """Seconds to move ``num_bytes`` of KV from one instance to another (P -> D)."""
        ...


@dataclass(frozen=True)
class ClusterSpec:
    """Args: hardware / model names from ``tokenlake.cluster.profiles``; num_instances; tp: GPUs per
    instance (tensor parallel, the paper uses 2); mem_fraction_static: share of HBM for weights
    and KV (SGLang's default is about 0.88; the rest is the activation reserve); cache_tokens:
    KV tokens per instance if > 0, else derived from HBM."""

    hardware: str = "A100-80G"
    model: str = "LWM-Text-1M"
    num_instances: int = 4
    tp: int = 2
    mem_fraction_static: float = 0.88
    cache_tokens: int = 0  # > 0 overrides the KV capacity per instance (cache-size sweeps)
    # a measured profile (``--hardware-profile FILE``): used instead of the names' entries
    hardware_profile: HardwareProfile | None = None
    model_profile: ModelProfile | None = None
    timer_config: TimerConfig | None = None  # the measured profile's calibration

    def __post_init__(self) -> None:
        if self.hardware_profile is None and self.hardware not in HARDWARE:
            raise ValueError(f"ClusterSpec.hardware: expected one of {sorted(HARDWARE)}")
        if self.model_profile is None and self.model not in MODELS:
            raise ValueError(f"ClusterSpec.model: expected one of {sorted(MODELS)}")
        if self.num_instances < 1 or self.tp < 1 or not 0 < self.mem_fraction_static <= 1:
            raise ValueError("ClusterSpec: num_instances, tp >= 1; 0 < mem_fraction_static <= 1")
        if self.capacity_tokens <= 0:
            raise ValueError("ClusterSpec: the weights do not fit this instance")

    def node_of(self, instance: int) -> int:
        """The 8-GPU node an instance's GPUs sit on (instances fill nodes in order)."""
        return instance * self.tp // GPUS_PER_NODE

    @property
    def hw(self) -> HardwareProfile:
        return self.hardware_profile or HARDWARE[self.hardware]

    @property
    def mp(self) -> ModelProfile:
        return self.model_profile or MODELS[self.model]

    @property
    def kv_bytes_per_token(self) -> int:
        return self.mp.shape.kv_bytes_per_token

    @property
    def capacity_tokens(self) -> int:
        """KV tokens one instance can hold: HBM x fraction - weights, over KV bytes/token."""
        if self.cache_tokens > 0:
            return self.cache_tokens
        free = self.hw.mem_bytes * self.tp * self.mem_fraction_static - self.mp.weight_bytes
        return int(free // self.kv_bytes_per_token)


def instance_hardware(spec: ClusterSpec, mfu: float, mbu: float) -> HardwareProfile:
    """One instance (``tp`` GPUs) as a profile of *achievable* rates: peak FLOP/s x ``mfu``,
    HBM bandwidth x ``mbu``; memory and links add up over the GPUs."""
    hw, tp = spec.hw, spec.tp
    return HardwareProfile(
        f"{hw.name} x{tp} (achievable)",
        hw.peak_flops * tp * mfu,
        hw.mem_bandwidth * tp * mbu,
        hw.mem_bytes * tp,
        hw.intra_node_bandwidth * tp,
        hw.inter_node_bandwidth * tp,
        hw.net_latency_s,
    )


@dataclass(frozen=True)
class TimerConfig:
    """Calibration of the scheduler's roofline :class:`CostModel` to measured engines:
    achievable shares of peak FLOP/s and HBM bandwidth, and a fixed per-iteration overhead
    (kernel launches, sampling, scheduling; TP all-reduces fold into it). Chosen once against
    the published measurements cited in the README (``tokenlake.benchmarks.calibrate.crosscheck``).
    ``row_overhead_s``: a fixed cost per request (chunk) in each forward, the host-side work
    per row (batching, position and page tables, sampling); 0 for the GPU profiles, where it
    was not measured, fitted for a measured CPU profile (:mod:`.cpu_profile`)."""

    mfu: float = 0.65
    mbu: float = 0.8
    prefill_overhead_s: float = 10e-3
    decode_overhead_s: float = 2e-3
    row_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if not (0 < self.mfu <= 1 and 0 < self.mbu <= 1):
            raise ValueError("TimerConfig: 0 < mfu, mbu <= 1")
        if min(self.prefill_overhead_s, self.decode_overhead_s, self.row_overhead_s) < 0:
            raise ValueError("TimerConfig: overheads must be >= 0")


class CostModelTimer:
    """:class:`StepTimer` over ``tokenlake.scheduler.CostModel`` (issue #5's roofline): a
    forward is ``forward_time``; attention over a request's cached prefix is ``query_time``
    on the instance that holds it (local for the baselines)."""

    def __init__(self, spec: ClusterSpec, config: TimerConfig | None = None) -> None:
        from tokenlake.scheduler import CostModel

        self.spec = spec
        self.config = config or spec.timer_config or TimerConfig()
        self.hardware = instance_hardware(spec, self.config.mfu, self.config.mbu)
        self.cost = CostModel(self.hardware, spec.mp)

    def prefill_time(
        self,
        new_lens: Sequence[int],
        prefix_lens: Sequence[int],
        read_lens: Sequence[int] | None = None,
    ) -> float:
        """``read_lens[i]`` (default ``prefix_lens[i]``): prefix tokens request i reads from
        memory, fewer when a cascade kernel reads a prefix shared across the batch once."""
        t = self.config.prefill_overhead_s + self.forward_time([(0, n) for n in new_lens])
        reads = prefix_lens if read_lens is None else read_lens
        for n, p, r in zip(new_lens, prefix_lens, reads, strict=True):
            if p:
                t += self.cost.query_time(n, p, r)
        return t

    def decode_time(self, ctx_lens: Sequence[int], num_read_tokens: int | None = None) -> float:
        """``num_read_tokens`` (default: every context): KV tokens the step reads from memory,
        fewer when a batch's shared prefix is read once (cascade attention, page groups)."""
        # one row per request; prefix attention of all rows over their own contexts
        n, ctx = len(ctx_lens), int(sum(ctx_lens))
        t = self.config.decode_overhead_s + self.forward_time([(0, 1)] * n)
        return t + self.cost.query_time(1, ctx, num_read_tokens) if ctx else t

    def query_time(self, num_rows: int, num_kv_tokens: int) -> float:
        return self.cost.query_time(num_rows, num_kv_tokens)

    def forward_time(self, pieces: Sequence[tuple[int, int]]) -> float:
        """A forward over ``pieces`` (one per chunk), with the per-row host cost."""
        return self.cost.forward_time(pieces) + self.config.row_overhead_s * len(pieces)

    def transfer_time(self, num_bytes: float, same_node: bool = False) -> float:
        # Mooncake moves KV over the RDMA NICs; TokenLake's q/o and puts may use NVLink.
        return self.cost.transfer_time(num_bytes, same_node=same_node)


def make_timer(spec: ClusterSpec, config: TimerConfig | None = None) -> CostModelTimer:
    return CostModelTimer(spec, config)
