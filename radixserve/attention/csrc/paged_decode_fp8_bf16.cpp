// Paged decode attention over an 8-bit KV pool for bf16 queries on AVX512-BF16 CPUs without
// AMX (the avx512_bf16 tier), head dims 64, 128 and 256: decode_fp8_bf16, which
// paged_decode_fp8.cpp tries after the AMX path and before paged_decode_fp8_avx512.cpp (fp32
// queries, head dim 32, and CPUs without AVX512-BF16 / VBMI go there). Elsewhere this file
// compiles to a function that declines.
//
// Why this shape: the fp32 path (widen each row to fp32, 64-lane FMAs, each (head, key) dot
// folded to 8 lanes and summed 8 keys at a time) spent as much on the conversions and the
// horizontal sums as on the FMAs, and bf16 queries gained nothing from their half-size q.
// Here each row becomes bf16 exactly by two vpermi2b lookups (Bf16Lut::words: no shifts, no
// vcvtph2ps), and a score is D / 32 vdpbf16ps on q and the row as they are (products exact in
// fp32, the scale applied to the fp32 score, as the bf16 pool's own kernel does). The 16-lane
// dot products of 4 keys fold into one vector by unpacks (reduce4), 4 of those into the
// block's 16 scores by 128-bit shuffles (reduce16): 45 instructions per head and 16 keys.
// P.V two keys at a time: their rows as (key, next key) bf16 pairs (Bf16Lut::pairs), each
// head's two probabilities broadcast as bf16 hi and lo parts (P keeps 16 of fp32's 24 bits;
// hi alone, as the AMX path rounds P, was ~7% faster in cache, not measurably from memory),
// the heads' fp32 accumulators in registers, in pair64's order (the output permuted back).
// Of the prefetch schedules tried (the next block's rows at once, as here; spread key by key
// or per KV head; two blocks ahead; into L2), none was measurably better on the loaded box.
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
using radixserve_fp8::Slice;
using radixserve_vec::reduce16;
using radixserve_vec::reduce4;

constexpr int64_t BLK = 16;  // keys per block

// Query heads at once per KV head: q (D / 32 zmm each) and 4 keys' dot products per head
// (4 zmm) must stay in registers beside the 5 of the tables.
template <int64_t D>
constexpr int64_t heads_at_once() { return D == 64 ? 3 : D == 128 ? 2 : 1; }

// Scaled scores of the slice's heads for its keys, into sc (hq, len). qb: (hq, D) bf16 in
// perm64's order per 64 dims; hscale: the scale times k_scale of the slice's KV head.
template <int64_t D, Format F>
void scores_block(const Slice& s, const Bf16Lut<F>& lut, const bf16_t* qb, float hscale,
                  float* sc, int64_t len) {
  constexpr int64_t NW = D / 32, G = heads_at_once<D>();
  __m512bh q[G][NW];
#pragma GCC unroll 8
  for (int64_t g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int64_t c = 0; c < NW; ++c)
      q[g][c] = (__m512bh)(g < s.ng ? _mm512_loadu_si512(qb + (s.h0 + g) * D + 32 * c)
                                    : _mm512_setzero_si512());
  __m512 quad[G][BLK / 4];
  for (int64_t j0 = 0; j0 < BLK; j0 += 4) {
    __m512 acc[G][4];
#pragma GCC unroll 16
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
    if (j0 < s.n) {  // keys past n: a repeat of the last one, masked off at the store
#pragma GCC unroll 4
      for (int64_t j = 0; j < 4; ++j) {
        const uint8_t* r = s.row(j0 + j);
#pragma GCC unroll 4
        for (int64_t c = 0; c < D / 64; ++c) {
          __m512i w0, w1;
          lut.words(_mm512_loadu_si512(r + 64 * c), w0, w1);
#pragma GCC unroll 8
          for (int64_t g = 0; g < G; ++g)
            acc[g][j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[g][j], q[g][2 * c], (__m512bh)w0),
                                         q[g][2 * c + 1], (__m512bh)w1);
        }
      }
    }
#pragma GCC unroll 8
    for (int64_t g = 0; g < G; ++g) quad[g][j0 / 4] = reduce4(acc[g]);
  }
  const auto mask = static_cast<__mmask16>((1u << s.n) - 1);
  const __m512 vs = _mm512_set1_ps(hscale);
  for (int64_t g = 0; g < s.ng; ++g)
    _mm512_mask_storeu_ps(sc + (s.h0 + g) * len + s.t0, mask,
                          _mm512_mul_ps(reduce16(quad[g]), vs));
}

