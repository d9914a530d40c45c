"""A hardware profile measured on this machine's CPU, in the form the simulator consumes.

The GPU profiles are datasheet peaks scaled by a calibration (:class:`.step_timer.TimerConfig`)
and priced by the scheduler's roofline ``CostModel``. A CPU profile is the same model with
its numbers measured: the engines' own profiler times prefill and decode steps of the real
model engine (``tokenlake bench calibrate-cpu``, :mod:`tokenlake.benchmarks.calibrate.hardware`) and
:func:`fit_cpu_profile` chooses the roofline's effective FLOP/s and memory bandwidth, the
fixed cost per step and per row, and the hop (the fixed cost of one remote holder per step,
priced by the layered pricing as its link latency: ``hop / (2 x layers)`` each way) so that
the simulator's own step times reproduce the measured rows. ``host_cores`` is how many cores
the measured machine has and ``thread_speedup`` how much faster a step runs on all of them
than on one (a server's torch and kernel threads): the simulator shares the cores among the
busy processes of a CPU run, each at most that much faster than one core.
``control_plane`` is the control plane's cost model measured on the host
(:mod:`.control_plane_cost`; absent: the checked-in default). ``serving`` holds the serving path's CPU per request, per streamed token and per serving-loop
iteration in a real server process (``tokenlake serve``: HTTP, tokenizer, the stream, the
loop's sampling and books, and whatever else its instances cost beyond the engine), per
server shape, measured by :mod:`tokenlake.benchmarks.calibrate.serving`; none: all 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from tokenlake.benchmarks.sim.control_plane_cost import ControlPlaneCost
from tokenlake.benchmarks.sim.step_timer import ClusterSpec, CostModelTimer, TimerConfig
from tokenlake.cluster.profiles import GiB, HardwareProfile, ModelProfile

PREFILL, DECODE = "prefill", "decode"
FORMAT = "tokenlake-cpu-profile/1"
# shared memory between two processes of one host: only its bytes' order matters here
HOST_LINK_BYTES_PER_S = 10e9


class ServingCost(NamedTuple):
    """The serving path's CPU in a real ``tokenlake serve`` of ``num_instances`` instances on
    ``torch_threads`` threads: per request, per streamed token, per serving-loop iteration."""

    num_instances: int
    torch_threads: int
    request_s: float
    token_s: float
    iteration_s: float


class MeasuredRow(NamedTuple):
    """One timed step: ``batch`` requests computing ``new_len`` tokens each after
    ``prefix_len`` cached ones (decode: ``new_len`` 1, ``prefix_len`` the context)."""

    phase: str
    batch: int
    new_len: int
    prefix_len: int
    seconds: float


def model_profile_of(name: str, config) -> ModelProfile:
    """The simulator's :class:`ModelProfile` of a loaded model's ``ModelConfig``."""
    return ModelProfile(
        name, config.num_layers, config.hidden_size, config.num_q_heads, config.num_kv_heads,
        config.head_dim, config.intermediate_size, config.vocab_size, config.dtype,
    )  # fmt: skip


@dataclass(frozen=True)
class CpuProfile:
    """A fitted profile and the rows it was fitted to (see the module doc)."""

    name: str
    model: ModelProfile
    hardware: HardwareProfile
    timer: TimerConfig
    hop_s: float
    host_cores: int
    rows: tuple[MeasuredRow, ...] = ()
    thread_speedup: float = 1.0  # a step on every core's threads vs on one (wall time)
    serving: tuple[ServingCost, ...] = ()  # per server shape measured
    # the control plane's cost model measured on this host (None: the checked-in default)
    control_plane: ControlPlaneCost | None = None

    def serving_cost(self, num_instances: int) -> ServingCost:
        """The serving path's costs of a server with ``num_instances`` instances: the one
        measured with that many, else the nearest (none measured: all 0)."""
        if not self.serving:
            return ServingCost(num_instances, 1, 0.0, 0.0, 0.0)
        return min(self.serving, key=lambda c: (abs(c.num_instances - num_instances), c))

    def spec(self, num_instances: int = 1, cache_tokens: int = 0) -> ClusterSpec:
        """A cluster of ``num_instances`` instances of this profile (one core each)."""
        return ClusterSpec(
            self.hardware.name, self.model.name, num_instances, tp=1,
            mem_fraction_static=1.0, cache_tokens=cache_tokens,
            hardware_profile=self.hardware, model_profile=self.model, timer_config=self.timer,
        )  # fmt: skip

    def step_timer(self, num_instances: int = 1, cache_tokens: int = 0) -> CostModelTimer:
        return CostModelTimer(self.spec(num_instances, cache_tokens), self.timer)

    def predict(self, row: MeasuredRow, timer: CostModelTimer | None = None) -> float:
        """The simulator's seconds for a measured row's step."""
        timer = timer or self.step_timer()
        if row.phase == DECODE:
            return timer.decode_time([row.prefix_len] * row.batch)
        return timer.prefill_time([row.new_len] * row.batch, [row.prefix_len] * row.batch)

    def latency_model(self, max_dop: int):
        """The scheduler's latency model as ``tokenlake serve`` profiles it on this profile's
        engine: prefill batches at DoP 1..``max_dop`` (each the slowest sub-batch, timed
        alone), decode batches, and the hop."""
        from tokenlake.scheduler.cost_model import split_rows
        from tokenlake.scheduler.latency_model import ProfileRow, fit_latency_model

        timer = self.step_timer()
        rows = []
        for dop in range(1, max_dop + 1):
            for lengths in ((16,), (64,), (256,), (32, 32, 32), (128, 64), (200, 100, 50, 25)):
                t = max(
                    self.timer.prefill_overhead_s + timer.forward_time(sub)
                    for sub in split_rows(lengths, dop)
                )
                rows.append(ProfileRow(PREFILL, dop, lengths, t))
        for batch in (1, 2, 4, 8, 16, 32):
            rows.append(ProfileRow(DECODE, 1, (1,) * batch, timer.decode_time([0] * batch)))
        return fit_latency_model(rows, self.hop_s)

    def errors(self) -> list[float]:
        """Relative error of the fitted step time on each measured row."""
        timer = self.step_timer()
        return [self.predict(r, timer) / r.seconds - 1 for r in self.rows]

    def summary(self) -> dict:
        errs = self.errors()
        return {
            "peak_flops": self.hardware.peak_flops,
            "mem_bandwidth": self.hardware.mem_bandwidth,
            "prefill_overhead_s": self.timer.prefill_overhead_s,
            "decode_overhead_s": self.timer.decode_overhead_s,
            "row_overhead_s": self.timer.row_overhead_s,
            "hop_s": self.hop_s,
            "host_cores": self.host_cores,
            "thread_speedup": self.thread_speedup,
            "serving": [c._asdict() for c in self.serving],
            "max_abs_error": round(max(map(abs, errs)), 4) if errs else None,
        }

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "name": self.name,
            "model": dataclasses.asdict(self.model),
            "hardware": dataclasses.asdict(self.hardware),
            "timer": dataclasses.asdict(self.timer),
            "hop_s": self.hop_s,
            "host_cores": self.host_cores,
            "thread_speedup": self.thread_speedup,
            "serving": [c._asdict() for c in self.serving],
            **({"control_plane": self.control_plane.to_dict()} if self.control_plane else {}),
            "rows": [r._asdict() for r in self.rows],
        }

    @classmethod
    def from_json(cls, raw: dict) -> CpuProfile:
        """Raises ``ValueError`` naming the field that is missing or wrong."""
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
            raise ValueError(f"hardware profile: expected format {FORMAT!r}, got {got!r}")
        try:
            profile = cls(
                str(raw["name"]),
                ModelProfile(**raw["model"]),
                HardwareProfile(**raw["hardware"]),
                TimerConfig(**raw["timer"]),
                float(raw["hop_s"]),
                int(raw["host_cores"]),
                tuple(MeasuredRow(**r) for r in raw.get("rows", ())),
                float(raw.get("thread_speedup", 1.0)),
                tuple(ServingCost(**c) for c in raw.get("serving", ())),
                _control_plane(raw.get("control_plane")),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"hardware profile: bad or missing field: {e}") from None
        costs = [x for c in profile.serving for x in c[2:]]
        if not (
            profile.hop_s >= 0 and profile.host_cores >= 1 and profile.thread_speedup >= 1
            and min(costs, default=0.0) >= 0
        ):  # fmt: skip
            raise ValueError(
                f"hardware profile: expected hop_s and the serving costs >= 0, host_cores >= 1 "
                f"and thread_speedup >= 1, got {profile.hop_s!r}, {costs!r}, "
                f"{profile.host_cores!r}, {profile.thread_speedup!r}"
            )
        return profile


def _control_plane(raw) -> ControlPlaneCost | None:
    return None if raw is None else ControlPlaneCost.from_dict(raw, "hardware profile")


def load_cpu_profile(path) -> CpuProfile:
    """The profile in the JSON file at ``path``; ``ValueError`` naming the file and field."""
    import json
    from pathlib import Path

    try:
        return CpuProfile.from_json(json.loads(Path(path).read_text()))
    except (OSError, json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"hardware profile {str(path)!r}: {e}") from None


def _profile(name, model, x, hop_s, host_cores, rows) -> CpuProfile:
    inv_flops, inv_bw, prefill_oh, decode_oh, row_oh = (float(v) for v in x)
    hardware = HardwareProfile(
        f"CPU ({name}, measured)", 1.0 / inv_flops, 1.0 / inv_bw, 64 * GiB,
        HOST_LINK_BYTES_PER_S, HOST_LINK_BYTES_PER_S, hop_s / (2 * model.num_layers),
    )  # fmt: skip
    timer = TimerConfig(1.0, 1.0, prefill_oh, decode_oh, row_oh)
    return CpuProfile(name, model, hardware, timer, hop_s, host_cores, tuple(rows))


def fit_cpu_profile(
    name: str,
    model: ModelProfile,
    rows: list[MeasuredRow] | tuple[MeasuredRow, ...],
    hop_s: float,
    host_cores: int,
) -> CpuProfile:
    """The profile whose step times best match ``rows`` (least squares on the relative error;
    every parameter positive). Deterministic: the same rows give the same profile."""
    from scipy.optimize import least_squares

    rows = tuple(rows)
    if not rows or min(r.seconds for r in rows) <= 0:
        raise ValueError("rows: expected measured rows with seconds > 0")
    seconds = np.array([r.seconds for r in rows])
    # start: all of the smallest step fixed, all of the largest prefill's per token compute
    big = max((r for r in rows if r.phase == PREFILL), key=lambda r: r.batch * r.new_len)
    flops = model.linear_flops(big.batch * big.new_len) / big.seconds
    smallest = float(seconds.min())

    def residuals(logx: np.ndarray) -> np.ndarray:
        profile = _profile(name, model, np.exp(logx), hop_s, host_cores, rows)
        timer = profile.step_timer()
        return np.array([profile.predict(r, timer) for r in rows]) / seconds - 1

    # the roofline's max() makes the fit piecewise: start from a few memory bandwidths (the
    # bytes term bound or not) and keep the best
    fits = [
        least_squares(
            residuals,
            np.log([1 / flops, 1 / bandwidth, smallest / 2, smallest / 2, smallest / 10]),
            method="trf",
            max_nfev=400,
        )
        for bandwidth in (1e9, 1e10, 1e11, 100 * flops)
    ]
    best = min(fits, key=lambda f: float(np.sum(f.fun**2)))
    return _profile(name, model, np.exp(best.x), hop_s, host_cores, rows)
