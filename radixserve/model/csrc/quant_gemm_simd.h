// The quantized GEMM's decode blocks with explicit intrinsics, per tier: AVX-512 (avx512,
// avx512_bf16 and amx builds: one zmm holds a block's 16 channels) and AVX2 + FMA + F16C (the
// avx2 build: two ymm). The portable build compiles none of this (quant_gemm.h's plain loops).
//
// A block's codes are widened in registers and dotted with x as they are, two inputs per
// step (int4: one packed pair; int8 / fp8: two consecutive inputs), into 4 independent
// accumulators per row (FMA latency, not throughput, would bound one chain): the zero point
// and the scale are applied once per group, y += s * (acc - z * sum(x)), so the inner loop
// has no per-weight multiply. Widening: int4 one zero-extension per 16 bytes, then a mask
// (input 2p) and a shift (input 2p + 1); int8 a zero-extension; fp8 e4m3 a sign-extension to
// 16 bits, a shift and a mask put its exponent and mantissa into fp16's fields (2^-8 of its
// value, subnormals included: fp16 has 8 more exponent bias) and vcvtph2ps widens it: no
// table, no branch; the 256 is folded into the group's scale.
#pragma once

#include <type_traits>

#include "quant_gemm.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RS_QUANT_AVX512 1
#else
#define RS_QUANT_AVX512 0
#endif
#if !RS_QUANT_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RS_QUANT_AVX2 1
#else
#define RS_QUANT_AVX2 0
#endif
#if RS_QUANT_AVX512 || RS_QUANT_AVX2
#include <immintrin.h>
#endif

namespace radixserve_quant {

constexpr float kFp8Factor = 256.f;  // the fp16 route gives e4m3 values times 2^-8

#if RS_QUANT_AVX512
constexpr int kDecodeRows = 4;  // rows per decode block: 16 accumulators + 4 outputs in zmm

// 16 codes -> 16 floats: int8 (zero-extended), fp8 (times 2^-8, see above)
template <int kind>
inline __m512 widen16(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (kind == kInt8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
  } else {
    const __m256i w = _mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(w, _mm256_set1_epi16(static_cast<short>(0xBF80))));
  }
}

// Inputs k and k + 1 of a block (k even for int4) as w[0], w[1].
template <int kind>
inline void widen_pair(const uint8_t* blk, int64_t k, __m512* w) {
  if constexpr (kind == kInt4) {
    const __m512i c = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + k / 2 * CB)));
    w[0] = _mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(0xF)));
    w[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4));
  } else {
    w[0] = widen16<kind>(blk + k * CB);
    w[1] = widen16<kind>(blk + (k + 1) * CB);
  }
}

template <int kind, int mr>
void decode_block_simd(const Operands& o, int64_t nb, int64_t r0, float* out) {
  const uint8_t* blk = o.packed + nb * o.block_bytes(kind);
  const float* x = o.x + r0 * o.Kp;
  __m512 y[mr];
  for (int r = 0; r < mr; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < o.G; ++g) {
    __m512 a[mr][4];
    for (int r = 0; r < mr; ++r)
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_ps();
    int64_t k = g * o.group;
    const int64_t k1 = o.group_end(g);
    for (; k + 4 <= k1; k += 4) {
      __m512 w[4];
      widen_pair<kind>(blk, k, w);
      widen_pair<kind>(blk, k + 2, w + 2);
      for (int r = 0; r < mr; ++r)
        for (int c = 0; c < 4; ++c)
          a[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * o.Kp + k + c]), w[c], a[r][c]);
    }
    for (; k < k1; k += 2) {  // int4: a last pair; int8 / fp8: a last one or two inputs
      __m512 w[2];
      if (kind == kInt4 || k + 2 <= k1) {
        widen_pair<kind>(blk, k, w);
      } else {
        w[0] = widen16<kind == kInt4 ? kInt8 : kind>(blk + k * CB);
        w[1] = _mm512_setzero_ps();  // x[k + 1] may lie in the next group
      }
      for (int r = 0; r < mr; ++r)
        for (int c = 0; c < 2; ++c)
          a[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(c == 0 || k + 1 < k1 ? x[r * o.Kp + k + c]
                                                                        : 0.f), w[c], a[r][c]);
    }
    __m512 s = _mm512_loadu_ps(o.scale + (nb * o.G + g) * CB);
    if constexpr (kind == kFp8) s = _mm512_mul_ps(s, _mm512_set1_ps(kFp8Factor));
    for (int r = 0; r < mr; ++r) {
      __m512 acc = _mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]),
                                 _mm512_add_ps(a[r][2], a[r][3]));
      if constexpr (kind != kFp8) {
        const __m512 z = _mm512_loadu_ps(o.zero + (nb * o.G + g) * CB);
        acc = _mm512_fnmadd_ps(z, _mm512_set1_ps(o.xsum[(r0 + r) * o.G + g]), acc);
      }
      y[r] = _mm512_fmadd_ps(s, acc, y[r]);
    }
  }
  for (int r = 0; r < mr; ++r) _mm512_storeu_ps(out + r * CB, y[r]);
}

