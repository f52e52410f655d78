// Paged decode attention over an 8-bit KV pool on AVX-512 CPUs, fp32 or bf16 queries, head dims
// 32, 64, 128 or 256: decode_fp8_avx512, which paged_decode_fp8.cpp tries after the AMX path
// and paged_decode_fp8_bf16.cpp (bf16 queries on AVX512-BF16 CPUs: those run here at head dim
// 32 only). Without AVX-512 this file compiles to a function that declines.
// It replaced the AVX512-BF16 path for bf16 queries (rows to bf16 by vpermi2b tables into L1,
// vdpbf16ps): as fast with the rows in cache, 1.4x faster streaming them from memory
// (74 vs 107 ns a key, SmolLM2's heads, 4097-token contexts; bench/README.md).
//
// Why this shape: at one 512-bit load per cycle (Zen 4; Intel's two loads per cycle with the
// conversions' stores come close), converting a block's rows to fp32 in L1 and reading them back
// for every query head made the loads, not the FMAs, the bound. Here, per block of 16 keys and
// per KV head, each key's row is widened to fp32 in registers (widen32: fp16's fields, F16C;
// no table, no gather, no store) and used there by up to GB query heads of that KV head's group,
// whose q (times scale, k_scale and the format's factor) stays in registers: no FMA reads
// memory. Scores: each key pair's 16-lane dot products folded at once, two pairs per 4 keys, 4
// of those into the block's 16 scores (scores_block), stored 16 at a time. P.V: the heads'
// accumulators in registers over the block, each key's probability broadcast; v_scale applied
// once to the output. The rows' fp32 order is
// widen32's (permuted32): q is permuted alike and the output back.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16_access.h"
#include "decode_common.h"
#include "fp8_access.h"

