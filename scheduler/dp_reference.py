"""Plain-Python reference of the §6.2 DP (csrc/scheduler_dp.cpp), for tests.

Same recursion, same loop order and the same floating-point operations in the same order, so
its plans (tie-breaks included) equal the C++ core's bit for bit. Slow: tests only.
"""

from __future__ import annotations

import math

from tokenlake.scheduler.dp import DPProblem, DPResult

_INF = math.inf


def _phase_dp(lens, slos, coef, max_dop, max_k, load, enforce_slo):
    """``cost[i][k]``, ``back[i][k] = (j, d)`` over one phase's items (see the C++ core)."""
    n = len(lens)
    cost = [[_INF] * (max_k + 1) for _ in range(n + 1)]
    back = [[None] * (max_k + 1) for _ in range(n + 1)]
    cost[0][0] = 0.0
    s1, s2 = [0.0] * (n + 1), [0.0] * (n + 1)
    for i in range(1, n + 1):
        s1[i] = s1[i - 1] + lens[i - 1]
        s2[i] = s2[i - 1] + lens[i - 1] * lens[i - 1]
    keep = 1.0 - load
    for i in range(1, n + 1):
        slo = _INF
        for j in range(i - 1, -1, -1):
            slo = min(slo, slos[j])
            sum1, sum2 = s1[i] - s1[j], s2[i] - s2[j]
            count = float(i - j)
            for d in range(1, min(max_dop, max_k, math.floor(sum1)) + 1):
                a, b, c = coef[d - 1]
                latency = (a + b * sum1 + c * sum2) / keep
                if enforce_slo and not latency <= slo:
                    continue
                add = count * latency
                for k in range(d, max_k + 1):
                    prev = cost[j][k - d]
                    if prev == _INF:
                        continue
                    value = prev + add
                    if value < cost[i][k]:
                        cost[i][k] = value
                        back[i][k] = (j, d)
    return cost, back


def _backtrack(back, n: int, k: int, base: int) -> list[tuple[int, int, int]]:
    out = []
    i = n
    while i > 0:
        j, d = back[i][k]
        out.append((base + j, base + i, d))
        i, k = j, k - d
    return out[::-1]


def _solve(p: DPProblem, enforce_slo: bool) -> DPResult | None:
    lens, slos, m = p.lens.tolist(), p.slos.tolist(), p.num_prefill
    kp = min(p.max_prefill_instances, p.num_instances)
    kd = min(p.max_decode_instances, p.num_instances)
    pre_cost, pre_back = _phase_dp(
        lens[:m], slos[:m], p.prefill_coef.tolist(), len(p.prefill_coef), kp, p.load, enforce_slo
    )
    dec_cost, dec_back = _phase_dp(
        lens[m:], slos[m:], [p.decode_coef.tolist()], 1, kd, p.load, enforce_slo
    )
    best, best_p, best_d = _INF, -1, -1
    for a in range(kp + 1):
        for b in range(kd + 1):
            if a + b > p.num_instances:
                break
            value = pre_cost[m][a] + dec_cost[len(lens) - m][b]
            if value < best:
                best, best_p, best_d = value, a, b
    if best == _INF:
        return None
    batches = _backtrack(pre_back, m, best_p, 0) + _backtrack(dec_back, len(lens) - m, best_d, m)
    return DPResult(tuple(batches), best, enforce_slo)


def solve_reference(problem: DPProblem) -> DPResult:
    """The DP in plain Python; equal to :func:`scheduler.dp.solve`."""
    result = _solve(problem, enforce_slo=True)
    if result is None:
        result = _solve(problem, enforce_slo=False)
    assert result is not None, "DPProblem validation guarantees a plan without SLOs"
    return result