// 16 floats -> 16 bf16 bits, rounded to nearest even with integer ops (the same bits as
// quant_gemm.cpp's scalar to_bf16_bits on every tier; weights are finite).
inline __m256i to_bf16x16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

template <typename T>
inline void store16(__m512 v, T* dst) {
  if constexpr (std::is_same_v<T, float>) _mm512_storeu_ps(dst, v);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), to_bf16x16(v));
}

// Inputs [k0, k1) of a block (within one group; k0 even for int4), dequantized: row k - k0
// of dst (ld apart) gets their 16 channels as float or bf16 bits.
template <int kind, typename T>
void dequant_rows_simd(const uint8_t* blk, int64_t k0, int64_t k1, const float* s,
                       const float* z, T* dst, int64_t ld) {
  const __m512 sv = _mm512_mul_ps(_mm512_loadu_ps(s),
                                  _mm512_set1_ps(kind == kFp8 ? kFp8Factor : 1.f));
  // (code - zero) * scale rounded once, as QWeight.dequantize (the fp32 path's exactness)
  const __m512 zv = kind == kFp8 ? _mm512_setzero_ps() : _mm512_loadu_ps(z);
  for (int64_t k = k0; k < k1; k += 2) {
    __m512 w[2];
    if (kind == kInt4 || k + 2 <= k1) widen_pair<kind>(blk, k, w);
    else w[0] = widen16<kind == kInt4 ? kInt8 : kind>(blk + k * CB);
    store16(_mm512_mul_ps(_mm512_sub_ps(w[0], zv), sv), dst + (k - k0) * ld);
    if (k + 1 < k1)
      store16(_mm512_mul_ps(_mm512_sub_ps(w[1], zv), sv), dst + (k + 1 - k0) * ld);
  }
}
#endif  // RS_QUANT_AVX512

#if RS_QUANT_AVX2
constexpr int kDecodeRows = 2;  // rows per decode block: 8 accumulators + 4 codes in ymm

// 16 codes -> channels 0-7 (h[0]) and 8-15 (h[1]) as floats (fp8 times 2^-8)
template <int kind>
inline void widen16(const uint8_t* p, __m256* h) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (kind == kInt8) {
    h[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    h[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
  } else {
    const __m256i w = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                       _mm256_set1_epi16(static_cast<short>(0xBF80)));
    h[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(w));
    h[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1));
  }
}

// Inputs k and k + 1 (k even for int4): w[0], w[1] input k's halves, w[2], w[3] input k + 1's.
template <int kind>
inline void widen_pair(const uint8_t* blk, int64_t k, __m256* w) {
  if constexpr (kind == kInt4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + k / 2 * CB));
    const __m256i lo = _mm256_cvtepu8_epi32(b), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    const __m256i mask = _mm256_set1_epi32(0xF);
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lo, mask));
    w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(hi, mask));
    w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4));
    w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4));
  } else {
    widen16<kind>(blk + k * CB, w);
    widen16<kind>(blk + (k + 1) * CB, w + 2);
  }
}

