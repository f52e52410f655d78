// Vector math the attention kernels share (prefill_common.h, decode_common.h, the fp8 decode
// kernels): an inline AVX-512 exp for softmax arguments, 16 horizontal sums at once, a 16 x 16
// transpose; from the avx2 tier (x86-64-v3: AVX2, FMA) up, an 8-lane exp and 8 horizontal sums.
// A build's name carries a digest of this header (platform/native_build.py): no version to bump.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace radixserve_vec {

// e^x for 16 lanes of x in [-87, 88] (the softmax's arguments, clamped to [-80, 0]; the panel
// GEMM's silu, model/csrc/panel_gemm.h, uses the rest), inline: n = round(x /
// ln 2), r = x - n ln 2 in two steps (ln 2's high part exact in 11 bits, so n * hi is exact),
// e^r by a degree-7 polynomial on |r| <= ln 2 / 2 (Cephes' expf coefficients; ~1 ulp),
// times 2^n by vscalefps. libmvec's vector expf is as accurate but a call per vector, with
// range checks this kernel never needs.
inline __m512 exp_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// r[j] = the sum of v[j]'s 16 lanes, for 16 vectors: pairwise unpack/shuffle-and-add, about 3
// instructions per sum where _mm512_reduce_add_ps takes 8.
inline __m512 sum16(const __m512* v) {
  __m512 w[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: partial sums of v[4i .. 4i+3]
    const __m512d c = _mm512_castps_pd(w[2 * i]), d = _mm512_castps_pd(w[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Folding 16-lane dot products of consecutive keys into one vector of scores, a few keys at a
// time (a kernel keeps the partial folds in registers instead of 16 whole vectors):
// fold2: keys a, b -> per 128-bit lane, [a0 + a2, b0 + b2, a1 + a3, b1 + b3];
// fold4: fold2 of keys (0, 1) and (2, 3) -> per 128-bit lane L, L's partial sums of keys 0..3;
// reduce16: fold4 of keys 0-3, 4-7, 8-11, 12-15 -> the 16 keys' sums in order.
inline __m512 fold2(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
inline __m512 fold4(__m512 ab, __m512 cd) {
  const __m512d x = _mm512_castps_pd(ab), y = _mm512_castps_pd(cd);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
inline __m512 reduce4(const __m512* x) { return fold4(fold2(x[0], x[1]), fold2(x[2], x[3])); }
// Two vectors of 128-bit lanes (x: lanes x0..x3) -> (x0 + x1, x2 + x3, y0 + y1, y2 + y3).
inline __m512 pair_lanes(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline __m512 reduce16(const __m512* r) {
  return pair_lanes(pair_lanes(r[0], r[1]), pair_lanes(r[2], r[3]));
}

// r[i] := column i of the 16 x 16 matrix whose rows are r[0..15] (rows become lanes).
inline void transpose16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane k: rows 2i, 2i+1 of columns 4k .. 4k+3
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + j], lane k: rows 4i .. 4i+3 of column 4k + j
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int j = 0; j < 4; ++j) {  // column 4k + j: lane k of u[j], u[4 + j], u[8 + j], u[12 + j]
    const __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88);
    const __m512 v1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
    const __m512 w0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xDD);
    const __m512 w1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_shuffle_f32x4(v0, v1, 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(v0, v1, 0xDD);
    r[4 + j] = _mm512_shuffle_f32x4(w0, w1, 0x88);
    r[12 + j] = _mm512_shuffle_f32x4(w0, w1, 0xDD);
  }
}

}  // namespace radixserve_vec
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace radixserve_vec {

// exp_ps's 8-lane form for the avx2 tier (the 8-lane helpers are also built at the AVX-512
// tiers, for kernels that sum 8-lane partial dot products with sum8): the same reduction and
// polynomial; 2^n built in the exponent field (n in [-126, 127] for x in [-87, 88]: always a
// normal float), as AVX2 has no vscalefps.
inline __m256 exp256(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// r[j] = the sum of v[j]'s 8 lanes, for 8 vectors: two rounds of pairwise adds within the
// 128-bit halves, then the halves added across.
inline __m256 sum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per half: v0..3
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The sum and the max of a vector's 8 lanes.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

}  // namespace radixserve_vec
#define RS_VEC_AVX2 1
#endif
