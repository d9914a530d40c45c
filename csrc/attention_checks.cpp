// The attention kernels' argument checks (see attention_checks.h).
#include "attention_checks.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>

namespace tokenlake {
namespace detail {
namespace {

constexpr double kLog2e = 1.4426950408889634;

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt32:
      return "int32";
    default:
      return "an unsupported dtype";
  }
}

int64_t element_size(DType dtype) { return dtype == DType::kBFloat16 ? 2 : 4; }

// Whether the bytes of two checked views intersect (an empty view intersects nothing).
bool overlaps(const TensorView& a, const TensorView& b) {
  auto bounds = [](const TensorView& t) {
    int64_t n = element_size(t.dtype);
    for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
    const auto* begin = static_cast<const char*>(t.data);
    return std::make_pair(begin, begin + n);
  };
  const auto [a0, a1] = bounds(a);
  const auto [b0, b1] = bounds(b);
  return a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1;
}

std::string number(double value) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", value);
  return buf;
}

std::string at(int64_t value, int64_t index) {
  return std::to_string(value) + " at index " + std::to_string(index);
}

}  // namespace

void fail(const std::string& message) { throw std::invalid_argument(message); }

void check(const char* name, const TensorView& t, std::initializer_list<int64_t> shape,
           std::initializer_list<DType> dtypes) {
  bool ok = t.ndim == static_cast<int>(shape.size());
  for (size_t i = 0; ok && i < shape.size(); ++i) {
    const int64_t want = shape.begin()[i];
    ok = want < 0 || t.shape[i] == want;
  }
  if (!ok) {
    std::string want = "[", got = "[";
    for (int64_t s : shape) {
      want += (want.size() > 1 ? ", " : "") + (s < 0 ? "*" : std::to_string(s));
    }
    for (int i = 0; i < t.ndim && i < kMaxDims; ++i) {
      got += (i ? ", " : "") + std::to_string(t.shape[i]);
    }
    fail(std::string(name) + ": expected shape " + want + "], got " + got + "]");
  }
  if (std::find(dtypes.begin(), dtypes.end(), t.dtype) == dtypes.end()) {
    std::string want;
    for (DType d : dtypes) want += (want.empty() ? "" : " or ") + std::string(dtype_name(d));
    fail(std::string(name) + ": expected dtype " + want + ", got " + dtype_name(t.dtype));
  }
}

void check_disjoint(const char* name, const TensorView& out, std::initializer_list<Named> others,
                    std::initializer_list<const TensorView*> may_alias) {
  for (const auto& [other_name, other] : others) {
    const bool alias = other->data == out.data &&
                       std::find(may_alias.begin(), may_alias.end(), other) != may_alias.end();
    if (!alias && overlaps(out, *other)) {
      fail(std::string(name) + ": expected memory of its own, got memory shared with " +
           other_name);
    }
  }
}

void check_lse(const char* name, const float* lse, int64_t num_states, int64_t H) {
  for (int64_t j = 0; j < num_states; ++j) {
    if (std::isnan(lse[j]) || lse[j] == std::numeric_limits<float>::infinity()) {
      fail(std::string(name) + ": expected values in [-inf, inf), got " + number(lse[j]) +
           " at [" + std::to_string(j / H) + ", " + std::to_string(j % H) + "]");
    }
  }
}

