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


def _is_uniform(lens, slos, coef) -> bool:
    return bool(lens) and coef[1] >= 0 and coef[2] >= 0 and len(set(lens)) == len(set(slos)) == 1


def _even_split_dp(length, slo, n, coef, max_k, load, enforce_slo):
    """The C++ core's O(K) path for alike decode items: most-even splits (see its comment)."""
    cost = [_INF] * (max_k + 1)
    keep = 1.0 - load

    def latency(size: int) -> float:
        value = (coef[0] + coef[1] * (size * length) + coef[2] * (size * (length * length))) / keep
        return _INF if enforce_slo and not value <= slo else value

    for k in range(1, min(max_k, n) + 1):
        q, r = divmod(n, k)
        small = float((k - r) * q) * latency(q)
        cost[k] = small + (float(r * (q + 1)) * latency(q + 1) if r else 0.0)
    return cost


def _even_batches(n: int, k: int, base: int) -> list[tuple[int, int, int]]:
    out, end = [], base
    for b in range(k):
        size = n // k + (1 if b < n % k else 0)
        out.append((end, end + size, 1))
        end += size
    return out


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
    dec_lens, dec_slos, dec_coef = lens[m:], slos[m:], p.decode_coef.tolist()
    n_dec = len(dec_lens)
    even = _is_uniform(dec_lens, dec_slos, dec_coef)
    if even:
        dec_end = _even_split_dp(dec_lens[0], dec_slos[0], n_dec, dec_coef, kd, p.load, enforce_slo)
    else:
        dec_cost, dec_back = _phase_dp(dec_lens, dec_slos, [dec_coef], 1, kd, p.load, enforce_slo)
        dec_end = dec_cost[n_dec]
    best, best_p, best_d = _INF, -1, -1
    for a in range(kp + 1):
        for b in range(kd + 1):
            if a + b > p.num_instances:
                break
            value = pre_cost[m][a] + dec_end[b]
            if value < best:
                best, best_p, best_d = value, a, b
    if best == _INF:
        return None
    batches = _backtrack(pre_back, m, best_p, 0)
    if even:
        batches += _even_batches(n_dec, best_d, m)
    else:
        batches += _backtrack(dec_back, n_dec, best_d, m)
    return DPResult(tuple(batches), best, enforce_slo)


def solve_reference(problem: DPProblem) -> DPResult:
    """The DP in plain Python; equal to :func:`scheduler.dp.solve`."""
    result = _solve(problem, enforce_slo=True)
    if result is None:
        result = _solve(problem, enforce_slo=False)
    assert result is not None, "DPProblem validation guarantees a plan without SLOs"
    return result
