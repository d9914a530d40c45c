// Register-tiled compute kernels for one key block of a work item: scores (Q K^T) and value
// accumulation (P V). Query vectors are "lanes"; s holds the block's scores or probabilities as
// [key][lane] with row stride ld. Dp = NC * 16 is the (padded) head dimension. Strides are
// padded past a power of two so rows do not collide in the same L1 sets.
#pragma once

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace tokenlake::blocks {

using simd::kLanes;
using simd::Vec;

inline Vec load_vec(const float* p) { return simd::load(p); }
inline Vec load_vec(const uint16_t* p) { return simd::load_bf16(p); }

// A K or V block of one head as rows: row j starts at data + j * stride (elements of T).
template <typename T>
struct Rows {
  const T* data;
  int64_t stride;
  const T* row(int64_t j) const { return data + j * stride; }
};

// KJ keys against all n query vectors q [n][Dp]: 4 * KJ independent FMA chains hide the FMA
// latency, and hsum4 reduces four dot products at once.
template <int NC, int KJ, typename T>
void dot_keys(const float* q, int64_t n, Rows<T> keys, int j, float* s, int64_t ld) {
  constexpr int64_t kDp = int64_t{NC} * kLanes;
  Vec k[KJ][NC];
  for (int jj = 0; jj < KJ; ++jj) {
    for (int c = 0; c < NC; ++c) k[jj][c] = load_vec(keys.row(j + jj) + c * kLanes);
  }
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const float* qi = q + i * kDp;
    Vec a[KJ][4];
    for (int jj = 0; jj < KJ; ++jj) {
      for (int r = 0; r < 4; ++r) a[jj][r] = simd::load(qi + r * kDp) * k[jj][0];
    }
    for (int c = 1; c < NC; ++c) {
      for (int r = 0; r < 4; ++r) {
        const Vec qv = simd::load(qi + r * kDp + c * kLanes);
        for (int jj = 0; jj < KJ; ++jj) a[jj][r] += qv * k[jj][c];
      }
    }
    for (int jj = 0; jj < KJ; ++jj) {
      simd::store4(s + (j + jj) * ld + i, simd::hsum4(a[jj][0], a[jj][1], a[jj][2], a[jj][3]));
    }
  }
  for (; i < n; ++i) {
    const float* qi = q + i * kDp;
    for (int jj = 0; jj < KJ; ++jj) {
      Vec a = simd::load(qi) * k[jj][0];
      for (int c = 1; c < NC; ++c) a += simd::load(qi + c * kLanes) * k[jj][c];
      s[(j + jj) * ld + i] = simd::hsum(a);
    }
  }
}

// Few query vectors per KV head (decode): whole-row dot products, read straight from the pool.
template <int NC, typename T>
void scores_narrow(const float* q, int64_t n, Rows<T> keys, int nb, float* s, int64_t ld) {
  constexpr int kKeys = NC <= 8 ? 2 : 1;  // NC = 16 would run out of registers
  int j = 0;
  for (; j + kKeys <= nb; j += kKeys) dot_keys<NC, kKeys>(q, n, keys, j, s, ld);
  for (; j < nb; ++j) dot_keys<NC, 1>(q, n, keys, j, s, ld);
}

// KJ keys by QV lane-vectors: each K element is broadcast against 16 query lanes of the
// transposed queries qt [D][ld] (same row stride as s).
template <int NC, int KJ, int QV>
void score_tile(const float* qt, int64_t D, int64_t ld, const float* k, int j, int64_t v,
                float* s) {
  constexpr int64_t kDp = int64_t{NC} * kLanes;
  Vec acc[KJ][QV] = {};
  qt += v;
  k += j * kDp;
  for (int64_t d = 0; d < D; ++d) {
    Vec qv[QV];
    for (int u = 0; u < QV; ++u) qv[u] = simd::load(qt + d * ld + u * kLanes);
    for (int jj = 0; jj < KJ; ++jj) {
      const Vec kd = simd::splat(k[jj * kDp + d]);
      for (int u = 0; u < QV; ++u) acc[jj][u] += kd * qv[u];
    }
  }
  for (int jj = 0; jj < KJ; ++jj) {
    for (int u = 0; u < QV; ++u) simd::store(s + (j + jj) * ld + v + u * kLanes, acc[jj][u]);
  }
}

template <int NC, int KJ>
void score_keys(const float* qt, int64_t D, int64_t nql, int64_t ld, const float* k, int j,
                float* s) {
  int64_t v = 0;
  for (; v + 4 * kLanes <= nql; v += 4 * kLanes) score_tile<NC, KJ, 4>(qt, D, ld, k, j, v, s);
  for (; v < nql; v += kLanes) score_tile<NC, KJ, 1>(qt, D, ld, k, j, v, s);
}

// Many query vectors (nql lanes, a multiple of 16) of one KV head (prefill), against a staged
// fp32 block k [nb][Dp].
template <int NC>
void scores_wide(const float* qt, int64_t D, int64_t nql, int64_t ld, const float* k, int nb,
                 float* s) {
  int j = 0;
  for (; j + 4 <= nb; j += 4) score_keys<NC, 4>(qt, D, nql, ld, k, j, s);
  for (; j < nb; ++j) score_keys<NC, 1>(qt, D, nql, ld, k, j, s);
}

// R lanes by CC chunks of D: each V element is loaded (and for bf16 converted) once for all R
// lanes, with R * CC independent FMA chains. acc [R][Dp] starts at lane i, chunk c.
template <int NC, int R, int CC, typename T>
void accumulate_chunks(const float* s, int64_t ld, int64_t i, int c, Rows<T> values, int nb,
                       float* acc) {
  constexpr int64_t kDp = int64_t{NC} * kLanes;
  acc += c * kLanes;
  Vec a[CC][R];
  for (int cc = 0; cc < CC; ++cc) {
    for (int r = 0; r < R; ++r) a[cc][r] = simd::load(acc + r * kDp + cc * kLanes);
  }
  for (int j = 0; j < nb; ++j) {
    const float* p = s + j * ld + i;
    for (int cc = 0; cc < CC; ++cc) {
      const Vec vv = load_vec(values.row(j) + (c + cc) * kLanes);
      for (int r = 0; r < R; ++r) a[cc][r] += simd::splat(p[r]) * vv;
    }
  }
  for (int cc = 0; cc < CC; ++cc) {
    for (int r = 0; r < R; ++r) simd::store(acc + r * kDp + cc * kLanes, a[cc][r]);
  }
}

template <int NC, int R, typename T>
void accumulate_lanes(const float* s, int64_t ld, int64_t i, Rows<T> values, int nb,
                      float* acc) {
  constexpr int kChunks = std::min(NC, R >= 8 ? 1 : 8 / R);
  for (int c = 0; c < NC; c += kChunks) {
    accumulate_chunks<NC, R, kChunks>(s, ld, i, c, values, nb, acc);
  }
}

// acc [n][Dp] of lanes i0..i0+n-1 += probabilities x values.
template <int NC, typename T>
void accumulate_values(const float* s, int64_t ld, int64_t i0, int64_t n, Rows<T> values,
                       int nb, float* acc) {
  constexpr int64_t kDp = int64_t{NC} * kLanes;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) accumulate_lanes<NC, 8>(s, ld, i0 + i, values, nb, acc + i * kDp);
  for (; i + 4 <= n; i += 4) accumulate_lanes<NC, 4>(s, ld, i0 + i, values, nb, acc + i * kDp);
  for (; i < n; ++i) accumulate_lanes<NC, 1>(s, ld, i0 + i, values, nb, acc + i * kDp);
}

}  // namespace tokenlake::blocks
