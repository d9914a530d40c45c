// Keep a*b + c as two roundings (no FMA contraction, whatever -ffp-contract says) so costs,
// and therefore tie-breaks, are bit-identical to the plain-Python scheduler/dp_reference.py.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "scheduler_dp.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace tokenlake {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// cost(i, k): least total cost of the phase's first i items on exactly k instances. An `even`
// table holds only the last row, and its plans are most-even splits (see even_split_dp).
struct PhaseTable {
  int64_t n = 0;
  int64_t num_k = 0;  // k = 0..num_k-1
  bool even = false;
  std::vector<double> cost;
  std::vector<int64_t> back;  // the last batch: j << 32 | its DoP (one array: vectorizes)

  double& at(int64_t i, int64_t k) { return cost[i * num_k + k]; }
  double end_cost(int64_t k) const { return even ? cost[k] : cost[n * num_k + k]; }
};

// Decode steps are many and alike: when every item has the same l and SLO and the batch
// cost s * T(s) = s * (A + B*l*s + C*l*l*s) / (1 - L) is convex in the batch size s (B, C >= 0),
// the best split into k DoP-1 batches is the most even one, which also has the smallest largest
// batch (so it meets the SLO iff some split does). O(K) instead of O(n^2 K).
bool is_uniform(const double* lens, const double* slos, int64_t n, const double* coef,
                int64_t max_dop) {
  if (max_dop != 1 || n == 0 || coef[1] < 0.0 || coef[2] < 0.0) return false;
  for (int64_t i = 1; i < n; ++i) {
    if (lens[i] != lens[0] || slos[i] != slos[0]) return false;
  }
  return true;
}

PhaseTable even_split_dp(double len, double slo, int64_t n, const double* coef, int64_t max_k,
                         double load, bool enforce_slo) {
  PhaseTable t;
  t.n = n;
  t.num_k = max_k + 1;
  t.even = true;
  t.cost.assign(t.num_k, kInf);
  const double keep = 1.0 - load;
  // latency of a batch of s items; +inf when it misses the SLO
  auto latency = [&](int64_t s) {
    const double sum1 = static_cast<double>(s) * len;
    const double sum2 = static_cast<double>(s) * (len * len);
    const double value = (coef[0] + coef[1] * sum1 + coef[2] * sum2) / keep;
    return enforce_slo && !(value <= slo) ? kInf : value;
  };
  for (int64_t k = 1; k <= std::min(max_k, n); ++k) {
    const int64_t q = n / k, r = n % k;  // r batches of q + 1 items, k - r of q
    const double small = static_cast<double>((k - r) * q) * latency(q);
    t.cost[k] = small + (r ? static_cast<double>(r * (q + 1)) * latency(q + 1) : 0.0);
  }
  return t;
}

// The recursion f(i, k) = min_{j < i, d} f(j, k - d) + (i - j) * T(j..i-1, d), over one phase.
// Loop order (i up, j down, d up, k up) and strict '<' fix the tie-breaks the Python reference
// reproduces.
PhaseTable phase_dp(const double* lens, const double* slos, int64_t n, const double* coef,
                    int64_t max_dop, int64_t max_k, double load, bool enforce_slo) {
  PhaseTable t;
  t.n = n;
  t.num_k = max_k + 1;
  t.cost.assign((n + 1) * t.num_k, kInf);
  t.back.assign((n + 1) * t.num_k, 0);
  t.at(0, 0) = 0.0;
  std::vector<double> s1(n + 1, 0.0), s2(n + 1, 0.0);
  for (int64_t i = 1; i <= n; ++i) {
    s1[i] = s1[i - 1] + lens[i - 1];
    s2[i] = s2[i - 1] + lens[i - 1] * lens[i - 1];
  }
  const double keep = 1.0 - load;
  const int64_t dop_cap = std::min(max_dop, max_k);
  // With B, C >= 0 a batch only gets slower and its SLO tighter as it grows (j down): once no
  // DoP meets the SLO, no longer batch ending at i does either. Pruning only: the Python
  // reference, which does not prune, checks that plans are unchanged.
  bool monotone = true;
  for (int64_t d = 0; d < max_dop; ++d) {
    monotone &= coef[3 * d + 1] >= 0.0 && coef[3 * d + 2] >= 0.0;
  }
  for (int64_t i = 1; i <= n; ++i) {
    double slo = kInf;
    for (int64_t j = i - 1; j >= 0; --j) {
      slo = std::min(slo, slos[j]);
      const double sum1 = s1[i] - s1[j];
      const double sum2 = s2[i] - s2[j];
      const double count = static_cast<double>(i - j);
      // gen_plans needs at least one row per sub-batch
      const int64_t dmax = std::min(dop_cap, static_cast<int64_t>(std::floor(sum1)));
      bool any_feasible = false;
      for (int64_t d = 1; d <= dmax; ++d) {
        const double* c = coef + 3 * (d - 1);
        const double latency = (c[0] + c[1] * sum1 + c[2] * sum2) / keep;
        if (enforce_slo && !(latency <= slo)) continue;
        any_feasible = true;
        const double add = count * latency;
        const int64_t tag = j << 32 | d;
        const double* prev = t.cost.data() + j * t.num_k;
        double* cur = &t.cost[i * t.num_k];
        int64_t* back = &t.back[i * t.num_k];
        // branch-free so it vectorizes; an infeasible prev (+inf) never wins
        for (int64_t k = d; k <= max_k; ++k) {
          const double value = prev[k - d] + add;
          const bool better = value < cur[k];
          cur[k] = better ? value : cur[k];
          back[k] = better ? tag : back[k];
        }
      }
      if (enforce_slo && monotone && !any_feasible && dmax == dop_cap) break;
    }
  }
  return t;
}

