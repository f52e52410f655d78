// Reading an 8-bit KV pool (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) a row at a time: the kernels
// convert the rows they read into a small L1 buffer (or registers), never the pool. The stored
// value times its (layer, KV head) scale is the K or V value (attention/kv_quant.py).
//
// To fp32 through fp16 bits: e5m2 is fp16's upper byte; e4m3's exponent and mantissa shifted
// into fp16's fields give 2^-8 of its value for normals and subnormals alike (fp16's exponent
// bias is 8 larger), so a few integer instructions and vcvtph2ps per 16 values, times 256.
// To bf16 exactly (Bf16Lut, AVX512-VBMI): two 128-entry byte tables looked up by vpermi2b.
// On the avx2 tier (AVX2, F16C, FMA; no AVX-512) the same fp16 route 8 values per vcvtph2ps
// (load16). A build's name carries a digest of this header (platform/native_build.py).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace radixserve_fp8 {

enum class Format { E4M3, E5M2 };

// What one block's pass over one KV head's rows reads (the AVX-512 kernels'): rows `base +
// slots[t0 + j] * stride` (base: the pool plus the KV head's offset), j < n; query heads h0 ..
// h0 + ng - 1.
struct Slice {
  const uint8_t* base;
  int64_t stride;
  const int32_t* slots;
  int64_t t0, n, h0, ng;
  // keys past n (a short last block): a repeat of the last one, masked off at the store
  const uint8_t* row(int64_t j) const { return base + slots[t0 + std::min(j, n - 1)] * stride; }
};

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
// 32 bytes -> 32 fp32 values in two registers, e4m3 as 2^-8 of its value (load_factor: the
// caller folds the 256 into its scales; e4m3: b << 8 puts the sign at bit 15 and the other 7
// bits at 8..14, an arithmetic shift right by one moves those to fp16's 7..13 and copies the
// sign into bit 14, which the mask clears), with few instructions per value and no table:
// unpacking the bytes against zeros puts each into the high half of a 16-bit lane (e5m2's
// fp16 bits) in one instruction per 16, but in the order of vpunpck's 128-bit lanes, so
// (a, b) hold bytes 0-7, 16-23, 8-15, 24-31: value f of a|b is that of p[permuted32(f)].
// Callers permute q the same way (a dot product does not change) and the output back.
template <Format F>
inline void widen32(const uint8_t* p, __m512& a, __m512& b) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m256i lo = _mm256_unpacklo_epi8(_mm256_setzero_si256(), x);
  __m256i hi = _mm256_unpackhi_epi8(_mm256_setzero_si256(), x);
  if constexpr (F == Format::E4M3) {
    const __m256i mask = _mm256_set1_epi16(static_cast<short>(0xBF80));
    lo = _mm256_and_si256(_mm256_srai_epi16(lo, 1), mask);
    hi = _mm256_and_si256(_mm256_srai_epi16(hi, 1), mask);
  }
  a = _mm512_cvtph_ps(lo);
  b = _mm512_cvtph_ps(hi);
}
// The byte (within a 32-byte block) that widen32 puts at float f (an involution).
inline int64_t permuted32(int64_t f) {
  const int64_t group = (f >> 3) & 3;
  return f + (group == 1 ? 8 : group == 2 ? -8 : 0);
}
#else
#define RS_FP8_AVX512 0
#endif

#if !RS_FP8_AVX512 && defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define RS_FP8_AVX2 1
// 16 bytes -> 16 fp32 values in order in two registers, e4m3 as 2^-8 of its value (times
// load_factor, as widen32): each byte unpacked against zero into the high half of a 16-bit
// lane (e5m2: fp16's bits; e4m3 shifted into fp16's fields alike), then vcvtph2ps per 8. At
// 128 bits the unpacks keep the bytes' order: nothing to permute.
template <Format F>
inline void widen16(const uint8_t* p, __m256& a, __m256& b) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i lo = _mm_unpacklo_epi8(_mm_setzero_si128(), x);
  __m128i hi = _mm_unpackhi_epi8(_mm_setzero_si128(), x);
  if constexpr (F == Format::E4M3) {
    const __m128i mask = _mm_set1_epi16(static_cast<short>(0xBF80));
    lo = _mm_and_si128(_mm_srai_epi16(lo, 1), mask);
    hi = _mm_and_si128(_mm_srai_epi16(hi, 1), mask);
  }
  a = _mm256_cvtph_ps(lo);
  b = _mm256_cvtph_ps(hi);
}
// widen16 into dst[0..15].
template <Format F>
inline void load16(const uint8_t* p, float* dst) {
  __m256 a, b;
  widen16<F>(p, a, b);
  _mm256_storeu_ps(dst, a);
  _mm256_storeu_ps(dst + 8, b);
}
#else
#define RS_FP8_AVX2 0
#endif
#if RS_FP8_AVX512 || RS_FP8_AVX2
// What widen32's and load16's values must be multiplied by.
template <Format F>
constexpr float load_factor() { return F == Format::E4M3 ? 256.f : 1.f; }
#endif

// The bf16 bits of a code's magnitude (its low 7 bits): every e4m3 and e5m2 value, subnormals
// included, is a normal bf16 value, so the conversion is exact. Split into the low and the
// high byte, one 128-entry table each, for vpermi2b lookups (Bf16Lut).
template <Format F>
constexpr uint16_t bf16_bits(uint32_t mag) {
  constexpr int man_bits = F == Format::E4M3 ? 3 : 2, bias = F == Format::E4M3 ? 7 : 15;
  const uint32_t exp = mag >> man_bits, man = mag & ((1u << man_bits) - 1);
  if (exp != 0) return static_cast<uint16_t>((exp - bias + 127) << 7 | man << (7 - man_bits));
  if (man == 0) return 0;
  int top = 0;  // subnormal: man * 2^(1 - bias - man_bits), normalized at man's top bit
  while ((man >> (top + 1)) != 0) ++top;
  return static_cast<uint16_t>(static_cast<uint32_t>(top + 1 - bias - man_bits + 127) << 7 |
                               (man - (1u << top)) << (7 - top));
}

