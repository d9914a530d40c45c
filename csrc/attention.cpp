#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "attention_checks.h"
#include "attention_tile.h"
#include "thread_pool.h"

namespace tokenlake {
namespace {

using detail::check;
using detail::check_disjoint;
using detail::check_lse;
using detail::Named;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Query vectors per prefill item: each staged K/V block is reused this many times, so the K/V
// stream from memory stays small next to the FMAs; the item's 2 x 128 KiB of transposed queries
// and accumulators (D = 128) stay in L2.
constexpr int64_t kWideTileVectors = 256;
// Splitting a request's pages aims for this many items per thread, so uneven requests balance.
constexpr int64_t kItemsPerThread = 4;
// A split shorter than this spends more on its merge and scheduling than it saves.
constexpr int64_t kMinSplitKeys = 256;
constexpr int kMaxSplits = 64;


void fill_empty(float* o, float* lse, int64_t num, int64_t D) {
  std::fill(o, o + num * D, 0.0f);
  std::fill(lse, lse + num, kNegInf);
}

// Merges num partial states of one (row, head): o[s] [D], lse[s] natural log. out_o may alias
// o[0] or o[1]; each element is read before it is written.
void merge_states(int num, const float* const* o, const float* lse, int64_t D, float* out_o,
                  float* out_lse) {
  float m = kNegInf;
  for (int s = 0; s < num; ++s) m = std::max(m, lse[s]);
  if (m == kNegInf) {
    fill_empty(out_o, out_lse, 1, D);
    return;
  }
  float w[kMaxSplits];
  float total = 0.0f;
  for (int s = 0; s < num; ++s) {
    w[s] = std::exp(lse[s] - m);
    total += w[s];
  }
  if (num == 2) {
    const float* a = o[0];
    const float* b = o[1];
    for (int64_t d = 0; d < D; ++d) out_o[d] = (a[d] * w[0] + b[d] * w[1]) / total;
  } else {
    for (int64_t d = 0; d < D; ++d) {
      float x = 0.0f;
      for (int s = 0; s < num; ++s) x += o[s][d] * w[s];
      out_o[d] = x / total;
    }
  }
  *out_lse = m + std::log(total);
}

// A request whose pages were split: its items wrote num_splits partial states, each laid out
// like the request's rows of o ([rows, H_q, D]) and lse, starting at o and lse.
struct Split {
  int32_t req;
  int32_t num_splits;
  float* o;
  float* lse;
};

}  // namespace

void partial_attention(const TensorView& q, const TensorView& q_indptr,
                       const TensorView& pool_layer, const TensorView& kv_indptr,
                       const TensorView& kv_indices, const TensorView& last_len,
                       const TensorView& o, const TensorView& lse, bool causal, double sm_scale,
                       double logit_cap) {
  PagedProblem p = detail::validate(q, q_indptr, pool_layer, kv_indptr, kv_indices, last_len, o, lse,
                            sm_scale, logit_cap);
  p.causal = causal;
  const int64_t batch = q_indptr.shape[0] - 1;
  const int64_t Hq = p.num_q_heads, Hkv = p.num_kv_heads, D = p.head_dim;
  const int64_t group = Hq / Hkv;
  auto* out_o = static_cast<float*>(o.data);
  auto* out_lse = static_cast<float*>(lse.data);
  const std::shared_ptr<ThreadPool> pool = default_pool();

  // Decode-sized requests take all KV heads in one item so pages stream sequentially; larger
  // ones get one item per (row tile, KV head).
  auto rows_per_item = [&](int64_t rows) {
    return rows * group < kWideTileMin ? rows : std::max<int64_t>(1, kWideTileVectors / group);
  };
  std::vector<int32_t> num_splits(batch, 1);
  int64_t total_cost = 0;
  for (int64_t b = 0; b < batch; ++b) {
    total_cost += (p.q_indptr[b + 1] - p.q_indptr[b]) * Hq * p.kv_len(b);
  }
  const int64_t target = total_cost / (kItemsPerThread * pool->num_threads()) + 1;
  std::vector<Split> splits;
  size_t scratch_size = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t rows = p.q_indptr[b + 1] - p.q_indptr[b];
    if (rows == 0 || pool->num_threads() == 1) continue;
    const int64_t item_rows = rows_per_item(rows);
    const int64_t item_cost = item_rows * (rows * group < kWideTileMin ? Hq : group) * p.kv_len(b);
    const int64_t by_length = p.num_pages(b) * p.page_len / kMinSplitKeys;
    const int64_t n = std::min<int64_t>({(item_cost + target - 1) / target, by_length, kMaxSplits});
    if (n > 1) {
      num_splits[b] = static_cast<int32_t>(n);
      splits.push_back({static_cast<int32_t>(b), static_cast<int32_t>(n), nullptr, nullptr});
      scratch_size += n * rows * Hq * (D + 1);
    }
  }
  std::vector<float> scratch(scratch_size);
  float* next_scratch = scratch.data();
  for (Split& s : splits) {
    const int64_t states = s.num_splits * (p.q_indptr[s.req + 1] - p.q_indptr[s.req]) * Hq;
    s.o = next_scratch;
    s.lse = next_scratch + states * D;
    next_scratch += states * (D + 1);
  }