// acc (hq, D) of the slice's heads += their probabilities times the values, in pair64's order
// per 64 dims: two keys at a time as (key, next key) bf16 pairs (Bf16Lut::pairs), each head's
// pair of probabilities broadcast; P as hi + lo, two bf16 each (ph, pl: (hq, lenp) in key
// order, zero past len), so P keeps 16 of fp32's 24 bits.
template <int64_t D, Format F>
void values_block(const Slice& s, const Bf16Lut<F>& lut, const bf16_t* ph, const bf16_t* pl,
                  int64_t lenp, float* acc) {
  constexpr int64_t NV = D / 16, G = heads_at_once<D>();
  __m512 a[G][NV];
#pragma GCC unroll 8
  for (int64_t g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int64_t c = 0; c < NV; ++c)
      a[g][c] = g < s.ng ? _mm512_loadu_ps(acc + (s.h0 + g) * D + 16 * c) : _mm512_setzero_ps();
  for (int64_t j = 0; j < s.n; j += 2) {  // key n of an odd n: its p is zero
    const uint8_t *ra = s.row(j), *rb = s.row(j + 1);
    __m512bh v[NV];
#pragma GCC unroll 4
    for (int64_t c = 0; c < D / 64; ++c) {
      __m512i w[4];
      lut.pairs(_mm512_loadu_si512(ra + 64 * c), _mm512_loadu_si512(rb + 64 * c), w);
#pragma GCC unroll 4
      for (int64_t i = 0; i < 4; ++i) v[4 * c + i] = (__m512bh)w[i];
    }
#pragma GCC unroll 8
    for (int64_t g = 0; g < G; ++g) {
      if (g >= s.ng) break;
      const int64_t at = (s.h0 + g) * lenp + s.t0 + j;
      uint32_t hi, lo;
      std::memcpy(&hi, ph + at, 4);
      std::memcpy(&lo, pl + at, 4);
      const auto phv = (__m512bh)_mm512_set1_epi32(static_cast<int>(hi));
      const auto plv = (__m512bh)_mm512_set1_epi32(static_cast<int>(lo));
#pragma GCC unroll 16
      for (int64_t c = 0; c < NV; ++c)
        a[g][c] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[g][c], phv, v[c]), plv, v[c]);
    }
  }
#pragma GCC unroll 8
  for (int64_t g = 0; g < G; ++g)
    if (g < s.ng)
#pragma GCC unroll 16
      for (int64_t c = 0; c < NV; ++c) _mm512_storeu_ps(acc + (s.h0 + g) * D + 16 * c, a[g][c]);
}

// One head's probabilities (len) -> hi, lo bf16 (lenp: len rounded up to 16, zeros past len).
inline void split_p(const float* p, int64_t len, int64_t lenp, bf16_t* hi, bf16_t* lo) {
  for (int64_t t = 0; t < lenp; t += 16) {
    const __mmask16 k = len - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - t)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(k, p + t);
    const __m256bh h = _mm512_cvtneps_pbh(x);
    const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + t), (__m256i)h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + t),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, hf)));
  }
}

// fn(slice) for every block of 16 keys and, within it, every KV head and group of heads; the
// next block's rows (all KV heads) requested first.
template <int64_t D, typename Fn>
void over_slices(const uint8_t* pool, int64_t stride, const Geometry& g, const int32_t* slots,
                 int64_t len, const Fn& fn) {
  constexpr int64_t G = heads_at_once<D>();
  const int64_t group = g.hq / g.hkv;
  for (int64_t t0 = 0; t0 < len; t0 += BLK) {
    radixserve_fp8::prefetch_rows<_MM_HINT_T1>(pool, stride, slots, t0 + BLK,
                                               std::min(t0 + 2 * BLK, len), g.hkv * D);
    const int64_t n = std::min(BLK, len - t0);
    for (int64_t kh = 0; kh < g.hkv; ++kh)
      for (int64_t h0 = kh * group; h0 < (kh + 1) * group; h0 += G)
        fn(kh, Slice{pool + kh * D, stride, slots, t0, n, h0, std::min(G, (kh + 1) * group - h0)});
  }
}