template <Format F>
struct Bf16Bytes {
  uint8_t lo[128], hi[128];
};

template <Format F>
constexpr Bf16Bytes<F> bf16_bytes() {
  Bf16Bytes<F> t{};
  for (uint32_t c = 0; c < 128; ++c) {
    t.lo[c] = static_cast<uint8_t>(bf16_bits<F>(c) & 0xFF);
    t.hi[c] = static_cast<uint8_t>(bf16_bits<F>(c) >> 8);
  }
  return t;
}

#if RS_FP8_AVX512 && defined(__AVX512VBMI__) && defined(__AVX512BF16__)
#define RS_FP8_BF16_LUT 1
// 8-bit codes -> bf16 by table lookups in registers: 64 codes per vpermi2b pair (the low
// bytes, the high bytes; bit 7 is the sign, which the table ignores and one vpternlog puts
// back), then byte unpacks. Built once per kernel call (four zmm of tables).
template <Format F>
struct Bf16Lut {
  __m512i lo0, lo1, hi0, hi1, sign;

  Bf16Lut() {
    static constexpr Bf16Bytes<F> t = bf16_bytes<F>();
    lo0 = _mm512_loadu_si512(t.lo);
    lo1 = _mm512_loadu_si512(t.lo + 64);
    hi0 = _mm512_loadu_si512(t.hi);
    hi1 = _mm512_loadu_si512(t.hi + 64);
    sign = _mm512_set1_epi8(static_cast<char>(0x80));
  }
  // Low and high bf16 bytes of each of the 64 codes in x, in x's byte order.
  void bytes(__m512i x, __m512i& lo, __m512i& hi) const {
    lo = _mm512_permutex2var_epi8(lo0, x, lo1);
    hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, x, hi1), x, sign, 0xF8);
  }
  // 64 codes -> 64 bf16: w0 holds the codes at bytes 16L + j, w1 those at 16L + 8 + j (L: the
  // 128-bit lane, j < 8), in that order (vpunpck works within lanes): perm64.
  void words(__m512i x, __m512i& w0, __m512i& w1) const {
    __m512i lo, hi;
    bytes(x, lo, hi);
    w0 = _mm512_unpacklo_epi8(lo, hi);
    w1 = _mm512_unpackhi_epi8(lo, hi);
  }
  // Codes of two tokens (64 each, a and b) -> their bf16 values as (a, b) pairs, one 32-bit
  // word per element: p[c] holds the elements 16L + 4c + j (L: the lane, j < 4), pair64.
  void pairs(__m512i a, __m512i b, __m512i* p) const {
    const __m512i x[2] = {_mm512_unpacklo_epi8(a, b), _mm512_unpackhi_epi8(a, b)};
    for (int i = 0; i < 2; ++i) {
      __m512i lo, hi;  // x's bytes alternate a, b: lo/hi alike; unpacking them gives the words
      bytes(x[i], lo, hi);
      p[2 * i] = _mm512_unpacklo_epi8(lo, hi);
      p[2 * i + 1] = _mm512_unpackhi_epi8(lo, hi);
    }
  }
};
#else
#define RS_FP8_BF16_LUT 0
#endif
#if RS_FP8_AVX512 || RS_FP8_AVX2
// Rows `from` .. `to` of a slot list requested ahead of their conversion (`width` bytes from
// `base + slot * stride`): slots are scattered (pages), so the hardware prefetcher cannot guess
// them. Hint: _MM_HINT_T0 (into L1) or _MM_HINT_T1 (into L2). On Zen 4 a block's burst of
// prefetcht0 filled the L1's miss buffers and stalled the kernel at the prefetches; prefetcht1
// of the same lines took the fp32-FMA kernel from ~70 to ~55 ns a key with the rows in order
// and from ~125-165 to ~60-75 with them shuffled (bench/README.md, issue 38).
template <int Hint = _MM_HINT_T0>
inline void prefetch_rows(const uint8_t* base, int64_t stride, const int32_t* slots,
                          int64_t from, int64_t to, int64_t width) {
  for (int64_t j = from; j < to; ++j)
    for (int64_t c = 0; c < width; c += 64)
      _mm_prefetch(reinterpret_cast<const char*>(base + slots[j] * stride + c),
                   static_cast<_mm_hint>(Hint));
}
#endif
// The element (within a block of 64) that Bf16Lut::words puts at word f of w0 | w1.
inline int64_t perm64(int64_t f) { return 16 * ((f & 31) >> 3) + 8 * (f >> 5) + (f & 7); }
// The element (within a block of 64) that Bf16Lut::pairs puts at lane f of p[0..3].
inline int64_t pair64(int64_t f) { return 16 * ((f & 15) >> 2) + 4 * (f >> 4) + (f & 3); }

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
#elif RS_FP8_AVX2
  const __m256 factor = _mm256_set1_ps(load_factor<F>());
  for (; i + 16 <= n; i += 16) {
    load16<F>(src + i, dst + i);
    if constexpr (F == Format::E4M3) {
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_loadu_ps(dst + i), factor));
      _mm256_storeu_ps(dst + i + 8, _mm256_mul_ps(_mm256_loadu_ps(dst + i + 8), factor));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = to_float<F>(src[i]);
}

}  // namespace radixserve_fp8
