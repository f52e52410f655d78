// Paged decode attention over an 8-bit KV pool for bf16 queries on CPUs with AVX512-BF16 and
// AVX512-VBMI (head dims multiple of 64): decode_fp8_bf16, which paged_decode_fp8.cpp tries
// first. Without those extensions this file compiles to a function that declines.
//
// Per request, in blocks of 16 keys: the block's rows (all KV heads) are converted to bf16 in
// L1 by table lookups (exact: every 8-bit value is a bf16 value); Q.K^T is vdpbf16ps (32
// products per instruction, q as stored) with 16 scores summed at once (sum16) and the scale
// times k_scale applied to them; P.V is vdpbf16ps over pairs of keys, the block's V rows
// converted as (key, next key) pairs, P rounded to bf16 after the fp32 softmax (as the bf16
// prefill kernel and flash attention on GPUs do), v_scale applied to the output. Half the
// instructions of converting to fp32 and FMAs (paged_decode_fp8.cpp's blocked path).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_access.h"
#include "decode_common.h"
#include "fp8_access.h"

namespace radixserve_decode {

#if RS_FP8_BF16_LUT
namespace {

using radixserve_bf16::bf16_t;
using radixserve_fp8::Bf16Lut;
using radixserve_fp8::Format;
using radixserve_fp8::pair64;
using radixserve_fp8::perm64;
using radixserve_fp8::prefetch_rows;
using radixserve_vec::sum16;

constexpr int64_t BLK = 16;  // keys per block

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// One request's work areas, carved from the thread's scratch (sizes in floats).
template <int64_t D>
struct Areas {
  float* sc;      // (hq, len) scores, then probabilities
  uint16_t* pb;   // (hq, lenp) probabilities in bf16, zero past len
  uint16_t* qb;   // (hq, D) q in Bf16Lut::words' order
  float* acc;     // (hq, D) P.V accumulators in Bf16Lut::pairs' order
  __m512i* blk;   // BLK rows of K (row / 32 zmm each) or BLK / 2 pairs of V rows (row / 16)

  Areas(std::vector<float>& work, int64_t hq, int64_t len, int64_t lenp, int64_t row) {
    work.resize(hq * len + hq * lenp / 2 + hq * D / 2 + hq * D + BLK * row / 2 + 16);
    sc = work.data();
    pb = reinterpret_cast<uint16_t*>(sc + hq * len);
    qb = pb + hq * lenp;
    acc = reinterpret_cast<float*>(qb + hq * D);
    blk = reinterpret_cast<__m512i*>(acc + hq * D);
  }
};

template <int64_t D, Format F>
void scores_block(const Bf16Lut<F>& lut, const uint8_t* k, const Geometry& g,
                  const float* k_scale, const int32_t* slots, int64_t len, int64_t t0,
                  const Areas<D>& a) {
  constexpr int64_t NW = D / 32;  // zmm of bf16 per head
  const int64_t row = g.hkv * D, rz = row / 32, n = std::min(BLK, len - t0);
  prefetch_rows(k, g.sk, slots, t0 + BLK, std::min(t0 + 2 * BLK, len), row);
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* src = k + slots[t0 + j] * g.sk;
    for (int64_t c = 0; c < row / 64; ++c) {
      __m512i w0, w1;
      lut.words(_mm512_loadu_si512(src + 64 * c), w0, w1);
      _mm512_storeu_si512(a.blk + j * rz + 2 * c, w0);
      _mm512_storeu_si512(a.blk + j * rz + 2 * c + 1, w1);
    }
  }
  for (int64_t j = n; j < BLK; ++j)  // a short last block: zero rows, whole-block loops below
    for (int64_t c = 0; c < rz; ++c)
      _mm512_storeu_si512(a.blk + j * rz + c, _mm512_setzero_si512());
  const int64_t group = g.hq / g.hkv;
  for (int64_t h = 0; h < g.hq; ++h) {
    __m512i qv[NW];
    for (int64_t c = 0; c < NW; ++c) qv[c] = _mm512_loadu_si512(a.qb + h * D + 32 * c);
    const __m512i* kh = a.blk + (h / group) * NW;
    __m512 dots[BLK];
#pragma GCC unroll 16
    for (int64_t j = 0; j < BLK; ++j) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t c = 0; c < NW; ++c)
        s = _mm512_dpbf16_ps(s, as_bh(qv[c]), as_bh(_mm512_loadu_si512(kh + j * rz + c)));
      dots[j] = s;
    }
    const __m512 scaled = _mm512_mul_ps(sum16(dots), _mm512_set1_ps(g.scale * k_scale[h / group]));
    _mm512_mask_storeu_ps(a.sc + h * len + t0, static_cast<__mmask16>((1u << n) - 1), scaled);
  }
}

