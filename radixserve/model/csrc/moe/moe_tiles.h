// The dense pieces of the CPU MoE kernel (moe_experts.cpp): the micro tile of dot products
// along weight rows, the row-block GEMM over it, and SiLU, per CPU tier (AVX-512, AVX512-BF16,
// AVX2, plain C++). Weights float, bf16 (widened by a shift) or int8 codes (widened, the
// channel's scale applied to the sum). A build's name carries a digest of this header.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../../../attention/csrc/bf16_access.h"
#include "../../../attention/csrc/vec_math.h"

namespace radixserve_moe {

using radixserve_bf16::bf16_t;
using radixserve_bf16::ld;
inline float ld(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }

constexpr int NR = 4;            // output channels per micro tile
constexpr int64_t PF_QUADS = 2;  // prefetch distance, in quads of weight rows
#if defined(__AVX512F__)
constexpr int MR = 4;  // rows per micro tile: 16 zmm accumulators
#else
constexpr int MR = 2;  // 8 ymm accumulators (16 registers in all on AVX2)
#endif

inline float round_bf16(float v) {
  bf16_t b;
  radixserve_bf16::st(&b, 0, v);
  return radixserve_bf16::ld(&b, 0);
}

// The weight rows stream from memory once per step; a prefetch `pf` elements ahead (the
// quads two ahead: the next rows of the same block) keeps that stream in flight while the
// current quad computes. A prefetch past the block's end is harmless (it never faults).
// Into L2 (locality 2: prefetcht1), not L1: an L1 prefetch holds one of the core's few L1
// miss buffers for the whole trip from memory, which capped the stream at about 6 GB/s per
// core here (Zen 4, a decode step's ~2 rows per expert); into L2 the same distance streams
// at ~11 GB/s per core, and the quad's loads then hit L2 (bench/README.md, "Mixture of
// experts on CPU").
template <typename WT>
inline void prefetch(const WT* p) {
  __builtin_prefetch(p, 0, 2);
}

// ---- micro tile: out[r * NR + c] = sum_k x[r][k] * w[c][k], r < mr ----

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_t* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
inline __m512 load16(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
inline __m512 load16(const bf16_t* p, __mmask16 m) {
  const __m256i b = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

template <int mr>
inline void reduce_tile(__m512 (&acc)[mr][NR], float* out) {
  if constexpr (mr == 4) {
    _mm512_storeu_ps(out, radixserve_vec::sum16(&acc[0][0]));
  } else {
    for (int r = 0; r < mr; ++r)
      for (int c = 0; c < NR; ++c) out[r * NR + c] = _mm512_reduce_add_ps(acc[r][c]);
  }
}

template <int mr, typename WT>
void dot_tile(const float* const* x, const WT* const* w, int64_t K, int64_t pf, float* out) {
  __m512 acc[mr][NR];
  for (int r = 0; r < mr; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NR];
    for (int c = 0; c < NR; ++c) prefetch(w[c] + k + pf);
    for (int c = 0; c < NR; ++c) wv[c] = load16(w[c] + k);
    for (int r = 0; r < mr; ++r) {
      const __m512 xv = _mm512_loadu_ps(x[r] + k);
      for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[NR];
    for (int c = 0; c < NR; ++c) wv[c] = load16(w[c] + k, m);
    for (int r = 0; r < mr; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x[r] + k);
      for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  reduce_tile<mr>(acc, out);
}
#elif defined(RS_VEC_AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
inline __m256 load8(const bf16_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

template <int mr, typename WT>
void dot_tile(const float* const* x, const WT* const* w, int64_t K, int64_t pf, float* out) {
  __m256 acc[mr][NR];
  for (int r = 0; r < mr; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NR];
    if ((k & 15) == 0)
      for (int c = 0; c < NR; ++c) prefetch(w[c] + k + pf);
    for (int c = 0; c < NR; ++c) wv[c] = load8(w[c] + k);
    for (int r = 0; r < mr; ++r) {
      const __m256 xv = _mm256_loadu_ps(x[r] + k);
      for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  if constexpr (mr == 2) {
    _mm256_storeu_ps(out, radixserve_vec::sum8(&acc[0][0]));
  } else {
    for (int r = 0; r < mr; ++r)
      for (int c = 0; c < NR; ++c) out[r * NR + c] = radixserve_vec::hsum8(acc[r][c]);
  }
  for (; k < K; ++k)  // the tail (K not a multiple of 8)
    for (int r = 0; r < mr; ++r)
      for (int c = 0; c < NR; ++c) out[r * NR + c] += x[r][k] * ld(w[c], k);
}
#else
template <int mr, typename WT>
void dot_tile(const float* const* x, const WT* const* w, int64_t K, int64_t pf, float* out) {
  for (int r = 0; r < mr; ++r)
    for (int c = 0; c < NR; ++c) {
      const float* xr = x[r];
      const WT* wc = w[c];
      for (int64_t k = 0; k < K; k += 16) prefetch(wc + k + pf);
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < K; ++k) s += xr[k] * ld(wc, k);
      out[r * NR + c] = s;
    }
}
#endif

#if defined(__AVX512BF16__)
// 32 bf16 pairs' products for each of the tile's accumulators (vdpbf16ps); m masks a tail.
template <int mr, bool tail>
inline void dp_step(const bf16_t* const* x, const bf16_t* const* w, int64_t k, __mmask32 m,
                    __m512 (&acc)[mr][NR]) {
  __m512bh wv[NR];
  for (int c = 0; c < NR; ++c)
    wv[c] = (__m512bh)(tail ? _mm512_maskz_loadu_epi16(m, w[c] + k) : _mm512_loadu_si512(w[c] + k));
  for (int r = 0; r < mr; ++r) {
    const __m512bh xv =
        (__m512bh)(tail ? _mm512_maskz_loadu_epi16(m, x[r] + k) : _mm512_loadu_si512(x[r] + k));
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
  }
}

// bf16 x bf16 pairs summed in fp32 by vdpbf16ps: 32 products per instruction, no widening.
template <int mr>
void dot_tile(const bf16_t* const* x, const bf16_t* const* w, int64_t K, int64_t pf,
              float* out) {
  __m512 acc[mr][NR];
  for (int r = 0; r < mr; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    for (int c = 0; c < NR; ++c) prefetch(w[c] + k + pf);
    dp_step<mr, false>(x, w, k, 0, acc);
  }
  if (k < K) dp_step<mr, true>(x, w, k, static_cast<__mmask32>((1u << (K - k)) - 1), acc);
  reduce_tile<mr>(acc, out);
}
#endif

// out (nrows, nch) at stride ldo = rows @ W[0:nch].T, W's rows K long, each channel's sum
// times scale[c] where given (int8 codes): channel quads outer (a quad's weight rows stay in
// L1 while every row tile passes), row tiles inner.
template <typename XT, typename WT>
void gemm_rows(const XT* const* rows, int64_t nrows, const WT* w, const float* scale,
               int64_t nch, int64_t K, float* out, int64_t ldo) {
  float tile[MR * NR];
  for (int64_t c0 = 0; c0 < nch; c0 += NR) {
    const WT* wp[NR];
    for (int c = 0; c < NR; ++c) wp[c] = w + std::min<int64_t>(c0 + c, nch - 1) * K;
    const int nc = static_cast<int>(std::min<int64_t>(NR, nch - c0));
    for (int64_t r0 = 0; r0 < nrows; r0 += MR) {
      const int mr = static_cast<int>(std::min<int64_t>(MR, nrows - r0));
      // the first row tile streams the quad from memory: prefetch two quads ahead; later
      // tiles find it in L1
      const int64_t pf = r0 == 0 ? PF_QUADS * NR * K : 0;
      if (mr == 1) dot_tile<1>(rows + r0, wp, K, pf, tile);
      else if (mr == 2) dot_tile<2>(rows + r0, wp, K, pf, tile);
#if defined(__AVX512F__)
      else if (mr == 3) dot_tile<3>(rows + r0, wp, K, pf, tile);
      else dot_tile<4>(rows + r0, wp, K, pf, tile);
#endif
      if (scale != nullptr)
        for (int r = 0; r < mr; ++r)
          for (int c = 0; c < nc; ++c) tile[r * NR + c] *= scale[c0 + c];
      for (int r = 0; r < mr; ++r)
        std::memcpy(out + (r0 + r) * ldo + c0, tile + r * NR, nc * sizeof(float));
    }
  }
}

// s[j] = silu(g[j]) = g / (1 + e^-g), as torch computes it (the exponent clamped to +-80,
// where the result is g or 0 to fp32's precision anyway).
inline void silu_row(const float* g, int64_t n, float* s) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 lo = _mm512_set1_ps(-80.f), hi = _mm512_set1_ps(80.f), one = _mm512_set1_ps(1.f);
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(g + j);
    const __m512 a = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), v), lo), hi);
    _mm512_storeu_ps(s + j, _mm512_div_ps(v, _mm512_add_ps(one, radixserve_vec::exp_ps(a))));
  }
