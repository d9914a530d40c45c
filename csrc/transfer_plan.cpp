#include "transfer_plan.h"

#include <stdexcept>
#include <string>
#include <vector>

namespace tokenlake {
namespace {

int32_t narrow(int64_t v, const char* what) {
  if (v < INT32_MIN || v > INT32_MAX) {
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(v) + " beyond int32");
  }
  return static_cast<int32_t>(v);
}

}  // namespace

void plan_transfers(const TransferInput& in, TransferArrays& out) {
  const int64_t U = in.num_subs, N = in.num_instances, n = in.num_runs, m = in.num_copies;
  if (U < 0 || N < 1 || n < 0 || m < 0) throw std::invalid_argument("plan_transfers: bad sizes");
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* r = in.runs + 6 * i;
    if (r[0] < 0 || r[0] >= U || r[1] < 0 || r[1] >= N) {
      throw std::invalid_argument("runs: sub-batch or instance out of range at run " +
                                  std::to_string(i));
    }
  }
  for (int64_t i = 0; i < m; ++i) {
    const int64_t* c = in.copies + 6 * i;
    if (c[0] < 0 || c[0] >= U || c[1] < 0 || c[1] >= N || c[3] < 0 || c[3] >= N) {
      throw std::invalid_argument("copies: sub-batch or instance out of range at copy " +
                                  std::to_string(i));
    }
  }
  // runs: stable counting sort by (sub, dst)
  const int64_t G = U * N;
  std::vector<int64_t> next(G + 1, 0);
  for (int64_t i = 0; i < n; ++i) ++next[in.runs[6 * i] * N + in.runs[6 * i + 1] + 1];
  for (int64_t g = 0; g < G; ++g) next[g + 1] += next[g];
  int64_t* r_bounds = out.bounds;
  int64_t* d_bounds = r_bounds + (U + 1);
  int64_t* c_bounds = d_bounds + (U + 1);
  for (int64_t u = 0; u <= U; ++u) r_bounds[u] = next[u * N];
  // destination groups in (sub, dst) order: the non-empty ones
  int64_t d = 0;
  for (int64_t u = 0; u < U; ++u) {
    d_bounds[u] = d;
    for (int64_t g = u * N; g < (u + 1) * N; ++g) {
      if (next[g + 1] == next[g]) continue;
      out.dst_ids[d] = static_cast<int32_t>(g - u * N);
      out.dst_indptr[d + u] = static_cast<int32_t>(next[g] - r_bounds[u]);
      ++d;
    }
    out.dst_indptr[d + u] = static_cast<int32_t>(r_bounds[u + 1] - r_bounds[u]);
  }
  d_bounds[U] = d;
  out.num_dsts = d;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* r = in.runs + 6 * i;
    const int64_t at = next[r[0] * N + r[1]]++;
    for (int k = 0; k < 4; ++k) out.run_cols[k * n + at] = narrow(r[2 + k], "runs");
  }
  // copies: stable counting sort by sub
  std::vector<int64_t> c_next(U + 1, 0);
  for (int64_t i = 0; i < m; ++i) ++c_next[in.copies[6 * i] + 1];
  for (int64_t u = 0; u < U; ++u) c_next[u + 1] += c_next[u];
  for (int64_t u = 0; u <= U; ++u) c_bounds[u] = c_next[u];
  for (int64_t i = 0; i < m; ++i) {
    const int64_t* c = in.copies + 6 * i;
    const int64_t at = c_next[c[0]]++;
    for (int k = 0; k < 5; ++k) out.copy_cols[k * m + at] = narrow(c[1 + k], "copies");
  }
}

}  // namespace tokenlake