PagedProblem validate(const TensorView& q, const TensorView& q_indptr, const TensorView& pool,
                      const TensorView& kv_indptr, const TensorView& kv_indices,
                      const TensorView& last_len, const TensorView& o, const TensorView& lse,
                      double sm_scale, double logit_cap) {
  check("pool_layer", pool, {-1, 2, -1, -1, -1}, {DType::kFloat32, DType::kBFloat16});
  const int64_t num_slots = pool.shape[0], C = pool.shape[2], Hkv = pool.shape[3];
  const int64_t D = pool.shape[4];
  if (C < 1 || Hkv < 1 || D < 1 || D > 256) {
    fail("pool_layer: expected C >= 1, H_kv >= 1 and 1 <= D <= 256, got C=" + std::to_string(C) +
         " H_kv=" + std::to_string(Hkv) + " D=" + std::to_string(D));
  }
  check("q", q, {-1, -1, D}, {pool.dtype});
  const int64_t num_rows = q.shape[0], Hq = q.shape[1];
  if (Hq < 1 || Hq % Hkv != 0) {
    fail("q: expected H_q to be a positive multiple of H_kv=" + std::to_string(Hkv) +
         ", got H_q=" + std::to_string(Hq));
  }
  check_paged_indices(q_indptr, kv_indptr, kv_indices, last_len, num_rows, num_slots, C);
  check("o", o, {num_rows, Hq, D}, {DType::kFloat32});
  check("lse", lse, {num_rows, Hq}, {DType::kFloat32});
  for (const Named& out : {Named{"o", &o}, Named{"lse", &lse}}) {
    check_disjoint(out.first, *out.second,
                   {{"q", &q}, {"q_indptr", &q_indptr}, {"pool_layer", &pool},
                    {"kv_indptr", &kv_indptr}, {"kv_indices", &kv_indices},
                    {"last_len", &last_len}});
  }
  check_disjoint("lse", lse, {{"o", &o}});
  // The kernel scales in float32, so the scale must be a normal float32.
  constexpr float kMin = std::numeric_limits<float>::min();
  constexpr float kMax = std::numeric_limits<float>::max();
  if (!(sm_scale >= kMin && sm_scale <= kMax)) {
    fail("sm_scale: expected a finite number in [" + number(kMin) + ", " + number(kMax) +
         "], got " + number(sm_scale));
  }
  if (!(logit_cap == 0.0 || (logit_cap >= kMinLogitCap && logit_cap <= kMaxLogitCap))) {
    fail("logit_cap: expected 0 (no cap) or a finite number in [" + number(kMinLogitCap) + ", " +
         number(kMaxLogitCap) + "], got " + number(logit_cap));
  }

  PagedProblem p;
  p.q = q.data;
  p.q_indptr = static_cast<const int32_t*>(q_indptr.data);
  p.pool = pool.data;
  p.kv_indptr = static_cast<const int32_t*>(kv_indptr.data);
  p.kv_indices = static_cast<const int32_t*>(kv_indices.data);
  p.last_len = static_cast<const int32_t*>(last_len.data);
  p.bf16 = pool.dtype == DType::kBFloat16;
  p.sm_scale = static_cast<float>(sm_scale);
  if (logit_cap > 0.0) {  // the tile's scores are in log2 units
    p.cap_log2 = static_cast<float>(logit_cap * kLog2e);
    p.cap_log2_rcp = static_cast<float>(1.0 / (logit_cap * kLog2e));
  }
  p.num_q_heads = Hq;
  p.num_kv_heads = Hkv;
  p.head_dim = D;
  p.page_len = C;
  return p;
}

}  // namespace detail

void check_indptr(const char* name, const TensorView& indptr, int64_t total,
                  const char* total_name) {
  detail::check(name, indptr, {-1}, {DType::kInt32});
  const int64_t size = indptr.shape[0];
  if (size < 1) detail::fail(std::string(name) + ": expected shape [batch_size + 1], got [0]");
  const auto* v = static_cast<const int32_t*>(indptr.data);
  if (v[0] != 0) detail::fail(std::string(name) + ": expected offsets starting at 0, got " + detail::at(v[0], 0));
  for (int64_t i = 1; i < size; ++i) {
    if (v[i] < v[i - 1]) {
      detail::fail(std::string(name) + ": expected non-decreasing offsets, got " + detail::at(v[i], i) +
           " after " + std::to_string(v[i - 1]));
    }
  }
  if (v[size - 1] != total) {
    detail::fail(std::string(name) + ": expected offsets ending at " + std::to_string(total) + " (" +
         total_name + "), got " + detail::at(v[size - 1], size - 1));
  }
}

void check_paged_indices(const TensorView& q_indptr, const TensorView& kv_indptr,
                         const TensorView& kv_indices, const TensorView& last_len,
                         int64_t num_rows, int64_t num_slots, int64_t page_len) {
  check_indptr("q_indptr", q_indptr, num_rows, "the rows of q");
  const int64_t batch = q_indptr.shape[0] - 1;
  detail::check("kv_indptr", kv_indptr, {batch + 1}, {DType::kInt32});
  detail::check("kv_indices", kv_indices, {-1}, {DType::kInt32});
  detail::check("last_len", last_len, {batch}, {DType::kInt32});
  check_indptr("kv_indptr", kv_indptr, kv_indices.shape[0], "the length of kv_indices");
  const auto* indices = static_cast<const int32_t*>(kv_indices.data);
  for (int64_t i = 0; i < kv_indices.shape[0]; ++i) {
    if (indices[i] < 0 || indices[i] >= num_slots) {
      detail::fail("kv_indices: expected slot ids in [0, " + std::to_string(num_slots) +
           ") (the slots of pool_layer), got " + detail::at(indices[i], i));
    }
  }
  const auto* indptr = static_cast<const int32_t*>(kv_indptr.data);
  const auto* lens = static_cast<const int32_t*>(last_len.data);
  for (int64_t b = 0; b < batch; ++b) {
    if (indptr[b + 1] > indptr[b] && (lens[b] < 1 || lens[b] > page_len)) {
      detail::fail("last_len: expected values in [1, " + std::to_string(page_len) +
           "] (the page size) where a request has pages, got " + detail::at(lens[b], b));
    }
  }
}

}  // namespace tokenlake