namespace radixserve_decode {

#if RS_FP8_AVX512 && RS_VEC_AVX2
namespace {

using radixserve_bf16::bf16_t;
using radixserve_fp8::Format;
using radixserve_fp8::Slice;
using radixserve_fp8::permuted32;

constexpr int64_t BLK = 16;  // keys per block

// Query heads handled at once per KV head: their q (or accumulators) fill 16 zmm.
template <int64_t D>
constexpr int64_t heads_at_once() { return D / 16 >= 16 ? 1 : 16 / (D / 16); }

// One KV head's D bytes -> D / 16 zmm of fp32 (widen32's order, times load_factor).
template <int64_t D, Format F>
inline void widen_row(const uint8_t* p, __m512* x) {
#pragma GCC unroll 8
  for (int64_t c = 0; c < D / 32; ++c) radixserve_fp8::widen32<F>(p + 32 * c, x[2 * c], x[2 * c + 1]);
}

// The 16-lane dot products of the first ng of G heads' q with one key's row (one chain each:
// the heads and keys in flight hide the FMA latency).
template <int64_t D, int64_t G>
inline void dots(const __m512 (*q)[D / 16], int64_t ng, const __m512* k, __m512* out) {
#pragma GCC unroll 16
  for (int64_t g = 0; g < G; ++g) {
    if (g >= ng) break;
    __m512 a = _mm512_mul_ps(q[g][0], k[0]);
#pragma GCC unroll 16
    for (int64_t c = 1; c < D / 16; ++c) a = _mm512_fmadd_ps(q[g][c], k[c], a);
    out[g] = a;
  }
}

// Scores (scaled) of the slice's heads for its keys, into sc (hq, len): each key pair's dot
// products folded at once (fold2), two pairs into one vector per 4 keys (fold4), four of those
// into the block's 16 scores (reduce16): ~2.8 instructions per (head, key) for the horizontal
// sums, where folding each to 8 lanes and summing 8 keys from L1 (sum8) took ~6.
template <int64_t D, Format F>
void scores_block(const Slice& s, const float* qf, float* sc, int64_t len) {
  using radixserve_vec::fold2;
  constexpr int64_t NV = D / 16, G = heads_at_once<D>();
  __m512 q[G][NV];
#pragma GCC unroll 16
  for (int64_t g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int64_t c = 0; c < NV; ++c)
      q[g][c] = g < s.ng ? _mm512_loadu_ps(qf + (s.h0 + g) * D + 16 * c) : _mm512_setzero_ps();
  alignas(64) float quad[G][BLK / 4][16];  // (head, 4 keys): fold4's vector
  for (int64_t j0 = 0; j0 < BLK; j0 += 4) {
    __m512 pair[2][G];
#pragma GCC unroll 2
    for (int64_t p = 0; p < 2; ++p) {
      __m512 k[NV], e[G], o[G];
      widen_row<D, F>(s.row(j0 + 2 * p), k);
      dots<D, G>(q, s.ng, k, e);
      widen_row<D, F>(s.row(j0 + 2 * p + 1), k);
      dots<D, G>(q, s.ng, k, o);
#pragma GCC unroll 16
      for (int64_t g = 0; g < G; ++g)
        if (g < s.ng) pair[p][g] = fold2(e[g], o[g]);
    }
#pragma GCC unroll 16
    for (int64_t g = 0; g < G; ++g)
      if (g < s.ng) _mm512_store_ps(quad[g][j0 / 4], radixserve_vec::fold4(pair[0][g], pair[1][g]));
  }
  const auto mask = static_cast<__mmask16>((1u << s.n) - 1);
  for (int64_t g = 0; g < s.ng; ++g) {
    const __m512 r[4] = {_mm512_load_ps(quad[g][0]), _mm512_load_ps(quad[g][1]),
                         _mm512_load_ps(quad[g][2]), _mm512_load_ps(quad[g][3])};
    _mm512_mask_storeu_ps(sc + (s.h0 + g) * len + s.t0, mask, radixserve_vec::reduce16(r));
  }
}

// acc (hq, D) of the slice's heads += their probabilities (p: (hq, len)) times the values.
template <int64_t D, Format F>
void values_block(const Slice& s, const float* p, int64_t len, float* acc) {
  constexpr int64_t NV = D / 16, G = heads_at_once<D>();
  __m512 a[G][NV];
#pragma GCC unroll 16
  for (int64_t g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int64_t c = 0; c < NV; ++c)
      a[g][c] = g < s.ng ? _mm512_loadu_ps(acc + (s.h0 + g) * D + 16 * c) : _mm512_setzero_ps();
  for (int64_t j = 0; j < s.n; ++j) {
    __m512 v[NV];
    widen_row<D, F>(s.row(j), v);
#pragma GCC unroll 16
    for (int64_t g = 0; g < G; ++g) {
      if (g >= s.ng) break;
      const __m512 pj = _mm512_set1_ps(p[(s.h0 + g) * len + s.t0 + j]);
#pragma GCC unroll 16
      for (int64_t c = 0; c < NV; ++c) a[g][c] = _mm512_fmadd_ps(pj, v[c], a[g][c]);
    }
  }
#pragma GCC unroll 16
  for (int64_t g = 0; g < G; ++g)
    if (g < s.ng)
#pragma GCC unroll 16
      for (int64_t c = 0; c < NV; ++c) _mm512_storeu_ps(acc + (s.h0 + g) * D + 16 * c, a[g][c]);
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
        fn(Slice{pool + kh * D, stride, slots, t0, n, h0, std::min(G, (kh + 1) * group - h0)});
  }
}

template <int64_t D, typename T, Format F>
void decode_one(const Fp8Call<T>& c, const Geometry& g, const Batch& batch, int64_t b,
                std::vector<float>& work) {
  const int64_t group = g.hq / g.hkv, len = batch.len_of(b);
  const int32_t* slots = batch.slots_of(b);
  constexpr float factor = radixserve_fp8::load_factor<F>();
  work.resize(g.hq * len + 2 * g.hq * D);
  float* sc = work.data();      // (hq, len) scores, then probabilities
  float* qf = sc + g.hq * len;  // (hq, D) q in widen32's order, times its scales
  float* acc = qf + g.hq * D;   // (hq, D) P.V in widen32's order
  const T* q = c.q_of(b);
  for (int64_t h = 0; h < g.hq; ++h) {
    const float s = g.scale * c.k_scale[h / group] * factor;
    for (int64_t e = 0; e < D; ++e)
      qf[h * D + e] = radixserve_bf16::ld(q, h * D + (e & ~31) + permuted32(e & 31)) * s;
  }
  over_slices<D>(c.k, g.sk, g, slots, len,
                 [&](const Slice& s) { scores_block<D, F>(s, qf, sc, len); });
  float* lse = c.lse_of(b);
  for (int64_t h = 0; h < g.hq; ++h) lse[h] = softmax(sc + h * len, len, g.softcap);
  std::fill(acc, acc + g.hq * D, 0.f);
  over_slices<D>(c.v, g.sv, g, slots, len,
                 [&](const Slice& s) { values_block<D, F>(s, sc, len, acc); });
  T* out = c.out_of(b);
  for (int64_t h = 0; h < g.hq; ++h) {
    const float s = c.v_scale[h / group] * factor;
    for (int64_t e = 0; e < D; ++e)
      radixserve_bf16::st(out, h * D + (e & ~31) + permuted32(e & 31), acc[h * D + e] * s);
  }
}

template <int64_t D, typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& k_scale, const at::Tensor& v_scale, const Geometry& g,
         const Batch& batch, at::Tensor& out, at::Tensor& lse) {
  const Fp8Call<T> c(q, k_cache, v_cache, k_scale, v_scale, out, lse);
  with_format(k_cache.scalar_type(), [&](auto ftag) {
    constexpr Format F = decltype(ftag)::value;
    each_request(batch, [&](int64_t b, std::vector<float>& work) {
      decode_one<D, T, F>(c, g, batch, b, work);
    });
  });
}

template <int64_t D>
void by_dtype(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& k_scale, const at::Tensor& v_scale, const Geometry& g,
              const Batch& batch, at::Tensor& out, at::Tensor& lse) {
  if (q.scalar_type() == at::kFloat) {
    run<D, float>(q, k_cache, v_cache, k_scale, v_scale, g, batch, out, lse);
  } else {
    run<D, bf16_t>(q, k_cache, v_cache, k_scale, v_scale, g, batch, out, lse);
  }
}

}  // namespace
#endif

bool decode_fp8_avx512(const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& k_scale,
                       const at::Tensor& v_scale, const Geometry& g, const Batch& batch,
                       at::Tensor& out, at::Tensor& lse) {
#if RS_FP8_AVX512 && RS_VEC_AVX2
  switch (g.d) {
    case 64: by_dtype<64>(q, k_cache, v_cache, k_scale, v_scale, g, batch, out, lse); break;
    case 128: by_dtype<128>(q, k_cache, v_cache, k_scale, v_scale, g, batch, out, lse); break;
    case 32: by_dtype<32>(q, k_cache, v_cache, k_scale, v_scale, g, batch, out, lse); break;
    case 256: by_dtype<256>(q, k_cache, v_cache, k_scale, v_scale, g, batch, out, lse); break;
    default: return false;  // other head dims: the portable loop
  }
  return true;
#else
  return false;  // no AVX-512 at build time
#endif
}

}  // namespace radixserve_decode
