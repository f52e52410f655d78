// The panel GEMM's tile kernels, per tier: a few rows of x against one panel of the weight.
// panel_gemm.cpp owns the op (threads, epilogues, dtypes); the layout, its packing and the
// float64 reference: radixserve/model/panel_kernel.py.
//
// Layout: the weight (N, K) cut into panels of kR output channels; panel p is (K, kR) fp32,
// or (ceil(K / 2), kR, 2) bf16 (each 32-bit lane holds a channel's inputs 2j and 2j + 1: bf16
// is fp32's upper half, so a shift gives the even one and a mask the odd one, exact). A panel
// is one contiguous block and the panels follow each other, so a decode step (one row of x)
// reads the whole weight as a single sequential stream, the access the prefetchers follow
// best; a prefill tile reuses the panel from L1/L2 for every kMR rows of x. The same layout
// serves both, so the model keeps one copy of each weight (kR = two vectors: 32 channels on
// AVX-512, 16 on AVX2 and in the portable build: packing asks the op, panel_width()).
//
// Arithmetic: y[m, n] is one fp32 accumulator (one vector lane) that adds x[m, k] * W[n, k]
// for k = 0, 1, 2, ... in order (on the vdpbf16ps path the pair 2j, 2j + 1 at once), so it
// depends on that row of x and that row of W only: the same bits at any M, in decode or in
// prefill (batch invariance). No horizontal sums. The accumulators of one tile (kMR rows x
// kR channels) are the independent chains that hide the FMA latency.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define RS_PANEL_AVX512 1
#else
#define RS_PANEL_AVX512 0
#endif
#if !RS_PANEL_AVX512 && defined(__AVX2__) && defined(__FMA__)
#define RS_PANEL_AVX2 1
#else
#define RS_PANEL_AVX2 0
#endif
#if RS_PANEL_AVX512 || RS_PANEL_AVX2
#include <immintrin.h>

#include "../../attention/csrc/vec_math.h"  // exp_ps, exp256: the gated epilogue's silu
#endif
#if RS_PANEL_AVX512 && defined(__AVX512BF16__)
#define RS_PANEL_DPBF16 1
#else
#define RS_PANEL_DPBF16 0
#endif

namespace radixserve_panel {

using bf16_t = uint16_t;

#if RS_PANEL_AVX512
struct Vec {
  using T = __m512;
  static constexpr int L = 16;
  static constexpr int kMR = 12;  // 12 x 2 accumulators + 2 weights (4 bf16 halves) + x: < 32
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T bcast(float v) { return _mm512_set1_ps(v); }
  static void load2(const bf16_t* p, T& even, T& odd) {  // L lanes of (even, odd) bf16 pairs
    const __m512i v = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536)));
  }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T div(T a, T b) { return _mm512_div_ps(a, b); }
  static T clamp(T v, float lo, float hi) {
    return _mm512_min_ps(_mm512_max_ps(v, bcast(lo)), bcast(hi));
  }
  static T exp(T x) { return radixserve_vec::exp_ps(x); }  // x in [-87, 88]
};
#elif RS_PANEL_AVX2
struct Vec {
  using T = __m256;
  static constexpr int L = 8;
  static constexpr int kMR = 6;  // 6 x 2 accumulators + 2 weights + x: 15 of 16 ymm
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T bcast(float v) { return _mm256_set1_ps(v); }
  static void load2(const bf16_t* p, T& even, T& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(-65536)));
  }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T div(T a, T b) { return _mm256_div_ps(a, b); }
  static T clamp(T v, float lo, float hi) {
    return _mm256_min_ps(_mm256_max_ps(v, bcast(lo)), bcast(hi));
  }
  static T exp(T x) { return radixserve_vec::exp256(x); }  // x in [-87, 88]
};
#else
struct Vec {  // plain C++ (any CPU): no -ffast-math, no contraction, so a product then a sum
  struct T {
    float v[8];
  };
  static constexpr int L = 8;
  static constexpr int kMR = 4;
  static T zero() { return T{}; }
  static T load(const float* p) {
    T t;
    std::memcpy(t.v, p, sizeof(t.v));
    return t;
  }
  static T bcast(float v) {
    T t;
    for (float& e : t.v) e = v;
    return t;
  }
  static void load2(const bf16_t* p, T& even, T& odd) {
    for (int j = 0; j < L; ++j) {
      even.v[j] = __builtin_bit_cast(float, static_cast<uint32_t>(p[2 * j]) << 16);
      odd.v[j] = __builtin_bit_cast(float, static_cast<uint32_t>(p[2 * j + 1]) << 16);
    }
  }
  static T fma(T a, T b, T c) {
    for (int j = 0; j < L; ++j) c.v[j] += a.v[j] * b.v[j];
    return c;
  }
  static void store(float* p, T v) { std::memcpy(p, v.v, sizeof(v.v)); }
};
#endif

