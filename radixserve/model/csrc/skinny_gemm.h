// The skinny GEMM's inner kernel: one weight row dotted with a few activation rows, per tier.
// skinny_gemm.cpp owns the op (threads, epilogues, dtypes); the semantics and the float64
// reference: radixserve/model/skinny_kernel.py.
//
// Layout: the weight as it is, (N, K) row-major, fp32 or bf16 (bf16 is fp32's upper half:
// widened by a zero-extension and a 16-bit shift, exact). A thread walks its rows one after
// the other, each front to back, so its reads are one sequential stream: on Zen 4 that reads
// memory ~2x faster than 4 rows side by side (4 streams 2.3 KB apart, each only 2.3 KB long,
// which the prefetchers keep losing) and than oneDNN's M=1 product (bench/README.md).
// Each output y[m, n] is kAcc vector accumulators of x[m, :] * W[n, :] (interleaved steps, so
// the FMA latency does not bound a row), summed in a fixed order, then one horizontal sum: it
// depends on that row of x and that row of W only, never on how many rows a call holds (batch
// invariance: a request's row comes out bit-identical at M = 1 and M = 8). Up to kMaxRows rows
// of x per pass over the weight row; more re-read it from L1.
//
// Per tier: AVX-512 (the avx512, avx512_bf16 and amx builds) one zmm per accumulator, 16
// inputs per step; AVX2 + FMA one ymm, 8 inputs; portable 8 floats in plain C++ (the build has
// no -ffast-math and no FMA contraction, so its sums are exactly the order written).
// avx512_bf16 widens bf16 as well rather than vdpbf16ps: the product stays exact and the step
// is bound by reading the weight, not by its arithmetic.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define RS_SKINNY_AVX512 1
#else
#define RS_SKINNY_AVX512 0
#endif
#if !RS_SKINNY_AVX512 && defined(__AVX2__) && defined(__FMA__)
#define RS_SKINNY_AVX2 1
#else
#define RS_SKINNY_AVX2 0
#endif
#if RS_SKINNY_AVX512 || RS_SKINNY_AVX2
#include <immintrin.h>
#endif

namespace radixserve_skinny {

using bf16_t = uint16_t;

constexpr int kAcc = 4;      // accumulators per output (interleaved steps): 4 FMA chains
constexpr int kXPad = 64;    // x's rows are zero padded to a multiple of this many inputs

#if RS_SKINNY_AVX512
struct Vec {
  using T = __m512;
  static constexpr int L = 16;
  static constexpr int kMaxRows = 4;  // 4 x 4 accumulators + a weight + an x: 18 of 32 zmm
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load(const bf16_t* p) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m512i w = _mm512_cvtepu16_epi32(b);
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static float sum(T v) {  // 16 -> 8 -> 4 -> 2 -> 1, the same tree for every accumulator
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
#elif RS_SKINNY_AVX2
struct Vec {
  using T = __m256;
  static constexpr int L = 8;
  static constexpr int kMaxRows = 2;  // 4 x 2 accumulators + a weight + an x: 10 of 16 ymm
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load(const bf16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static float sum(T v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
#else
struct Vec {
  struct T {
    float v[8];
  };
  static constexpr int L = 8;
  static constexpr int kMaxRows = 4;
  static T zero() { return T{}; }
  static T load(const float* p) {
    T t;
    std::memcpy(t.v, p, sizeof(t.v));
    return t;
  }
  static T load(const bf16_t* p) {
    T t;
    for (int j = 0; j < L; ++j)
      t.v[j] = __builtin_bit_cast(float, static_cast<uint32_t>(p[j]) << 16);
    return t;
  }
  static T fma(T a, T b, T c) {  // a product, then a sum: two roundings, as written
    for (int j = 0; j < L; ++j) c.v[j] += a.v[j] * b.v[j];
    return c;
  }
  static T add(T a, T b) {
    for (int j = 0; j < L; ++j) a.v[j] += b.v[j];
    return a;
  }
  static float sum(T v) {
    return ((v.v[0] + v.v[4]) + (v.v[2] + v.v[6])) + ((v.v[1] + v.v[5]) + (v.v[3] + v.v[7]));
  }
};
#endif

// out[m] = sum_k w[k] * x[m * ldx + k] for m < MR: one weight row, read front to back once.
// Step a of each block of kAcc steps (Vec::L inputs each) goes to accumulator a; the row's last
// partial block is read through a zero-padded copy and x's rows are zero padded past K to a
// multiple of kXPad (zero weight times zero input adds nothing), so every index into acc is a
// constant and acc stays in registers. Then ((a0 + a1) + (a2 + a3)) and one horizontal sum:
// the same operations for every m and every MR.
template <typename W, int MR>
inline void dot_row(const W* w, int64_t K, const float* x, int64_t ldx, float* out) {
  constexpr int64_t kBlock = kAcc * Vec::L;
  static_assert(kXPad % kBlock == 0, "x's padding covers a whole block");
  typename Vec::T acc[kAcc][MR];
  for (int a = 0; a < kAcc; ++a)
    for (int m = 0; m < MR; ++m) acc[a][m] = Vec::zero();
  const auto block = [&](const W* wk, const float* xk) {
    for (int a = 0; a < kAcc; ++a) {
      const typename Vec::T wv = Vec::load(wk + a * Vec::L);
      for (int m = 0; m < MR; ++m)
        acc[a][m] = Vec::fma(wv, Vec::load(xk + m * ldx + a * Vec::L), acc[a][m]);
    }
  };
  const int64_t kb = K / kBlock * kBlock;
  for (int64_t k = 0; k < kb; k += kBlock) block(w + k, x + k);
  if (kb < K) {
    alignas(64) W tail[kBlock];
    std::memset(tail, 0, sizeof(tail));
    std::memcpy(tail, w + kb, (K - kb) * sizeof(W));
    block(tail, x + kb);
  }
  for (int m = 0; m < MR; ++m) {
    const typename Vec::T s01 = Vec::add(acc[0][m], acc[1][m]);
    const typename Vec::T s23 = Vec::add(acc[2][m], acc[3][m]);
    out[m] = Vec::sum(Vec::add(s01, s23));
  }
}

// dot_row over M rows of x in passes of at most kMaxRows (the weight row stays in L1).
template <typename W>
inline void dot_rows(const W* w, int64_t K, const float* x, int64_t ldx, int64_t M, float* out) {
  for (int64_t m0 = 0; m0 < M; m0 += Vec::kMaxRows) {
    const int64_t mr = M - m0 < Vec::kMaxRows ? M - m0 : Vec::kMaxRows;
    const float* xm = x + m0 * ldx;
    switch (mr) {
      case 1: dot_row<W, 1>(w, K, xm, ldx, out + m0); break;
      case 2: dot_row<W, 2>(w, K, xm, ldx, out + m0); break;
#if !RS_SKINNY_AVX2
      case 3: dot_row<W, 3>(w, K, xm, ldx, out + m0); break;
      case 4: dot_row<W, 4>(w, K, xm, ldx, out + m0); break;
#endif
      default: break;
    }
  }
}

}  // namespace radixserve_skinny