template <int kind, int mr>
void decode_block_simd(const Operands& o, int64_t nb, int64_t r0, float* out) {
  const uint8_t* blk = o.packed + nb * o.block_bytes(kind);
  const float* x = o.x + r0 * o.Kp;
  for (int r = 0; r < mr; ++r) std::memset(out + r * CB, 0, CB * sizeof(float));
  for (int64_t g = 0; g < o.G; ++g) {
    __m256 a[mr][4];  // [input parity * 2 + half]
    for (int r = 0; r < mr; ++r)
      for (int c = 0; c < 4; ++c) a[r][c] = _mm256_setzero_ps();
    const int64_t k1 = o.group_end(g);
    for (int64_t k = g * o.group; k < k1; k += 2) {
      __m256 w[4];
      const bool two = kind == kInt4 || k + 2 <= k1;
      if (two) {
        widen_pair<kind>(blk, k, w);
      } else {
        widen16<kind == kInt4 ? kInt8 : kind>(blk + k * CB, w);
        w[2] = w[3] = _mm256_setzero_ps();  // x[k + 1] may lie in the next group
      }
      for (int r = 0; r < mr; ++r) {
        const __m256 x0 = _mm256_set1_ps(x[r * o.Kp + k]);
        const __m256 x1 = _mm256_set1_ps(two ? x[r * o.Kp + k + 1] : 0.f);
        a[r][0] = _mm256_fmadd_ps(x0, w[0], a[r][0]);
        a[r][1] = _mm256_fmadd_ps(x0, w[1], a[r][1]);
        a[r][2] = _mm256_fmadd_ps(x1, w[2], a[r][2]);
        a[r][3] = _mm256_fmadd_ps(x1, w[3], a[r][3]);
      }
    }
    const float factor = kind == kFp8 ? kFp8Factor : 1.f;
    for (int h = 0; h < 2; ++h) {
      const int64_t at = (nb * o.G + g) * CB + h * 8;
      const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(o.scale + at), _mm256_set1_ps(factor));
      for (int r = 0; r < mr; ++r) {
        __m256 acc = _mm256_add_ps(a[r][h], a[r][2 + h]);
        if constexpr (kind != kFp8)
          acc = _mm256_fnmadd_ps(_mm256_loadu_ps(o.zero + at),
                                 _mm256_set1_ps(o.xsum[(r0 + r) * o.G + g]), acc);
        float* yr = out + r * CB + h * 8;
        _mm256_storeu_ps(yr, _mm256_fmadd_ps(s, acc, _mm256_loadu_ps(yr)));
      }
    }
  }
}

// 8 + 8 floats -> 16 bf16 bits (as the AVX-512 to_bf16x16).
inline __m256i to_bf16x16(__m256 lo, __m256 hi) {
  const auto round = [](__m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(
        _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  };
  // packus works within 128-bit lanes: lo 0-3, hi 0-3, lo 4-7, hi 4-7 -> reorder the quarters
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(round(lo), round(hi)), 0xD8);
}

template <typename T>
inline void store16(__m256 lo, __m256 hi, T* dst) {
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(dst, lo);
    _mm256_storeu_ps(dst + 8, hi);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), to_bf16x16(lo, hi));
  }
}

// As the AVX-512 dequant_rows_simd.
template <int kind, typename T>
void dequant_rows_simd(const uint8_t* blk, int64_t k0, int64_t k1, const float* s,
                       const float* z, T* dst, int64_t ld) {
  const __m256 f = _mm256_set1_ps(kind == kFp8 ? kFp8Factor : 1.f);
  const __m256 sv[2] = {_mm256_mul_ps(_mm256_loadu_ps(s), f),
                        _mm256_mul_ps(_mm256_loadu_ps(s + 8), f)};
  __m256 zv[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  if constexpr (kind != kFp8)
    for (int h = 0; h < 2; ++h) zv[h] = _mm256_loadu_ps(z + 8 * h);
  const auto value = [&](__m256 c, int h) { return _mm256_mul_ps(_mm256_sub_ps(c, zv[h]), sv[h]); };
  for (int64_t k = k0; k < k1; k += 2) {
    __m256 w[4];
    if (kind == kInt4 || k + 2 <= k1) widen_pair<kind>(blk, k, w);
    else widen16<kind == kInt4 ? kInt8 : kind>(blk + k * CB, w);
    store16(value(w[0], 0), value(w[1], 1), dst + (k - k0) * ld);
    if (k + 1 < k1) store16(value(w[2], 0), value(w[3], 1), dst + (k + 1 - k0) * ld);
  }
}
#endif  // RS_QUANT_AVX2

#if !RS_QUANT_AVX512 && !RS_QUANT_AVX2
constexpr int kDecodeRows = 4;
#endif

// Block nb's 16 outputs of rows [r0, r0 + mr): the tier's intrinsics where they apply (int4
// pairs must not straddle a group: an even group, or one group), else the plain loops.
template <int kind, int mr>
inline void decode_block(const Operands& o, int64_t nb, int64_t r0, float* out) {
#if RS_QUANT_AVX512 || RS_QUANT_AVX2
  if (kind != kInt4 || o.group % 2 == 0 || o.G == 1) {
    decode_block_simd<kind, mr>(o, nb, r0, out);
    return;
  }
#endif
  decode_block_portable<kind, mr>(o, nb, r0, out);
}

// Whether dequant_rows_simd applies to this weight (int4: pairs inside a group).
inline bool simd_rows(int kind, const Operands& o) {
  return (RS_QUANT_AVX512 || RS_QUANT_AVX2) && (kind != kInt4 || o.group % 2 == 0 || o.G == 1);
}

}  // namespace radixserve_quant