constexpr int kC = 2;              // vectors per panel row
constexpr int kR = kC * Vec::L;    // output channels per panel

#if RS_PANEL_AVX512 || RS_PANEL_AVX2
// silu(g) = g / (1 + exp(-g)) on a vector, for the gated epilogue (a scalar expf per output
// cost prefill's SwiGLU about a third of its GEMM time), by the attention kernels' vector exp
// (vec_math.h; ~1 ulp). Its argument clamped to [-87, 88], where 2^n is a normal float: for g
// below -88, silu(g) (under 1e-36) comes out as g e^-88.
inline Vec::T silu(Vec::T g) {
  const Vec::T e = Vec::exp(Vec::clamp(Vec::mul(g, Vec::bcast(-1.f)), -87.f, 88.f));
  return Vec::div(g, Vec::add(Vec::bcast(1.f), e));
}
#endif

// The tile's accumulators to out (MR, kR) fp32.
template <int MR>
inline void store_tile(typename Vec::T (&acc)[MR][kC], float* out) {
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < kC; ++c) Vec::store(out + m * kR + c * Vec::L, acc[m][c]);
}

// fp32 panel (K, kR) against MR rows of fp32 x (row m at x + m * ldx): out (MR, kR).
template <int MR>
inline void tile_f32(const float* w, int64_t K, const float* x, int64_t ldx, float* out) {
  typename Vec::T acc[MR][kC];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < kC; ++c) acc[m][c] = Vec::zero();
  for (int64_t k = 0; k < K; ++k) {
    typename Vec::T wv[kC];
    for (int c = 0; c < kC; ++c) wv[c] = Vec::load(w + k * kR + c * Vec::L);
    for (int m = 0; m < MR; ++m) {
      const typename Vec::T b = Vec::bcast(x[m * ldx + k]);
      for (int c = 0; c < kC; ++c) acc[m][c] = Vec::fma(wv[c], b, acc[m][c]);
    }
  }
  store_tile<MR>(acc, out);
}

// bf16 panel (K2 = ceil(K / 2), kR, 2) widened in registers, against fp32 x zero padded to
// 2 * K2 inputs: input 2j's product is added, then 2j + 1's (the fp32 path's order).
template <int MR>
inline void tile_bf16(const bf16_t* w, int64_t K2, const float* x, int64_t ldx, float* out) {
  typename Vec::T acc[MR][kC];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < kC; ++c) acc[m][c] = Vec::zero();
  for (int64_t j = 0; j < K2; ++j) {
    typename Vec::T even[kC], odd[kC];
    for (int c = 0; c < kC; ++c) Vec::load2(w + (j * kR + c * Vec::L) * 2, even[c], odd[c]);
    for (int m = 0; m < MR; ++m) {
      const typename Vec::T b0 = Vec::bcast(x[m * ldx + 2 * j]);
      const typename Vec::T b1 = Vec::bcast(x[m * ldx + 2 * j + 1]);
      for (int c = 0; c < kC; ++c) acc[m][c] = Vec::fma(odd[c], b1, Vec::fma(even[c], b0, acc[m][c]));
    }
  }
  store_tile<MR>(acc, out);
}

#if RS_PANEL_DPBF16
// bf16 panel against bf16 x (zero padded to 2 * K2 inputs) by vdpbf16ps: each lane adds its
// pair's two exact products (denormals flushed), half the instructions of widening.
template <int MR>
inline void tile_dp(const bf16_t* w, int64_t K2, const bf16_t* x, int64_t ldx, float* out) {
  __m512 acc[MR][kC];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < kC; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < K2; ++j) {
    __m512bh wv[kC];
    for (int c = 0; c < kC; ++c)
      wv[c] = (__m512bh)_mm512_loadu_si512(w + (j * kR + c * Vec::L) * 2);
    for (int m = 0; m < MR; ++m) {
      uint32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * j, sizeof(pair));
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < kC; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], wv[c], b);
    }
  }
  store_tile<MR>(acc, out);
}
#endif

// f(std::integral_constant<int, mr>{}) for mr in [I, Vec::kMR]: a tile's row count is a
// template argument (its accumulators an array the compiler keeps in registers).
template <int I = 1, typename F>
inline void with_rows(int mr, F&& f) {
  if constexpr (I <= Vec::kMR) {
    if (mr == I) f(std::integral_constant<int, I>{});
    else with_rows<I + 1>(mr, f);
  }
}

}  // namespace radixserve_panel
