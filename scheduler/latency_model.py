"""Batch latency model ``T(batch, k) = A_k + B_k·Σl + C_k·Σl²`` per phase, fitted from profiles.

LoongServe's quadratic form (SOSP'24 §5), which TokenLake's §6 reuses. ``l`` is a request's
new tokens in the iteration (a prefill chunk's length; 1 for a decode step), so ``T`` is the
compute engine's own work: linear layers (``Σl``) and causal attention among the new tokens
(``Σl²``). Attention over the cached prefix is not in ``T``: TokenLake's query engines do it on
the segments' holders, spread over every instance, and the scheduler accounts for it through
the cache load ``L`` (``T / (1 - L)``, see :mod:`tokenlake.scheduler.dp`). A mixed batch
(colocated mode) uses the prefill coefficients with ``l = 1`` for its decode rows.

A remote prefix part has a fixed cost: the round trip to its holder, the merge of its
``(o, lse)``, the per-layer signal. ``hop_s`` prices it: seconds per remote holder per step
(all layers), measured by :func:`tokenlake.scheduler.profiler.measure_hop_seconds`. A DoP-``k``
prefill pays it ``k - 1`` times (its last sub-batch reads the earlier sub-batches' new KV on
``k - 1`` other instances), so the DP spreads a batch only where the predicted step, hops
included, is shorter; ``hop_s = 0`` leaves every prediction and decision as without it.

Fitting minimizes the squared *relative* error ``Σ ((x·θ - y) / y)²`` so short and long
batches weigh the same, with ``θ >= 0`` (more tokens never take less time); on rows produced
by a model with non-negative coefficients this is the plain least-squares solution.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

import numpy as np
from scipy.optimize import nnls

from tokenlake.errors import InvalidArgumentError

PREFILL = "prefill"
DECODE = "decode"
PHASES = (PREFILL, DECODE)


class Coeffs(NamedTuple):
    """``T = a + b·Σl + c·Σl²`` seconds."""

    a: float
    b: float
    c: float

    def predict(self, sum_l: float, sum_l2: float) -> float:
        return self.a + self.b * sum_l + self.c * sum_l2


class ProfileRow(NamedTuple):
    """One measured (or modelled) batch: ``phase``, DoP, new tokens per request, seconds."""

    phase: str
    dop: int
    lengths: tuple[int, ...]
    seconds: float

    @property
    def sum_l(self) -> float:
        return float(sum(self.lengths))

    @property
    def sum_l2(self) -> float:
        return float(sum(x * x for x in self.lengths))


@dataclass(frozen=True)
class LatencyModel:
    """Fitted coefficients: ``prefill[k]`` for the DoPs that were profiled, ``decode`` (DoP 1),
    and ``hop_s``, the fixed seconds of one remote holder per step (see the module doc).

    A DoP ``k`` without a fit extrapolates from the nearest profiled ``k' <= k`` (else the
    smallest) by ideal sequence parallelism: ``A_k = A_k'``, ``B_k, C_k = (B_k', C_k')·k'/k``.
    """

    prefill: Mapping[int, Coeffs]
    decode: Coeffs
    hop_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.prefill, Mapping) or not self.prefill:
            raise InvalidArgumentError("LatencyModel.prefill: expected a non-empty {dop: Coeffs}")
        table = {}
        for k, coeffs in self.prefill.items():
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise InvalidArgumentError(f"LatencyModel.prefill: bad DoP {k!r}")
            table[k] = _coeffs("LatencyModel.prefill", coeffs)
        object.__setattr__(self, "prefill", MappingProxyType(dict(sorted(table.items()))))
        object.__setattr__(self, "decode", _coeffs("LatencyModel.decode", self.decode))
        object.__setattr__(self, "hop_s", _hop("LatencyModel.hop_s", self.hop_s))

    def coeffs(self, phase: str, dop: int = 1) -> Coeffs:
        """Coefficients of a ``phase`` batch on ``dop`` instances."""
        if phase == DECODE:
            if dop != 1:
                raise InvalidArgumentError(f"dop: decode batches have DoP 1, got {dop!r}")
            return self.decode
        if phase != PREFILL:
            raise InvalidArgumentError(f"phase: expected one of {PHASES}, got {phase!r}")
        if isinstance(dop, bool) or not isinstance(dop, int) or dop < 1:
            raise InvalidArgumentError(f"dop: expected an int >= 1, got {dop!r}")
        if dop in self.prefill:
            return self.prefill[dop]
        below = [k for k in self.prefill if k <= dop]
        base = below[-1] if below else next(iter(self.prefill))
        a, b, c = self.prefill[base]
        return Coeffs(a, b * base / dop, c * base / dop)

    def table(self, max_dop: int, load: float = 0.0) -> np.ndarray:
        """float64 ``[max_dop, 3]``: prefill ``(A_k, B_k, C_k)`` for ``k = 1..max_dop``, the
        hops of DoP ``k`` in ``A_k`` (``(k - 1)·hop_s·(1 - load)``: the DP divides every
        coefficient by ``1 - load``, and a hop is not slowed by the cache load)."""
        rows = [self.coeffs(PREFILL, k) for k in range(1, max_dop + 1)]
        scale = 1.0 - _load(load)
        return np.array(
            [(a + (k - 1) * self.hop_s * scale, b, c) for k, (a, b, c) in enumerate(rows, 1)],
            dtype=float,
        )

    def predict(
        self,
        phase: str,
        lengths: Sequence[int],
        dop: int = 1,
        load: float = 0.0,
        remote_holders: int | None = None,
    ) -> float:
        """Seconds of one batch whose requests compute ``lengths`` new tokens, under load L,
        plus ``hop_s`` per remote holder (default: ``dop - 1``, the DoP's own hops)."""
        load = _load(load)
        s1 = float(sum(lengths))
        s2 = float(sum(x * x for x in lengths))
        hops = dop - 1 if remote_holders is None else remote_holders
        if isinstance(hops, bool) or not isinstance(hops, int) or hops < 0:
            raise InvalidArgumentError(f"remote_holders: expected an int >= 0, got {hops!r}")
        return self.coeffs(phase, dop).predict(s1, s2) / (1.0 - load) + hops * self.hop_s

    def with_hop(self, hop_s: float) -> LatencyModel:
        """This model with the fixed cost of a remote holder set to ``hop_s`` seconds."""
        return LatencyModel(dict(self.prefill), self.decode, hop_s)

    def summary(self) -> str:
        """One readable line: per prefill DoP and for decode, the fixed milliseconds, the
        microseconds per token and per 1,000 tokens squared; the hop's milliseconds."""

        def line(c: Coeffs) -> str:
            return f"{c.a * 1e3:.3g} ms + {c.b * 1e6:.3g} us/token + {c.c * 1e12:.3g} us/ktok^2"

        parts = [f"prefill DoP {k}: {line(c)}" for k, c in self.prefill.items()]
        parts.append(f"decode: {line(self.decode)}")
        parts.append(f"hop: {self.hop_s * 1e3:.3g} ms")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        """A JSON-able form (:meth:`from_dict` reads it back)."""
        return {"prefill": {str(k): list(c) for k, c in self.prefill.items()},
                "decode": list(self.decode), "hop_s": self.hop_s}  # fmt: skip

    @classmethod
    def from_dict(cls, data: object) -> LatencyModel:
        """The model :meth:`to_dict` wrote; ``InvalidArgumentError`` for anything else."""
        if not isinstance(data, Mapping) or not isinstance(data.get("prefill"), Mapping):
            raise InvalidArgumentError("latency model: expected {prefill, decode, hop_s}")
        try:
            prefill = {int(k): v for k, v in data["prefill"].items()}
        except ValueError:
            raise InvalidArgumentError("latency model: prefill keys must be DoPs") from None
        return cls(prefill, data.get("decode"), data.get("hop_s", 0.0))


def _load(load: float) -> float:
    if not 0.0 <= load < 1.0:
        raise InvalidArgumentError(f"load: expected 0 <= load < 1, got {load!r}")
    return float(load)


def _hop(name: str, value: object) -> float:
    try:
        hop = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{name}: expected seconds >= 0, got {value!r}") from None
    if not (np.isfinite(hop) and hop >= 0.0):
        raise InvalidArgumentError(f"{name}: expected finite seconds >= 0, got {value!r}")
    return hop


def _coeffs(name: str, value: object) -> Coeffs:
    try:
        coeffs = Coeffs(*(float(x) for x in value))  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{name}: expected three numbers (a, b, c)") from None
    if not all(np.isfinite(coeffs)):
        raise InvalidArgumentError(f"{name}: expected finite coefficients, got {coeffs}")
    return coeffs


def fit_coeffs(rows: Sequence[ProfileRow]) -> Coeffs:
    """Least squares on relative error (``θ >= 0``) of ``a + b·Σl + c·Σl²`` to ``rows``."""
    if not rows:
        raise InvalidArgumentError("rows: expected at least one profile row")
    y = np.array([r.seconds for r in rows], dtype=float)
    if not np.all(np.isfinite(y)) or y.min() <= 0:
        raise InvalidArgumentError("rows: expected positive finite seconds")
    x = np.array([[1.0, r.sum_l, r.sum_l2] for r in rows]) / y[:, None]
    scale = np.abs(x).max(axis=0)  # Σl² is ~1e8× Σl: equilibrate columns before solving
    scale[scale == 0] = 1.0
    theta, _ = nnls(x / scale, np.ones(len(rows)))
    return Coeffs(*(theta / scale).tolist())


def fit_latency_model(rows: Iterable[ProfileRow], hop_s: float = 0.0) -> LatencyModel:
    """Fit prefill coefficients per profiled DoP and decode coefficients (DoP 1); ``hop_s``
    is the measured fixed cost of a remote holder per step (kept as given).

    Without decode rows the decode step uses the DoP-1 prefill fit (a decode step is a
    one-token batch for the compute engine).
    """
    groups: dict[tuple[str, int], list[ProfileRow]] = {}
    for row in rows:
        if not isinstance(row, ProfileRow):
            raise InvalidArgumentError(f"rows: expected ProfileRow items, got {type(row).__name__}")
        if row.phase not in PHASES:
            raise InvalidArgumentError(f"rows: phase must be one of {PHASES}, got {row.phase!r}")
        if row.phase == DECODE and row.dop != 1:
            raise InvalidArgumentError(f"rows: decode rows have DoP 1, got {row.dop}")
        groups.setdefault((row.phase, row.dop), []).append(row)
    prefill = {k: fit_coeffs(g) for (phase, k), g in groups.items() if phase == PREFILL}
    if not prefill:
        raise InvalidArgumentError("rows: expected at least one prefill row")
    model = LatencyModel(prefill, Coeffs(0.0, 0.0, 0.0))
    decode_rows = groups.get((DECODE, 1))
    decode = fit_coeffs(decode_rows) if decode_rows else model.coeffs(PREFILL, 1)
    return LatencyModel(prefill, decode, hop_s)