template <int64_t D, Format F>
void values_block(const Bf16Lut<F>& lut, const uint8_t* v, const Geometry& g,
                  const int32_t* slots, int64_t len, int64_t lenp, int64_t t0,
                  const Areas<D>& a) {
  constexpr int64_t NP = D / 16;  // zmm of (key, next key) pairs per head
  const int64_t row = g.hkv * D, rz = row / 16, n = std::min(BLK, len - t0), np = (n + 1) / 2;
  prefetch_rows(v, g.sv, slots, t0 + BLK, std::min(t0 + 2 * BLK, len), row);
  for (int64_t jp = 0; jp < np; ++jp) {
    const int64_t t = t0 + 2 * jp;
    const uint8_t* ra = v + slots[t] * g.sv;
    const uint8_t* rb = t + 1 < len ? v + slots[t + 1] * g.sv : nullptr;  // odd end: p is 0
    for (int64_t c = 0; c < row / 64; ++c) {
      __m512i p[4];
      lut.pairs(_mm512_loadu_si512(ra + 64 * c),
                rb ? _mm512_loadu_si512(rb + 64 * c) : _mm512_setzero_si512(), p);
      for (int i = 0; i < 4; ++i) _mm512_storeu_si512(a.blk + jp * rz + 4 * c + i, p[i]);
    }
  }
  const int64_t group = g.hq / g.hkv;
  for (int64_t h = 0; h < g.hq; ++h) {
    __m512 acc[NP];
    for (int64_t c = 0; c < NP; ++c) acc[c] = _mm512_loadu_ps(a.acc + h * D + 16 * c);
    const __m512i* vh = a.blk + (h / group) * NP;
    const uint16_t* p = a.pb + h * lenp + t0;
    for (int64_t jp = 0; jp < np; ++jp) {
      uint32_t pair;  // (p[t], p[t + 1]) in bf16
      std::memcpy(&pair, p + 2 * jp, sizeof pair);
      const __m512bh pp = as_bh(_mm512_set1_epi32(static_cast<int>(pair)));
      for (int64_t c = 0; c < NP; ++c)
        acc[c] = _mm512_dpbf16_ps(acc[c], pp, as_bh(_mm512_loadu_si512(vh + jp * rz + c)));
    }
    for (int64_t c = 0; c < NP; ++c) _mm512_storeu_ps(a.acc + h * D + 16 * c, acc[c]);
  }
}

// One head's probabilities (len floats) -> bf16 (lenp, zeros past len), rounded to nearest.
inline void probs_to_bf16(const float* s, int64_t len, int64_t lenp, uint16_t* dst) {
  auto mask = [len](int64_t t) -> __mmask16 {
    return len - t >= 16 ? 0xFFFF : len > t ? static_cast<__mmask16>((1u << (len - t)) - 1) : 0;
  };
  for (int64_t t = 0; t < lenp; t += 32)
    _mm512_storeu_si512(dst + t, (__m512i)_mm512_cvtne2ps_pbh(
                                     _mm512_maskz_loadu_ps(mask(t + 16), s + t + 16),
                                     _mm512_maskz_loadu_ps(mask(t), s + t)));
}

template <int64_t D, Format F>
void decode_one(const Fp8Call<bf16_t>& c, const Geometry& g, const Batch& batch, int64_t b,
                std::vector<float>& work) {
  const Bf16Lut<F> lut;
  const int64_t len = batch.len_of(b), lenp = (len + 31) / 32 * 32;
  const int32_t* slots = batch.slots_of(b);
  const Areas<D> a(work, g.hq, len, lenp, g.hkv * D);
  const bf16_t* q = c.q_of(b);
  for (int64_t i = 0; i < g.hq * D; ++i) a.qb[i] = q[(i & ~63) + perm64(i & 63)];
  for (int64_t t0 = 0; t0 < len; t0 += BLK)
    scores_block<D, F>(lut, c.k, g, c.k_scale, slots, len, t0, a);
  float* lse = c.lse_of(b);
  for (int64_t h = 0; h < g.hq; ++h) {
    lse[h] = softmax(a.sc + h * len, len, g.softcap);
    probs_to_bf16(a.sc + h * len, len, lenp, a.pb + h * lenp);
  }
  std::fill(a.acc, a.acc + g.hq * D, 0.f);
  for (int64_t t0 = 0; t0 < len; t0 += BLK)
    values_block<D, F>(lut, c.v, g, slots, len, lenp, t0, a);
  store_from_pairs(a.acc, c.v_scale, g, c.out_of(b));
}

}  // namespace
#endif

bool decode_fp8_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& k_scale, const at::Tensor& v_scale, const Geometry& g,
                     const Batch& batch, at::Tensor& out, at::Tensor& lse) {
#if RS_FP8_BF16_LUT
  if (q.scalar_type() != at::kBFloat16 || (g.d != 64 && g.d != 128)) return false;
  const Fp8Call<bf16_t> c(q, k_cache, v_cache, k_scale, v_scale, out, lse);
  with_format(k_cache.scalar_type(), [&](auto ftag) {
    constexpr Format F = decltype(ftag)::value;
    each_request(batch, [&](int64_t b, std::vector<float>& work) {
      if (g.d == 64) {
        decode_one<64, F>(c, g, batch, b, work);
      } else {
        decode_one<128, F>(c, g, batch, b, work);
      }
    });
  });
  return true;
#else
  return false;  // no AVX512-BF16 + VBMI at build time
#endif
}

}  // namespace radixserve_decode