template <int64_t D, Format F>
void decode_one(const Fp8Call<bf16_t>& c, const Geometry& g, const Batch& batch, int64_t b,
                std::vector<float>& work) {
  using radixserve_fp8::pair64;
  using radixserve_fp8::perm64;
  const int64_t group = g.hq / g.hkv, len = batch.len_of(b);
  const int32_t* slots = batch.slots_of(b);
  const Bf16Lut<F> lut;
  const int64_t lenp = (len + 15) & ~int64_t{15};
  work.resize(g.hq * len + g.hq * D + g.hq * D / 2 + g.hq * lenp);
  float* sc = work.data();                                 // (hq, len) scores, then P
  float* acc = sc + g.hq * len;                            // (hq, D) P.V, pair64's order
  auto* qb = reinterpret_cast<bf16_t*>(acc + g.hq * D);    // (hq, D) q, perm64's order
  bf16_t* ph = qb + g.hq * D;                              // (hq, lenp) P's bf16 hi
  bf16_t* pl = ph + g.hq * lenp;                           // (hq, lenp) and lo
  const bf16_t* q = c.q_of(b);
  for (int64_t h = 0; h < g.hq; ++h)
    for (int64_t e = 0; e < D; ++e) qb[h * D + e] = q[h * D + (e & ~63) + perm64(e & 63)];
  over_slices<D>(c.k, g.sk, g, slots, len, [&](int64_t kh, const Slice& s) {
    scores_block<D, F>(s, lut, qb, g.scale * c.k_scale[kh], sc, len);
  });
  float* lse = c.lse_of(b);
  for (int64_t h = 0; h < g.hq; ++h) {
    lse[h] = softmax(sc + h * len, len, g.softcap);
    split_p(sc + h * len, len, lenp, ph + h * lenp, pl + h * lenp);
  }
  std::fill(acc, acc + g.hq * D, 0.f);
  over_slices<D>(c.v, g.sv, g, slots, len, [&](int64_t, const Slice& s) {
    values_block<D, F>(s, lut, ph, pl, lenp, acc);
  });
  bf16_t* out = c.out_of(b);
  for (int64_t h = 0; h < g.hq; ++h)
    for (int64_t e = 0; e < D; ++e)
      radixserve_bf16::st(out, h * D + (e & ~63) + pair64(e & 63),
                          acc[h * D + e] * c.v_scale[h / group]);
}

template <int64_t D>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& k_scale, const at::Tensor& v_scale, const Geometry& g,
         const Batch& batch, at::Tensor& out, at::Tensor& lse) {
  const Fp8Call<bf16_t> c(q, k_cache, v_cache, k_scale, v_scale, out, lse);
  with_format(k_cache.scalar_type(), [&](auto ftag) {
    constexpr Format F = decltype(ftag)::value;
    each_request(batch, [&](int64_t b, std::vector<float>& work) {
      decode_one<D, F>(c, g, batch, b, work);
    });
  });
}

}  // namespace
#endif

bool decode_fp8_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& k_scale, const at::Tensor& v_scale, const Geometry& g,
                     const Batch& batch, at::Tensor& out, at::Tensor& lse) {
#if RS_FP8_BF16_LUT
  if (q.scalar_type() != at::kBFloat16) return false;
  switch (g.d) {
    case 64: run<64>(q, k_cache, v_cache, k_scale, v_scale, g, batch, out, lse); break;
    case 128: run<128>(q, k_cache, v_cache, k_scale, v_scale, g, batch, out, lse); break;
    case 256: run<256>(q, k_cache, v_cache, k_scale, v_scale, g, batch, out, lse); break;
    default: return false;  // head dim 32 and others: the AVX-512 path or the portable loop
  }
  return true;
#else
  return false;  // no AVX512-BF16 / VBMI at build time
#endif
}

}  // namespace radixserve_decode
