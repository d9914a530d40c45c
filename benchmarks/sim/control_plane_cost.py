"""What TokenLake's control plane costs in simulated time: a calibrated cost model (the
default) or the live measurement.

The control plane (the scheduler's ``step()``, which runs ``gen_plans``, and ``complete()``,
which commits) runs on the host CPU while the simulated GPUs wait for its plans. Charging
its measured CPU time as the simulation runs made a result depend on the machine's load
and speed at that moment: the same command gave different figures on a busy machine. The
default charges a cost model instead: per kind of call (a ``step()`` that found nothing to
start, a decode or a prefill iteration planned, the ``complete()`` of either), a linear
function of what the call handles (requests in the scheduler, chunks, prefix pages planned,
sub-batches, tokens), fitted once by non-negative least squares to the thread CPU time the
calls took on a real run (``tokenlake bench calibrate-control-plane``) and stored, with the
machine it was measured on, in the host profile ``benchmarks/data/control_plane_cost.json``
(checked in). Every run then charges the same seconds for the same calls: the same command
gives the same results on any machine. ``live`` (``--control-plane live``) charges each
call's measured thread CPU time, as before.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "tokenlake-control-plane-cost/1"
MODEL, LIVE = "model", "live"
CONTROL_PLANES = (MODEL, LIVE)
IDLE, DECODE, PREFILL = "idle", "decode", "prefill"
COMPLETE_DECODE, COMPLETE_PREFILL = "complete_decode", "complete_prefill"
KINDS = (IDLE, DECODE, PREFILL, COMPLETE_DECODE, COMPLETE_PREFILL)
FEATURES = ("call", "requests", "chunks", "pages", "sub_batches", "tokens")
DEFAULT_PATH = Path(__file__).resolve().parent.parent / "data" / "control_plane_cost.json"


class ControlPlaneCostError(ValueError):
    """A cost model file or value that cannot be used: the message names it."""


def call_features(num_requests: int, iteration, completing: bool) -> tuple[str, tuple]:
    """(kind, features) of one control-plane call: ``iteration`` is what ``step()`` returned
    (None: nothing to start) or what ``complete()`` committed; ``num_requests`` the
    scheduler's unfinished requests when the call began."""
    if iteration is None:
        return IDLE, (1, num_requests, 0, 0, 0, 0)
    decision, plans = iteration.decision, iteration.plans
    prefill = any(p != "decode" for p in decision.phases)
    kind = (PREFILL if prefill else DECODE) if not completing else (
        COMPLETE_PREFILL if prefill else COMPLETE_DECODE
    )  # fmt: skip
    chunks = decision.chunks
    pages = sum(len(qp.kv_indices) for qp in plans.query_plans)
    tokens = sum(c.end - c.start for c in chunks)
    return kind, (1, num_requests, len(chunks), pages, len(plans.query_plans), tokens)


@dataclass(frozen=True)
class ControlPlaneCost:
    """Seconds per call: ``coefficients[kind]`` (one per :data:`FEATURES`) times the call's
    features. ``measured_on``: the machine the coefficients were fitted on; ``num_samples``
    and ``r2`` per kind: how many calls, and how much of their spread the fit explains (the
    sum over calls, what a run is charged, is what the fit matches)."""

    coefficients: tuple[tuple[str, tuple[float, ...]], ...]
    measured_on: str = ""
    num_samples: tuple[tuple[str, int], ...] = ()
    r2: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        got = dict(self.coefficients)
        if sorted(got) != sorted(KINDS):
            raise ControlPlaneCostError(
                f"ControlPlaneCost.coefficients: expected the kinds {KINDS}, got {sorted(got)}"
            )
        for kind, coef in got.items():
            if len(coef) != len(FEATURES) or not all(0 <= c < float("inf") for c in coef):
                raise ControlPlaneCostError(
                    f"ControlPlaneCost.coefficients[{kind!r}]: expected {len(FEATURES)} "
                    f"numbers >= 0 ({', '.join(FEATURES)}), got {coef!r}"
                )

    def seconds(self, kind: str, features: Sequence[float]) -> float:
        coef = dict(self.coefficients)[kind]
        return float(sum(c * f for c, f in zip(coef, features, strict=True)))

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "measured_on": self.measured_on,
            "features": list(FEATURES),
            "coefficients": {k: list(v) for k, v in self.coefficients},
            "num_samples": dict(self.num_samples),
            "r2": dict(self.r2),
        }

    @classmethod
    def from_dict(cls, data: Mapping, where: str = "control-plane cost") -> ControlPlaneCost:
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ControlPlaneCostError(f"{where}: expected format {FORMAT!r}")
        try:
            coefficients = data["coefficients"]
            return cls(
                tuple((k, tuple(float(x) for x in coefficients[k])) for k in KINDS),
                str(data.get("measured_on", "")),
                tuple((k, int(v)) for k, v in dict(data.get("num_samples", {})).items()),
                tuple((k, float(v)) for k, v in dict(data.get("r2", {})).items()),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ControlPlaneCostError(f"{where}: bad coefficients ({e})") from None


def load_control_plane_cost(path: Path | str = DEFAULT_PATH) -> ControlPlaneCost:
    """The cost model stored in ``path`` (default: the checked-in host profile)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ControlPlaneCostError(f"{path}: cannot read a control-plane cost ({e})") from None
    return ControlPlaneCost.from_dict(data, str(path))


def fit_control_plane_cost(
    samples: Sequence[tuple[str, Sequence[float], float]],
) -> ControlPlaneCost:
    """Non-negative least squares per kind over ``(kind, features, measured seconds)``; a
    kind without samples costs nothing."""
    from scipy.optimize import nnls

    coefficients, counts, r2 = [], [], []
    for kind in KINDS:
        rows = [(f, y) for k, f, y in samples if k == kind]
        if not rows:
            coefficients.append((kind, (0.0,) * len(FEATURES)))
            continue
        x = np.array([f for f, _ in rows], dtype=float)
        y = np.array([v for _, v in rows], dtype=float)
        coef, _ = nnls(x, y)
        spread = float(((y - y.mean()) ** 2).sum())
        fit = 1.0 - float(((y - x @ coef) ** 2).sum()) / spread if spread > 0 else 1.0
        coefficients.append((kind, tuple(float(f"{c:.6g}") for c in coef)))
        counts.append((kind, len(rows)))
        r2.append((kind, round(fit, 3)))
    return ControlPlaneCost(tuple(coefficients), _machine(), tuple(counts), tuple(r2))


def _machine() -> str:
    """The CPU the calls ran on, as /proc/cpuinfo names it (else the platform's name)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores"


class ControlPlaneMeter:
    """Prices one system's control-plane calls: by ``cost`` (the model), or, None, by the
    measured CPU seconds; every call is appended to ``samples`` when given (calibration)."""

    def __init__(self, cost: ControlPlaneCost | None, samples: list | None = None) -> None:
        self.cost, self.samples = cost, samples

    def price(self, num_requests: int, iteration, completing: bool, measured_s: float) -> float:
        if self.cost is None and self.samples is None:
            return measured_s
        kind, features = call_features(num_requests, iteration, completing)
        if self.samples is not None:
            self.samples.append((kind, features, measured_s))
        return measured_s if self.cost is None else self.cost.seconds(kind, features)
