// 16-lane float vectors via GCC/Clang vector extensions: explicit SIMD without per-ISA
// intrinsics. With -march=native on AVX-512 each Vec is one zmm register; on AVX2 the compiler
// splits it into two ymm halves, so the same source runs everywhere.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tokenlake::simd {

constexpr int kLanes = 16;

typedef float Vec __attribute__((vector_size(64)));
typedef int32_t IVec __attribute__((vector_size(64)));
typedef uint32_t UVec __attribute__((vector_size(64)));
// Unaligned, aliasing-safe views for loads/stores from arbitrary tensor memory.
typedef float VecU __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t IVecU __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint16_t HalfU __attribute__((vector_size(32), aligned(2), may_alias));

inline Vec splat(float x) { return Vec{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
inline Vec load(const float* p) { return *reinterpret_cast<const VecU*>(p); }
inline void store(float* p, Vec v) { *reinterpret_cast<VecU*>(p) = v; }
inline IVec load(const int32_t* p) { return *reinterpret_cast<const IVecU*>(p); }

// bfloat16 is the top half of a float32: widen the 16 bits and shift them up.
inline Vec load_bf16(const uint16_t* p) {
#if defined(__AVX512F__)
  // GCC lowers the generic form below through 256-bit halves; one vpmovzxwd is enough.
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  // The maskz form with a full mask avoids GCC 12's -Wuninitialized false positive.
  const UVec wide = (UVec)_mm512_maskz_cvtepu16_epi32(0xFFFF, half);
  return (Vec)(wide << 16);
#else
  const UVec wide = __builtin_convertvector(*reinterpret_cast<const HalfU*>(p), UVec) << 16;
  return (Vec)wide;  // a same-size vector cast reinterprets the bits
#endif
}

inline float bf16_to_float(uint16_t h) {
  union {
    uint32_t u;
    float f;
  } bits{static_cast<uint32_t>(h) << 16};
  return bits.f;
}

inline Vec vmax(Vec a, Vec b) { return a > b ? a : b; }

inline float hsum(Vec v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  v += __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
  return v[0];
}

typedef float Vec4 __attribute__((vector_size(16), aligned(4), may_alias));

// Sums of four vectors, {sum(a), sum(b), sum(c), sum(d)}, with 6 shuffles instead of 12.
inline Vec4 hsum4(Vec a, Vec b, Vec c, Vec d) {
#define TL_LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define TL_HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
  const Vec ab = __builtin_shufflevector(a, b, TL_LO8) + __builtin_shufflevector(a, b, TL_HI8);
  const Vec cd = __builtin_shufflevector(c, d, TL_LO8) + __builtin_shufflevector(c, d, TL_HI8);
#undef TL_LO8
#undef TL_HI8
  // Lanes 8k..8k+7 of ab hold partial sums of a (k = 0) and b (k = 1); likewise cd.
  const Vec x = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                                        26, 27) +
                __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                                        29, 30, 31);
  // Lanes 4k..4k+3 of x hold partial sums of input k.
  const Vec y = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15,
                                            12, 13);
  const Vec z = y + __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12,
                                            15, 14);
  return __builtin_shufflevector(z, z, 0, 4, 8, 12);
}

inline void store4(float* p, Vec4 v) { *reinterpret_cast<Vec4*>(p) = v; }

// 2^x for x <= 0 (softmax arguments), relative error ~1e-7. Inputs below -126 (including -inf,
// the masked scores) return exactly 0 so masked keys contribute nothing.
inline Vec exp2(Vec x) {
  const Vec lo = splat(-126.0f);
  const Vec xc = x < lo ? lo : x;
  // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer; safe because the build
  // does not allow reassociation (no -ffast-math).
  const Vec magic = splat(12582912.0f);
  const Vec n = (xc + magic) - magic;
  const Vec f = xc - n;  // in [-0.5, 0.5]
  // Taylor series of e^(f ln 2) to degree 7: truncation error < 6e-9 on [-0.5, 0.5].
  Vec p = splat(1.525273380405984e-05f);
  p = p * f + 1.5403530393381606e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.618129107628477e-03f;
  p = p * f + 5.550410866482158e-02f;
  p = p * f + 2.402265069591007e-01f;
  p = p * f + 6.931471805599453e-01f;
  p = p * f + 1.0f;
  const IVec bits = (__builtin_convertvector(n, IVec) + 127) << 23;
  const Vec y = p * (Vec)bits;
  return x < lo ? splat(0.0f) : y;
}

// tanh(x), relative error ~2e-7 (the logit soft cap). Near 0 an odd Taylor polynomial (the
// formula below would lose digits to 1 - e there); elsewhere (1 - e) / (1 + e) with
// e = e^(-2|x|), which is exactly 1 from |x| ~ 44 on and for +-inf.
inline Vec tanh(Vec x) {
  const Vec ax = x < 0.0f ? -x : x;
  const Vec e = exp2(ax * splat(-2.8853900817779268f));  // -2 log2(e) |x|
  const Vec far = (1.0f - e) / (1.0f + e);
  // Taylor series to x^11: truncation error < 6e-10 for |x| < 0.3.
  const Vec x2 = x * x;
  Vec p = splat(-8.8632355299021966e-03f);
  p = p * x2 + 2.1869488536155203e-02f;
  p = p * x2 - 5.3968253968253971e-02f;
  p = p * x2 + 1.3333333333333334e-01f;
  p = p * x2 - 3.3333333333333331e-01f;
  const Vec near = x + x * x2 * p;
  return ax < 0.3f ? near : (x < 0.0f ? -far : far);
}

}  // namespace tokenlake::simd
