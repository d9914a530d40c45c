"""The §6.2 dynamic program: batches and DoPs of one iteration (C++ core, Python front).

Items are one iteration's work units ordered by (phase, context length): items
``[0, num_prefill)`` are prefill chunks, the rest decode steps. Sorting each phase by context
length and putting prefill first is the paper's "sort all requests by context length" with the
phase as the primary key, so a contiguous run of items never mixes phases (the PD
constraint) and the paper's ``f(i, k)`` splits into a prefill table and a decode table:

    f(i, k) = min_{j < i, 1 <= d <= k} f(j, k - d) + (i - j) * T(j..i-1, d)
    T(j..i-1, d) = (A_d + B_d * sum(l) + C_d * sum(l^2)) / (1 - L)  <=  min(slo[j..i-1])

``l`` is an item's new tokens, ``L`` the cache load: TokenLake's query and transfer engines
take the share ``L`` of every instance (their work is balanced over all instances, §4), so a
batch gets ``1 - L`` of its instances' time and takes ``1 / (1 - L)`` longer. Decode batches
have ``d = 1``. The cost ``(i - j) * T`` is the latency summed over the batch's requests; the
answer is ``min_k f(M, k)`` under the instance limits. No SLO-feasible plan → the same DP
without the SLO constraint (throughput fallback, ``slo_met=False``). ``O(M_p^2 N^2 + M_d^2 N)``;
when the decode items are alike (same ``l`` and SLO, ``B, C >= 0``: the scheduler's decode
steps) their table is the most-even split, exact because the cost is convex: ``O(M_p^2 N^2)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from tokenlake import _C
from tokenlake.errors import InvalidArgumentError


class DPResult(NamedTuple):
    """A plan: ``batches[b] = (start, end, dop)`` over items ``start:end``, in item order."""

    batches: tuple[tuple[int, int, int], ...]
    cost: float
    slo_met: bool


def _int(owner: str, name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InvalidArgumentError(f"{owner}.{name}: expected an int >= {low}, got {value!r}")
    return int(value)


def _array(name: str, value: object, shape: tuple[int | None, ...]) -> np.ndarray:
    try:
        arr = np.array(value, dtype=np.float64, copy=True)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"DPProblem.{name}: expected numbers ({exc})") from None
    if arr.ndim != len(shape) or any(
        w is not None and g != w for g, w in zip(arr.shape, shape, strict=False)
    ):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise InvalidArgumentError(f"DPProblem.{name}: expected shape {want}, got {arr.shape}")
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True)
class DPProblem:
    """One iteration's DP input.

    Args:
        lens: float64 ``[M]`` new tokens per item (>= 1), prefill items first.
        slos: float64 ``[M]`` max latency of the item's batch in seconds (``inf``: none).
        num_prefill: items ``[0, num_prefill)`` are prefill.
        prefill_coef: float64 ``[K, 3]``: ``(A_d, B_d, C_d)`` of a prefill batch on ``d =
            1..K`` instances; ``K`` is the largest prefill DoP.
        decode_coef: float64 ``[3]``: ``(A_1, B_1, C_1)`` of a decode batch.
        num_instances: instances in the cluster (``N``).
        max_prefill_instances / max_decode_instances: instances the prefill batches / decode
            batches may use in total (``N`` each when elastic; ``P`` and ``D`` for xPyD).
        load: cache load ``L`` in ``[0, 1)``.
    """

    lens: np.ndarray
    slos: np.ndarray
    num_prefill: int
    prefill_coef: np.ndarray
    decode_coef: np.ndarray
    num_instances: int
    max_prefill_instances: int
    max_decode_instances: int
    load: float = 0.0

    def __post_init__(self) -> None:
        lens = _array("lens", self.lens, (None,))
        slos = _array("slos", self.slos, (len(lens),))
        prefill_coef = _array("prefill_coef", self.prefill_coef, (None, 3))
        decode_coef = _array("decode_coef", self.decode_coef, (3,))
        if len(lens) and not (np.all(np.isfinite(lens)) and lens.min() >= 1):
            raise InvalidArgumentError("DPProblem.lens: expected finite values >= 1")
        if len(slos) and not slos.min() > 0:  # also rejects NaN
            raise InvalidArgumentError("DPProblem.slos: expected positive seconds (inf: none)")
        if not len(prefill_coef):
            raise InvalidArgumentError("DPProblem.prefill_coef: expected at least one row")
        for name, coef in (("prefill_coef", prefill_coef), ("decode_coef", decode_coef)):
            if not np.all(np.isfinite(coef)):
                raise InvalidArgumentError(f"DPProblem.{name}: expected finite values")
        num_prefill = _int("DPProblem", "num_prefill", self.num_prefill, 0)
        if num_prefill > len(lens):
            raise InvalidArgumentError(
                f"DPProblem.num_prefill: expected <= {len(lens)} items, got {num_prefill}"
            )
        n = _int("DPProblem", "num_instances", self.num_instances, 1)
        max_p = _int("DPProblem", "max_prefill_instances", self.max_prefill_instances, 0)
        max_d = _int("DPProblem", "max_decode_instances", self.max_decode_instances, 0)
        if num_prefill and not max_p:
            raise InvalidArgumentError("DPProblem.max_prefill_instances: prefill items need >= 1")
        if len(lens) > num_prefill and not max_d:
            raise InvalidArgumentError("DPProblem.max_decode_instances: decode items need >= 1")
        if num_prefill and len(lens) > num_prefill and n < 2:
            raise InvalidArgumentError(
                "DPProblem.num_instances: prefill and decode items need >= 2 instances"
            )
        load = float(self.load)
        if not 0.0 <= load < 1.0:
            raise InvalidArgumentError(f"DPProblem.load: expected 0 <= load < 1, got {load}")
        for name, value in (
            ("lens", lens),
            ("slos", slos),
            ("prefill_coef", prefill_coef),
            ("decode_coef", decode_coef),
            ("num_prefill", num_prefill),
            ("num_instances", n),
            ("max_prefill_instances", max_p),
            ("max_decode_instances", max_d),
            ("load", load),
        ):
            object.__setattr__(self, name, value)

    @property
    def num_items(self) -> int:
        return len(self.lens)

    def latency(self, start: int, end: int, dop: int) -> float:
        """Predicted seconds of a batch of items ``start:end`` on ``dop`` instances (with L)."""
        s1 = s2 = 0.0
        for length in self.lens[start:end].tolist():
            s1 += length
            s2 += length * length
        a, b, c = (
            self.prefill_coef[dop - 1] if start < self.num_prefill else self.decode_coef
        ).tolist()
        return (a + b * s1 + c * s2) / (1.0 - self.load)


def solve(problem: DPProblem) -> DPResult:
    """Run the C++ DP (GIL released). Same result as :func:`dp_reference.solve_reference`."""
    n = problem.num_items
    batch_ends = np.zeros(max(n, 1), dtype=np.int64)
    dops = np.zeros(max(n, 1), dtype=np.int64)
    info = np.zeros(2, dtype=np.float64)
    num_batches = _C.schedule_dp(
        problem.lens,
        problem.slos,
        problem.num_prefill,
        problem.prefill_coef,
        problem.decode_coef,
        problem.num_instances,
        problem.max_prefill_instances,
        problem.max_decode_instances,
        problem.load,
        batch_ends,
        dops,
        info,
    )
    batches, start = [], 0
    for end, dop in zip(
        batch_ends[:num_batches].tolist(), dops[:num_batches].tolist(), strict=True
    ):
        batches.append((start, end, dop))
        start = end
    return DPResult(tuple(batches), float(info[0]), bool(info[1]))
