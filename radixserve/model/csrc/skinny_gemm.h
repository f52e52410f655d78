// The skinny GEMM's inner kernel: one weight row dotted with a few activation rows, per tier.
// skinny_gemm.cpp owns the op (threads, epilogues, dtypes); the semantics and the float64
// reference: radixserve/model/skinny_kernel.py.
//
// Layout: the weight as it is, (N, K) row-major, fp32 or bf16 (bf16 is fp32's upper half:
// a 32-bit lane of two bf16 gives the even one by a 16-bit shift and the odd one by a mask,
// exact; x is laid out to match, x_slot). A thread walks its rows one after
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
// The avx512_bf16 and amx builds multiply bf16 weights with bf16 x by vdpbf16ps (dot_row_dp):
// widening costs two integer ops per 32 weights and twice the FMAs, which at 4-8 rows of x
// made the step bound by arithmetic, not by reading the weight.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

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
constexpr int kXPad = 128;   // x's rows are zero padded to a multiple of this many inputs

#if RS_SKINNY_AVX512
struct Vec {
  using T = __m512;
  static constexpr int L = 16;
  static constexpr int kMaxRows = 4;  // 4 x 4 accumulators + a weight + an x: 18 of 32 zmm
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  // 2L bf16 -> inputs 0, 2, 4, ... (the low halves, shifted up) and 1, 3, 5, ... (the high
  // halves, masked) as fp32: one load and two integer ops for 32 weights
  static void load2(const bf16_t* p, T& even, T& odd) {
    const __m512i v = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
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
  static void load2(const bf16_t* p, T& even, T& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
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
  static void load2(const bf16_t* p, T& even, T& odd) {
    for (int j = 0; j < L; ++j) {
      even.v[j] = __builtin_bit_cast(float, static_cast<uint32_t>(p[2 * j]) << 16);
      odd.v[j] = __builtin_bit_cast(float, static_cast<uint32_t>(p[2 * j + 1]) << 16);
    }
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

// Where input k of x goes in the padded fp32 copy the kernel reads: for fp32 weights in order;
// for bf16 weights, each group of 2L inputs as its even inputs, then its odd ones (Vec::load2's
// order), so that one weight load pairs with two plain x loads.
inline int64_t x_slot(int64_t k, bool bf16_weights) {
  if (!bf16_weights) return k;
  const int64_t g = k / (2 * Vec::L), j = k % (2 * Vec::L);
  return g * 2 * Vec::L + (j % 2) * Vec::L + j / 2;
}

// out[m] = sum_k w[k] * x[m * ldx + k] for m < MR: one weight row, read front to back once.
// Each block of kAcc * L inputs is kAcc steps, step a into accumulator a (bf16: two loads of 2L
// weights, their even and odd inputs into accumulators 2i and 2i + 1); the row's last partial
// block is read through a zero-padded copy and x's rows are zero padded past K to a multiple
// of kXPad (zero weight times zero input adds nothing), so every index into acc is a constant
// and acc stays in registers. Then ((a0 + a1) + (a2 + a3)) and one horizontal sum: the same
// operations for every m and every MR.
template <typename W, int MR>
inline void dot_row(const W* w, int64_t K, const float* x, int64_t ldx, float* out) {
  constexpr int64_t kBlock = kAcc * Vec::L;
  static_assert(kXPad % kBlock == 0 && kAcc == 4, "x's padding covers a whole block");
  typename Vec::T acc[kAcc][MR];
  for (int a = 0; a < kAcc; ++a)
    for (int m = 0; m < MR; ++m) acc[a][m] = Vec::zero();
  const auto fma_rows = [&](int a, const typename Vec::T& wv, const float* xk) {
    for (int m = 0; m < MR; ++m) acc[a][m] = Vec::fma(wv, Vec::load(xk + m * ldx), acc[a][m]);
  };
  const auto block = [&](const W* wk, const float* xk) {
    if constexpr (std::is_same_v<W, bf16_t>) {
      for (int i = 0; i < kAcc / 2; ++i) {
        typename Vec::T even, odd;
        Vec::load2(wk + i * 2 * Vec::L, even, odd);
        fma_rows(2 * i, even, xk + i * 2 * Vec::L);
        fma_rows(2 * i + 1, odd, xk + i * 2 * Vec::L + Vec::L);
      }
    } else {
      for (int a = 0; a < kAcc; ++a) fma_rows(a, Vec::load(wk + a * Vec::L), xk + a * Vec::L);
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

#if RS_SKINNY_AVX512 && defined(__AVX512BF16__)
#define RS_SKINNY_DPBF16 1
// dot_row for bf16 weights and bf16 x (the avx512_bf16 and amx builds): vdpbf16ps multiplies
// 32 weights with 32 inputs (both in their natural order: a lane holds inputs 2j and 2j + 1)
// into 16 fp32 lanes, half the instructions of widening and no integer ops, which is what
// keeps 2-8 rows of x bound by the weight's bytes. The products are exact (bf16 x bf16 fits
// fp32); each lane adds its pair's two products to the accumulator (denormals flushed).
// Blocks of kAcc steps, the tail and the sums as dot_row.
template <int MR>
inline void dot_row_dp(const bf16_t* w, int64_t K, const bf16_t* x, int64_t ldx, float* out) {
  constexpr int64_t kStep = 32, kBlock = kAcc * kStep;
  static_assert(kXPad % kBlock == 0, "x's padding covers a whole block");
  __m512 acc[kAcc][MR];
  for (int a = 0; a < kAcc; ++a)
    for (int m = 0; m < MR; ++m) acc[a][m] = _mm512_setzero_ps();
  const auto block = [&](const bf16_t* wk, const bf16_t* xk) {
    for (int a = 0; a < kAcc; ++a) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wk + a * kStep);
      for (int m = 0; m < MR; ++m)
        acc[a][m] = _mm512_dpbf16_ps(acc[a][m], wv,
                                     (__m512bh)_mm512_loadu_si512(xk + m * ldx + a * kStep));
    }
  };
  const int64_t kb = K / kBlock * kBlock;
  for (int64_t k = 0; k < kb; k += kBlock) block(w + k, x + k);
  if (kb < K) {
    alignas(64) bf16_t tail[kBlock];
    std::memset(tail, 0, sizeof(tail));
    std::memcpy(tail, w + kb, (K - kb) * sizeof(bf16_t));
    block(tail, x + kb);
  }
  for (int m = 0; m < MR; ++m) {
    const __m512 s01 = _mm512_add_ps(acc[0][m], acc[1][m]);
    const __m512 s23 = _mm512_add_ps(acc[2][m], acc[3][m]);
    out[m] = Vec::sum(_mm512_add_ps(s01, s23));
  }
}

// dot_row_dp over M rows of x in passes of at most kMaxRows.
inline void dot_rows_dp(const bf16_t* w, int64_t K, const bf16_t* x, int64_t ldx, int64_t M,
                        float* out) {
  for (int64_t m0 = 0; m0 < M; m0 += Vec::kMaxRows) {
    const int64_t mr = M - m0 < Vec::kMaxRows ? M - m0 : Vec::kMaxRows;
    const bf16_t* xm = x + m0 * ldx;
    switch (mr) {
      case 1: dot_row_dp<1>(w, K, xm, ldx, out + m0); break;
      case 2: dot_row_dp<2>(w, K, xm, ldx, out + m0); break;
      case 3: dot_row_dp<3>(w, K, xm, ldx, out + m0); break;
      default: dot_row_dp<4>(w, K, xm, ldx, out + m0); break;
    }
  }
}
#else
#define RS_SKINNY_DPBF16 0
#endif

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