// Appends the batches of the phase's best plan on k instances (ends offset by `base`).
void backtrack(const PhaseTable& t, int64_t k, int64_t base, ScheduleResult& out) {
  if (t.even) {  // larger batches first
    for (int64_t b = 0, end = base; b < k; ++b) {
      end += t.n / k + (b < t.n % k ? 1 : 0);
      out.batch_ends.push_back(end);
      out.dops.push_back(1);
    }
    return;
  }
  std::vector<std::pair<int64_t, int64_t>> batches;  // (end, dop), last first
  for (int64_t i = t.n; i > 0;) {
    const int64_t j = t.back[i * t.num_k + k] >> 32;
    const int64_t d = t.back[i * t.num_k + k] & 0xffffffff;
    batches.emplace_back(base + i, d);
    i = j;
    k -= d;
  }
  for (auto it = batches.rbegin(); it != batches.rend(); ++it) {
    out.batch_ends.push_back(it->first);
    out.dops.push_back(it->second);
  }
}

bool solve(const ScheduleProblem& p, bool enforce_slo, ScheduleResult& out) {
  const int64_t num_decode = p.num_items - p.num_prefill;
  const int64_t kp = std::min(p.max_prefill_instances, p.num_instances);
  const int64_t kd = std::min(p.max_decode_instances, p.num_instances);
  const PhaseTable pre = phase_dp(p.lens, p.slos, p.num_prefill, p.prefill_coef,
                                  p.max_prefill_dop, kp, p.load, enforce_slo);
  const double* lens = p.lens + p.num_prefill;
  const double* slos = p.slos + p.num_prefill;
  const PhaseTable dec =
      is_uniform(lens, slos, num_decode, p.decode_coef, 1)
          ? even_split_dp(lens[0], slos[0], num_decode, p.decode_coef, kd, p.load, enforce_slo)
          : phase_dp(lens, slos, num_decode, p.decode_coef, 1, kd, p.load, enforce_slo);
  double best = kInf;
  int64_t best_p = -1, best_d = -1;
  for (int64_t a = 0; a <= kp; ++a) {
    for (int64_t b = 0; b <= kd && a + b <= p.num_instances; ++b) {
      const double value = pre.end_cost(a) + dec.end_cost(b);
      if (value < best) {
        best = value;
        best_p = a;
        best_d = b;
      }
    }
  }
  if (best == kInf) return false;
  out.cost = best;
  backtrack(pre, best_p, 0, out);
  backtrack(dec, best_d, p.num_prefill, out);
  return true;
}

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

void validate(const ScheduleProblem& p) {
  require(p.num_items >= 0, "num_items: expected >= 0");
  require(p.num_items < (int64_t{1} << 30), "num_items: expected < 2**30");
  require(p.num_prefill >= 0 && p.num_prefill <= p.num_items,
          "num_prefill: expected 0 <= num_prefill <= num_items");
  require(p.num_instances >= 1, "num_instances: expected >= 1");
  require(p.max_prefill_instances >= 0, "max_prefill_instances: expected >= 0");
  require(p.max_decode_instances >= 0, "max_decode_instances: expected >= 0");
  require(p.max_prefill_dop >= 1, "prefill_coef: expected at least one row");
  require(p.load >= 0.0 && p.load < 1.0, "load: expected 0 <= load < 1");
  for (int64_t i = 0; i < p.num_items; ++i) {
    require(std::isfinite(p.lens[i]) && p.lens[i] >= 1.0, "lens: expected finite values >= 1");
    require(p.slos[i] > 0.0, "slos: expected positive values (inf: no SLO)");
  }
  for (int64_t i = 0; i < 3 * p.max_prefill_dop; ++i)
    require(std::isfinite(p.prefill_coef[i]), "prefill_coef: expected finite values");
  for (int64_t i = 0; i < 3; ++i)
    require(std::isfinite(p.decode_coef[i]), "decode_coef: expected finite values");
}

}  // namespace

ScheduleResult schedule_dp(const ScheduleProblem& problem) {
  validate(problem);
  ScheduleResult out;
  if (solve(problem, /*enforce_slo=*/true, out)) return out;
  out = ScheduleResult();
  out.slo_met = false;
  if (solve(problem, /*enforce_slo=*/false, out)) return out;
  throw std::invalid_argument(
      "max_prefill_instances/max_decode_instances: no plan fits the instances even without "
      "SLOs");
}

}  // namespace tokenlake
