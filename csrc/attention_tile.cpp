#include "attention_tile.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_blocks.h"
#include "simd.h"

namespace tokenlake {
namespace {

using blocks::Rows;
using simd::IVec;
using simd::kLanes;
using simd::Vec;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Per-thread buffers, grown on demand and reused across calls.
struct Scratch {
  // Query lane i = h * nqg + (row - row_begin) * group + (q head within the group).
  std::vector<float> q;        // narrow: [nq][Dp] scaled queries; wide: [D][ld] transposed
  std::vector<float> acc;      // [nq][Dp] unnormalised outputs
  std::vector<float> m;        // [nql] running max, log2 units
  std::vector<float> l;        // [nql] running softmax denominator
  std::vector<float> alpha;    // [nql] rescale factor of the current block
  std::vector<int32_t> limit;  // [nql] last visible key position per lane (-1: padding lane)
  std::vector<float> s;        // [kKeyBlock][ld] scores, then probabilities
  std::vector<float> k;        // [H][kKeyBlock][Dp] staged fp32 keys (when staging)
  std::vector<float> v;        // [H][kKeyBlock][Dp] staged fp32 values
};

template <typename T>
T* grow(std::vector<T>& buf, size_t n) {
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// Copies D elements (float32 or bfloat16) to dst as float32, zero-filling up to Dp.
inline void stage_row(const void* src, bool bf16, int64_t D, int64_t Dp, float* dst) {
  int64_t d = 0;
  if (bf16) {
    const auto* s = static_cast<const uint16_t*>(src);
    for (; d + kLanes <= D; d += kLanes) simd::store(dst + d, simd::load_bf16(s + d));
    for (; d < D; ++d) dst[d] = simd::bf16_to_float(s[d]);
  } else {
    const auto* s = static_cast<const float*>(src);
    for (; d + kLanes <= D; d += kLanes) simd::store(dst + d, simd::load(s + d));
    for (; d < D; ++d) dst[d] = s[d];
  }
  for (; d < Dp; ++d) dst[d] = 0.0f;
}

bool wide_item(const PagedProblem& p, const WorkItem& w) {
  const int64_t nqg = (w.row_end - w.row_begin) * (p.num_q_heads / p.num_kv_heads);
  return nqg >= kWideTileMin && w.head_end - w.head_begin == 1;
}

// NC = number of 16-float chunks per (padded) head dimension Dp. T is the element type the
// compute loops read K and V in: the pool's own (direct, no copy) when D == Dp and the item is
// narrow, else float from a staged fp32 copy. Decode streams far more K/V than it computes on,
// so it must not copy; prefill reuses each staged block across many query vectors.
template <int NC, typename T>
class Tile {
 public:
  static constexpr int64_t kDp = int64_t{NC} * kLanes;

  Tile(const PagedProblem& p, const WorkItem& w, Scratch& s)
      : p_(p), w_(w), D_(p.head_dim), group_(p.num_q_heads / p.num_kv_heads),
        num_heads_(w.head_end - w.head_begin), nqg_((w.row_end - w.row_begin) * group_),
        nq_(num_heads_ * nqg_), nql_((nq_ + kLanes - 1) / kLanes * kLanes),
        wide_(wide_item(p, w)), ld_(nql_ + (wide_ ? kLanes : 0)),
        staged_(wide_ || D_ != kDp || p.bf16 != (sizeof(T) == 2)) {
    const size_t h = num_heads_;
    q_ = grow(s.q, wide_ ? D_ * ld_ : nq_ * kDp);
    acc_ = grow(s.acc, nq_ * kDp);
    m_ = grow(s.m, nql_);
    l_ = grow(s.l, nql_);
    alpha_ = grow(s.alpha, nql_);
    limit_ = grow(s.limit, nql_);
    s_ = grow(s.s, kKeyBlock * ld_);
    if (staged_) {
      k_ = grow(s.k, h * kKeyBlock * kDp);
      v_ = grow(s.v, h * kKeyBlock * kDp);
    }
  }

  void run() {
    load_queries();
    const int64_t req_row0 = p_.q_indptr[w_.req];
    const int64_t num_req_rows = p_.q_indptr[w_.req + 1] - req_row0;
    const int64_t kv_len = p_.kv_len(w_.req);
    for (int64_t i = 0; i < nql_; ++i) {
      limit_[i] = i >= nq_      ? -1
                  : p_.causal ? static_cast<int32_t>(kv_len - num_req_rows + q_row(i) - req_row0)
                              : INT32_MAX;
    }
    const int64_t last_visible = p_.causal ? limit_[nqg_ - 1] : kv_len - 1;
    const int64_t Hkv = p_.num_kv_heads;
    const int64_t C = p_.page_len;
    const int64_t half = C * Hkv * D_;  // elements of K (or V) in one slot
    const int32_t* slots = p_.kv_indices + p_.kv_indptr[w_.req];
    for (int64_t page = w_.page_begin; page < w_.page_end; ++page) {
      const int64_t page_keys = std::min(C, kv_len - page * C);
      for (int64_t kb = 0; kb < page_keys; kb += kKeyBlock) {
        const int64_t key0 = page * C + kb;
        if (key0 > last_visible) break;
        const int nb = static_cast<int>(std::min<int64_t>(kKeyBlock, page_keys - kb));
        const int64_t k_offset = slots[page] * 2 * half + (kb * Hkv + w_.head_begin) * D_;
        if (kb + kKeyBlock < page_keys) {
          prefetch_block(slots[page], kb + kKeyBlock, page_keys - kb - kKeyBlock);
        } else if (page + 1 < w_.page_end) {
          prefetch_block(slots[page + 1], 0, std::min(C, kv_len - (page + 1) * C));
        }
        if (staged_) stage_block(slots[page], kb, nb);
        for (int h = 0; h < num_heads_; ++h) {
          if (wide_) {
            blocks::scores_wide<NC>(q_, D_, nql_, ld_, k_, nb, s_);
          } else {
            // This head's values are needed right after the softmax: pull them into L1 now.
            const Rows<T> values = rows(k_offset + half, h, v_);
            for (int j = 0; j < nb; ++j) {
              for (int64_t b = 0; b < D_ * int64_t{sizeof(T)}; b += 64) {
                __builtin_prefetch(reinterpret_cast<const char*>(values.row(j)) + b, 0, 3);
              }
            }
            blocks::scores_narrow<NC>(q_ + h * nqg_ * kDp, nqg_, rows(k_offset, h, k_), nb,
                                      s_ + h * nqg_, ld_);
          }
        }
        softmax(nb, key0);
        for (int h = 0; h < num_heads_; ++h) {
          blocks::accumulate_values<NC>(s_, ld_, h * nqg_, nqg_, rows(k_offset + half, h, v_),
                                        nb, acc_ + h * nqg_ * kDp);
        }
      }
    }
    finish();
  }

 private:
  int64_t q_head(int64_t i) const { return (w_.head_begin + i / nqg_) * group_ + i % group_; }
  int64_t q_row(int64_t i) const { return w_.row_begin + i % nqg_ / group_; }

  // Head h's K or V rows of the current block: in the pool from element offset (direct), or in
  // the staged copy.
  Rows<T> rows(int64_t offset, int h, const float* staged) const {
    if (staged_) return {reinterpret_cast<const T*>(staged + h * kKeyBlock * kDp), kDp};
    return {static_cast<const T*>(p_.pool) + offset + h * D_, p_.num_kv_heads * D_};
  }

  // Scaled into log2 units so the softmax can use exp2.
  void load_queries() {
    const float scale = p_.sm_scale * kLog2e;
    const int64_t Hq = p_.num_q_heads;
    const size_t elem = p_.bf16 ? 2 : 4;
    float row[kDp];
    for (int64_t i = 0; i < nq_; ++i) {
      const char* src = static_cast<const char*>(p_.q) + (q_row(i) * Hq + q_head(i)) * D_ * elem;
      float* dst = wide_ ? row : q_ + i * kDp;
      stage_row(src, p_.bf16, D_, kDp, dst);
      for (int64_t d = 0; d < kDp; ++d) dst[d] *= scale;
      if (wide_) {
        for (int64_t d = 0; d < D_; ++d) q_[d * ld_ + i] = row[d];
      }
    }
    if (wide_) {
      for (int64_t d = 0; d < D_; ++d) {
        for (int64_t i = nq_; i < nql_; ++i) q_[d * ld_ + i] = 0.0f;
      }
    }
    for (int64_t i = 0; i < nq_ * kDp; ++i) acc_[i] = 0.0f;
    for (int64_t i = 0; i < nql_; ++i) {
      m_[i] = kNegInf;
      l_[i] = 0.0f;
    }
  }

  // The next block's K and V rows are strided by H_kv * D, a pattern the hardware prefetchers
  // do not follow across pages; ask for them one block ahead.
  void prefetch_block(int64_t slot, int64_t kb, int64_t num_keys) {
    const int64_t Hkv = p_.num_kv_heads;
    const int64_t elem = p_.bf16 ? 2 : 4;
    const int64_t half = p_.page_len * Hkv * D_ * elem;
    const int64_t row_bytes = num_heads_ * D_ * elem;  // the item's heads are adjacent
    const char* k = static_cast<const char*>(p_.pool) + slot * 2 * half;
    for (int64_t j = kb; j < kb + std::min<int64_t>(kKeyBlock, num_keys); ++j) {
      const int64_t row = (j * Hkv + w_.head_begin) * D_ * elem;
      for (int64_t b = 0; b < row_bytes; b += 64) {
        __builtin_prefetch(k + row + b, 0, 2);
        __builtin_prefetch(k + half + row + b, 0, 2);
      }
    }
  }

  // Converts the block to zero-padded fp32 [H][kKeyBlock][Dp], reading token-major across the
  // item's heads so the reads are sequential.
  void stage_block(int64_t slot, int64_t kb, int nb) {
    const int64_t Hkv = p_.num_kv_heads;
    const int64_t half = p_.page_len * Hkv * D_;
    const size_t elem = p_.bf16 ? 2 : 4;
    const char* base = static_cast<const char*>(p_.pool) + slot * 2 * half * elem;
    for (int j = 0; j < nb; ++j) {
      for (int h = 0; h < num_heads_; ++h) {
        const int64_t off = ((kb + j) * Hkv + w_.head_begin + h) * D_ * elem;
        const int64_t dst = (int64_t{h} * kKeyBlock + j) * kDp;
        stage_row(base + off, p_.bf16, D_, kDp, k_ + dst);
        stage_row(base + half * elem + off, p_.bf16, D_, kDp, v_ + dst);
      }
    }
  }

  // Soft cap of the block's scores (log2 units): cap * tanh(s / cap), before the mask.
  void soft_cap(int nb) {
    const Vec cap = simd::splat(p_.cap_log2);
    const Vec rcp = simd::splat(p_.cap_log2_rcp);
    for (int j = 0; j < nb; ++j) {
      float* sj = s_ + j * ld_;
      for (int64_t v = 0; v < nql_; v += kLanes) {
        simd::store(sj + v, cap * simd::tanh(simd::load(sj + v) * rcp));
      }
    }
  }

  // Online softmax over one block, vectorised across query lanes.
  void softmax(int nb, int64_t key0) {
    if (p_.cap_log2 > 0.0f) soft_cap(nb);
    float* m = m_;
    float* l = l_;
    const Vec neg_inf = simd::splat(kNegInf);
    for (int64_t v = 0; v < nql_; v += kLanes) {
      const IVec limit = simd::load(limit_ + v);
      const Vec m_old = simd::load(m + v);
      Vec block_max = neg_inf;
      for (int j = 0; j < nb; ++j) {
        float* sj = s_ + j * ld_ + v;
        const Vec sv = limit < static_cast<int32_t>(key0 + j) ? neg_inf : simd::load(sj);
        simd::store(sj, sv);
        block_max = simd::vmax(block_max, sv);
      }
      const Vec m_new = simd::vmax(m_old, block_max);
      // A lane that has seen no key keeps m = -inf; subtracting 0 keeps its terms at exactly 0.
      const Vec m_safe = m_new == neg_inf ? simd::splat(0.0f) : m_new;
      const Vec alpha = simd::exp2(m_old - m_safe);
      Vec sum = simd::splat(0.0f);
      for (int j = 0; j < nb; ++j) {
        float* sj = s_ + j * ld_ + v;
        const Vec pv = simd::exp2(simd::load(sj) - m_safe);
        simd::store(sj, pv);
        sum += pv;
      }
      simd::store(l + v, simd::load(l + v) * alpha + sum);
      simd::store(m + v, m_new);
      simd::store(alpha_ + v, alpha);
    }
    float* acc = acc_;
    for (int64_t i = 0; i < nq_; ++i) {
      if (alpha_[i] == 1.0f) continue;
      const Vec a = simd::splat(alpha_[i]);
      for (int c = 0; c < NC; ++c) {
        float* x = acc + i * kDp + c * kLanes;
        simd::store(x, simd::load(x) * a);
      }
    }
  }

  void finish() {
    const int64_t Hq = p_.num_q_heads;
    for (int64_t i = 0; i < nq_; ++i) {
      const int64_t dst = (q_row(i) - w_.dst_row0) * Hq + q_head(i);
      const float l = l_[i];
      const float* acc = acc_ + i * kDp;
      float* o = w_.o + dst * D_;
      if (l == 0.0f) {
        for (int64_t d = 0; d < D_; ++d) o[d] = 0.0f;
        w_.lse[dst] = kNegInf;
        continue;
      }
      const float inv = 1.0f / l;
      for (int64_t d = 0; d < D_; ++d) o[d] = acc[d] * inv;
      w_.lse[dst] = (m_[i] + std::log2(l)) * kLn2;
    }
  }

  const PagedProblem& p_;
  const WorkItem& w_;
  const int64_t D_;
  const int64_t group_;
  const int num_heads_;
  const int64_t nqg_;  // query vectors per KV head: rows x group
  const int64_t nq_;   // query vectors (lanes) of the item: heads x nqg_
  const int64_t nql_;  // nq_ rounded up to whole vectors (padding lanes are always masked)
  const bool wide_;
  // Row stride of s_ and of the transposed queries; wide strides are padded off a power of two
  // (256 lanes = 1 KiB rows would map all of qt onto 4 of L1's 64 sets).
  const int64_t ld_;
  const bool staged_;
  float* q_;
  float* acc_;
  float* m_;
  float* l_;
  float* alpha_;
  int32_t* limit_;
  float* s_;
  float* k_ = nullptr;
  float* v_ = nullptr;
};

template <int NC>
void run_with(const PagedProblem& p, const WorkItem& w) {
  thread_local Scratch scratch;
  if (p.bf16 && p.head_dim == NC * kLanes && !wide_item(p, w)) {
    Tile<NC, uint16_t>(p, w, scratch).run();
  } else {
    Tile<NC, float>(p, w, scratch).run();
  }
}

}  // namespace

void run_tile(const PagedProblem& p, const WorkItem& w) {
  if (w.row_end <= w.row_begin || w.head_end <= w.head_begin) return;
  const int64_t chunks = (p.head_dim + kLanes - 1) / kLanes;
  if (chunks <= 1) {
    run_with<1>(p, w);
  } else if (chunks <= 2) {
    run_with<2>(p, w);
  } else if (chunks <= 4) {
    run_with<4>(p, w);
  } else if (chunks <= 8) {
    run_with<8>(p, w);
  } else {
    run_with<16>(p, w);
  }
}

}  // namespace tokenlake
