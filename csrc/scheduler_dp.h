// The §6.2 batching/DoP dynamic program of the elastic scheduler (pure C++, no Python headers).
//
// Items are one iteration's work units (a prefill chunk or a decode step), ordered by
// (phase, context length): items [0, num_prefill) are prefill, the rest decode. A batch is a
// contiguous run of items of one phase (the PD constraint); a prefill batch runs on
// 1..max_prefill_dop instances, a decode batch on exactly one. A batch of items j..i-1 on k
// instances takes
//     T = (A_k + B_k * sum(l) + C_k * sum(l^2)) / (1 - load)
// seconds (l = new tokens of an item; dividing by 1 - load leaves TokenLake its share `load`
// of every instance), must satisfy T <= min(slo[j..i-1]) and costs (i - j) * T. The DP
// minimizes the total cost subject to sum(dop) over prefill batches <= max_prefill_instances,
// decode batches <= max_decode_instances and all instances <= num_instances. When no plan meets
// every SLO it solves again ignoring SLOs (throughput fallback) and reports slo_met = false.
// O(M_p^2 N^2 + M_d^2 N); alike decode items (same l and SLO) take O(N) (most-even split).
#pragma once

#include <cstdint>
#include <stdexcept>  // schedule_dp throws std::invalid_argument
#include <vector>

namespace tokenlake {

struct ScheduleProblem {
  const double* lens = nullptr;          // [num_items] new tokens of each item (> 0)
  const double* slos = nullptr;          // [num_items] max batch latency, seconds (+inf: none)
  int64_t num_items = 0;
  int64_t num_prefill = 0;               // items [0, num_prefill) are prefill
  const double* prefill_coef = nullptr;  // [max_prefill_dop][3]: A_k, B_k, C_k for k = 1..
  int64_t max_prefill_dop = 0;
  const double* decode_coef = nullptr;   // [3]: A_1, B_1, C_1 of a decode batch
  int64_t num_instances = 0;
  int64_t max_prefill_instances = 0;
  int64_t max_decode_instances = 0;
  double load = 0.0;                     // cache load L in [0, 1)
};

struct ScheduleResult {
  std::vector<int64_t> batch_ends;  // exclusive end item of each batch, increasing
  std::vector<int64_t> dops;        // instances of each batch
  double cost = 0.0;                // sum over batches of (items in batch) * T
  bool slo_met = true;              // false: no SLO-feasible plan existed (fallback)
};

// Throws std::invalid_argument on bad input or when no plan exists even without SLOs
// (e.g. prefill items but max_prefill_instances == 0).
ScheduleResult schedule_dp(const ScheduleProblem& problem);

}  // namespace tokenlake
