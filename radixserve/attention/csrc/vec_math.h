// Vector math the attention kernels share (prefill_common.h, decode_common.h, the fp8 decode
// kernels): an inline AVX-512 exp for softmax arguments, 16 horizontal sums at once, a 16 x 16
// transpose. torch's
// extension loader hashes the sources, not this header: bump EXT_BASE in
// attention/cpu_kernels.py when it changes.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace radixserve_vec {

// e^x for 16 lanes of x in [-80, 0] (the softmax's clamped arguments), inline: n = round(x /
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