#elif defined(RS_VEC_AVX2)
  const __m256 lo = _mm256_set1_ps(-80.f), hi = _mm256_set1_ps(80.f), one = _mm256_set1_ps(1.f);
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(g + j);
    const __m256 a = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), v), lo), hi);
    _mm256_storeu_ps(s + j, _mm256_div_ps(v, _mm256_add_ps(one, radixserve_vec::exp256(a))));
  }
#endif
  for (; j < n; ++j) s[j] = g[j] / (1.f + std::exp(-std::min(std::max(g[j], -80.f), 80.f)));
}

constexpr int64_t kSiluMax = 64;  // channels per silu_mul call at most

// h[j] = silu(g[j]) * u[j]; `round`: a bf16 layer's roundings (HF rounds the gate and up
// outputs, the silu and the product to bf16). g and u are overwritten.
template <typename HT>
inline void silu_mul(float* g, float* u, int64_t n, bool round, HT* h) {
  float s[kSiluMax];
  if (round) {
    for (int64_t j = 0; j < n; ++j) {
      g[j] = round_bf16(g[j]);
      u[j] = round_bf16(u[j]);
    }
  }
  silu_row(g, n, s);
  for (int64_t j = 0; j < n; ++j)
    radixserve_bf16::st(h, j, round ? round_bf16(round_bf16(s[j]) * u[j]) : s[j] * u[j]);
}

}  // namespace radixserve_moe
