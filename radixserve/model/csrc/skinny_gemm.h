// The skinny GEMM's inner kernel: dot products of a few weight rows with a few activation rows,
// per tier. skinny_gemm.cpp owns the op (threads, epilogues, dtypes); the semantics and the
// float64 reference: radixserve/model/skinny_kernel.py.
//
// Layout: the weight as it is, (N, K) row-major, fp32 or bf16 (bf16 is fp32's upper half:
// widened by a zero-extension and a 16-bit shift, exact). Each output y[m, n] is one vector
// accumulator of x[m, :] * W[n, :] over K in steps of the tier's vector width, then one
// horizontal sum in a fixed order: it depends on that row of x and that row of W only, never
// on how many rows of x or W a call or a tile holds (batch invariance: a request's row comes
// out bit-identical at M = 1 and M = 8). A tile reads R weight rows once from memory and
// multiplies them with up to kMaxRows rows of x; more rows of x re-read the tile from L1.
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

constexpr int R = 4;         // weight rows per tile (each streamed once per tile)
constexpr int kXPad = 16;    // x's rows are zero padded to a multiple of this many inputs

#if RS_SKINNY_AVX512
struct Vec {
  using T = __m512;
  static constexpr int L = 16;
  static constexpr int kMaxRows = 4;  // 4 x 4 accumulators + 4 weights + 1 x: 21 of 32 zmm
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load(const bf16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
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
  static constexpr int kMaxRows = 2;  // 4 x 2 accumulators + 4 weights + 2 x: 14 of 16 ymm
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load(const bf16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
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
    for (int j = 0; j < L; ++j) t.v[j] = __builtin_bit_cast(float, static_cast<uint32_t>(p[j]) << 16);
    return t;
  }
  static T fma(T a, T b, T c) {  // a product, then a sum: two roundings, as written
    for (int j = 0; j < L; ++j) c.v[j] += a.v[j] * b.v[j];
    return c;
  }
  static float sum(T v) {
    return ((v.v[0] + v.v[4]) + (v.v[2] + v.v[6])) + ((v.v[1] + v.v[5]) + (v.v[3] + v.v[7]));
  }
};
#endif

static_assert(kXPad % Vec::L == 0, "x padding covers a whole vector step");

// out[r * MR + m] = sum_k w[r][k] * x[m * ldx + k] for r < R, m < MR. x's rows are zero padded
// past K to a multiple of kXPad; a weight row's last partial step is read through a zero-padded
// copy (zero weight times zero input adds nothing). The same operations for every (r, m).
template <typename W, int MR>
inline void dot_tile(const W* const* w, int64_t K, const float* x, int64_t ldx, float* out) {
  typename Vec::T acc[R][MR];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = Vec::zero();
  const int64_t kv = K / Vec::L * Vec::L;
  for (int64_t k = 0; k < kv; k += Vec::L) {
    typename Vec::T xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = Vec::load(x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      const typename Vec::T wv = Vec::load(w[r] + k);
      for (int m = 0; m < MR; ++m) acc[r][m] = Vec::fma(wv, xv[m], acc[r][m]);
    }
  }
  if (kv < K) {
    alignas(64) W tail[Vec::L];
    for (int r = 0; r < R; ++r) {
      std::memset(tail, 0, sizeof(tail));
      std::memcpy(tail, w[r] + kv, (K - kv) * sizeof(W));
      const typename Vec::T wv = Vec::load(tail);
      for (int m = 0; m < MR; ++m) acc[r][m] = Vec::fma(wv, Vec::load(x + m * ldx + kv), acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) out[r * MR + m] = Vec::sum(acc[r][m]);
}

// dot_tile over M rows of x in tiles of at most kMaxRows: out[r * M + m].
template <typename W>
inline void dot_rows(const W* const* w, int64_t K, const float* x, int64_t ldx, int64_t M,
                     float* out) {
  float part[R * Vec::kMaxRows];
  for (int64_t m0 = 0; m0 < M; m0 += Vec::kMaxRows) {
    const int64_t mr = M - m0 < Vec::kMaxRows ? M - m0 : Vec::kMaxRows;
    const float* xm = x + m0 * ldx;
    switch (mr) {
      case 1: dot_tile<W, 1>(w, K, xm, ldx, part); break;
      case 2: dot_tile<W, 2>(w, K, xm, ldx, part); break;
#if !RS_SKINNY_AVX2
      case 3: dot_tile<W, 3>(w, K, xm, ldx, part); break;
      case 4: dot_tile<W, 4>(w, K, xm, ldx, part); break;
#endif
      default: break;
    }
    for (int r = 0; r < R; ++r)
      for (int64_t m = 0; m < mr; ++m) out[r * M + m0 + m] = part[r * mr + m];
  }
}

}  // namespace radixserve_skinny
