// Reading an 8-bit KV pool (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) in fp32, a row at a time:
// the kernels convert the rows they read into a small L1 buffer, never the pool. The stored
// value times its (layer, KV head) scale is the K or V value (attention/kv_quant.py).
//
// Through fp16 bits: e5m2 is fp16's upper byte; e4m3's exponent and mantissa shifted into
// fp16's fields give 2^-8 of its value for normals and subnormals alike (fp16's exponent bias
// is 8 larger), so a few integer instructions and vcvtph2ps per 16 values, times 256.
// torch's extension loader hashes the sources, not this header: bump EXT_BASE in
// attention/cpu_kernels.py when it changes.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixserve_fp8 {

enum class Format { E4M3, E5M2 };

// One byte -> its value (exact; NaN codes are never stored: the store saturates).
template <Format F>
inline float to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  constexpr int man_bits = F == Format::E4M3 ? 3 : 2;
  constexpr int bias_shift = F == Format::E4M3 ? 127 - 7 : 127 - 15;
  const uint32_t exp = (b & 0x7Fu) >> man_bits, man = b & ((1u << man_bits) - 1);
  float mag;
  if (exp == 0) {  // subnormal: man * 2^(1 - bias - man_bits)
    mag = static_cast<float>(man) * (F == Format::E4M3 ? 0x1p-9f : 0x1p-16f);
  } else {
    const uint32_t bits = (exp + bias_shift) << 23 | man << (23 - man_bits);
    std::memcpy(&mag, &bits, sizeof mag);
  }
  return sign ? -mag : mag;
}

#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define RS_FP8_AVX512 1
// 32 bytes -> 32 fp32 values, e4m3 as 2^-8 of its value (load32_factor: the caller folds the
// 256 into its scales; e4m3: b << 8 puts the sign at bit 15 and the other 7 bits at 8..14, an
// arithmetic shift right by one moves those to fp16's 7..13 and copies the sign into bit 14,
// which the mask clears), with few instructions per value:
// unpacking the bytes against zeros puts each into the high half of a 16-bit lane (e5m2's
// fp16 bits) in one instruction per 16, but in the order of vpunpck's 128-bit lanes, so
// dst holds bytes 0-7, 16-23, 8-15, 24-31: dst[f] = value of p[permuted32(f)]. Callers
// permute q the same way (a dot product does not change) and the output back.
template <Format F>
inline void load32_permuted(const uint8_t* p, float* dst) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m256i lo = _mm256_unpacklo_epi8(_mm256_setzero_si256(), x);
  __m256i hi = _mm256_unpackhi_epi8(_mm256_setzero_si256(), x);
  if constexpr (F == Format::E4M3) {
    const __m256i mask = _mm256_set1_epi16(static_cast<short>(0xBF80));
    lo = _mm256_and_si256(_mm256_srai_epi16(lo, 1), mask);
    hi = _mm256_and_si256(_mm256_srai_epi16(hi, 1), mask);
  }
  _mm512_storeu_ps(dst, _mm512_cvtph_ps(lo));
  _mm512_storeu_ps(dst + 16, _mm512_cvtph_ps(hi));
}
// The byte (within a 32-byte block) that load32_permuted puts at float f (an involution).
inline int64_t permuted32(int64_t f) {
  const int64_t group = (f >> 3) & 3;
  return f + (group == 1 ? 8 : group == 2 ? -8 : 0);
}
// What load32_permuted's values must be multiplied by.
template <Format F>
constexpr float load32_factor() { return F == Format::E4M3 ? 256.f : 1.f; }
#else
#define RS_FP8_AVX512 0
#endif

// dst[i] = value of src[i] for i < n.
template <Format F>
inline void row_to_float(const uint8_t* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 e4m3_factor = _mm512_set1_ps(256.f);
  for (; i + 16 <= n; i += 16) {
    __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    if constexpr (F == Format::E4M3) {
      w = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7),
                          _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
      _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtph_ps(w), e4m3_factor));
    } else {
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_slli_epi16(w, 8)));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = to_float<F>(src[i]);
}

}  // namespace radixserve_fp8