  std::vector<WorkItem> items;
  size_t next_split = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t row0 = p.q_indptr[b], rows = p.q_indptr[b + 1] - row0;
    if (rows == 0) continue;
    const int32_t pages = static_cast<int32_t>(p.num_pages(b));
    if (pages == 0) {
      fill_empty(out_o + row0 * Hq * D, out_lse + row0 * Hq, rows * Hq, D);
      continue;
    }
    const Split* split = num_splits[b] > 1 ? &splits[next_split++] : nullptr;
    const int64_t item_rows = rows_per_item(rows);
    const bool all_heads = rows * group < kWideTileMin;
    for (int32_t s = 0; s < num_splits[b]; ++s) {
      WorkItem w;
      w.req = static_cast<int32_t>(b);
      w.page_begin = static_cast<int32_t>(int64_t{pages} * s / num_splits[b]);
      w.page_end = static_cast<int32_t>(int64_t{pages} * (s + 1) / num_splits[b]);
      w.o = split ? split->o + int64_t{s} * rows * Hq * D : out_o;
      w.lse = split ? split->lse + int64_t{s} * rows * Hq : out_lse;
      w.dst_row0 = split ? row0 : 0;
      for (int32_t g = 0; g < (all_heads ? 1 : Hkv); ++g) {
        w.head_begin = g;
        w.head_end = all_heads ? static_cast<int32_t>(Hkv) : g + 1;
        for (int64_t r = 0; r < rows; r += item_rows) {
          w.row_begin = static_cast<int32_t>(row0 + r);
          w.row_end = static_cast<int32_t>(row0 + std::min<int64_t>(rows, r + item_rows));
          items.push_back(w);
        }
      }
    }
  }
  pool->parallel_for(static_cast<int64_t>(items.size()),
                     [&](int64_t i) { run_tile(p, items[i]); });
  pool->parallel_for(static_cast<int64_t>(splits.size()), [&](int64_t i) {
    const Split& s = splits[i];
    const int64_t row0 = p.q_indptr[s.req];
    const int64_t states = (p.q_indptr[s.req + 1] - row0) * Hq;
    const float* parts[kMaxSplits];
    float lses[kMaxSplits];
    for (int64_t j = 0; j < states; ++j) {
      for (int k = 0; k < s.num_splits; ++k) {
        parts[k] = s.o + (k * states + j) * D;
        lses[k] = s.lse[k * states + j];
      }
      merge_states(s.num_splits, parts, lses, D, out_o + (row0 * Hq + j) * D,
                   out_lse + row0 * Hq + j);
    }
  });
}

void merge(const TensorView& o_a, const TensorView& lse_a, const TensorView& o_b,
           const TensorView& lse_b, const TensorView& o, const TensorView& lse) {
  check("o_a", o_a, {-1, -1, -1}, {DType::kFloat32});
  const int64_t n = o_a.shape[0], H = o_a.shape[1], D = o_a.shape[2];
  check("lse_a", lse_a, {n, H}, {DType::kFloat32});
  check("o_b", o_b, {n, H, D}, {DType::kFloat32});
  check("lse_b", lse_b, {n, H}, {DType::kFloat32});
  check("o", o, {n, H, D}, {DType::kFloat32});
  check("lse", lse, {n, H}, {DType::kFloat32});
  const std::initializer_list<Named> inputs = {
      {"o_a", &o_a}, {"lse_a", &lse_a}, {"o_b", &o_b}, {"lse_b", &lse_b}};
  check_disjoint("o", o, inputs, {&o_a, &o_b});
  check_disjoint("lse", lse, inputs, {&lse_a, &lse_b});
  check_disjoint("lse", lse, {{"o", &o}});
  const auto* oa = static_cast<const float*>(o_a.data);
  const auto* ob = static_cast<const float*>(o_b.data);
  const auto* la = static_cast<const float*>(lse_a.data);
  const auto* lb = static_cast<const float*>(lse_b.data);
  auto* out_o = static_cast<float*>(o.data);
  auto* out_lse = static_cast<float*>(lse.data);
  const int64_t states = n * H;
  check_lse("lse_a", la, states, H);
  check_lse("lse_b", lb, states, H);
  // Chunks of ~64K floats: big enough to amortise scheduling, small enough to balance.
  const int64_t per_chunk = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(D, 1));
  const int64_t num_chunks = (states + per_chunk - 1) / per_chunk;
  default_pool()->parallel_for(num_chunks, [&](int64_t c) {
    const int64_t end = std::min(states, (c + 1) * per_chunk);
    for (int64_t j = c * per_chunk; j < end; ++j) {
      const float* parts[2] = {oa + j * D, ob + j * D};
      const float lses[2] = {la[j], lb[j]};
      merge_states(2, parts, lses, D, out_o + j * D, out_lse + j);
    }
  });
}

}  // namespace tokenlake
