// Vector math the attention kernels share (prefill_common.h, paged_decode.cpp): an inline
// AVX-512 exp for softmax arguments. torch's extension loader hashes the sources, not this
// header: bump EXT_BASE in attention/cpu_kernels.py when it changes.
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

}  // namespace radixserve_vec
#endif
