// Paged decode attention over an 8-bit KV pool (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): the
// rows are read in place and converted as they are read (fp8_access.h), never the pool. A key
// is its stored value times k_scale of its KV head, a value likewise with v_scale: the scales
// fold out of the inner loops (into q or the scores, and into the output).
//
// paged_decode.cpp owns the op, its checks and its semantics; this file is decode_fp8 there.
// Paths by what the CPU has: for bf16 queries and head dims 64 / 128, AMX-BF16
// (paged_decode_fp8_amx.cpp: rows converted to bf16 by table lookups, tile products); then,
// for bf16 queries and head dims 64 / 128 / 256, AVX512-BF16 with VBMI
// (paged_decode_fp8_bf16.cpp: the same lookups in registers, vdpbf16ps); otherwise AVX-512
// CPUs take paged_decode_fp8_avx512.cpp (fp32 or bf16 queries, head dims
// 32 / 64 / 128 / 256: rows widened to fp32 in registers, FMAs), and here the avx2 tier
// decode_one_fp8_blocked8 and the rest decode_one_fp8 (portable).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16_access.h"
#include "decode_common.h"
#include "fp8_access.h"

namespace radixserve_decode {
namespace {

using radixserve_bf16::bf16_t;
using radixserve_bf16::ld;
using radixserve_bf16::st;
using radixserve_fp8::Format;

// decode_one over an 8-bit pool: each slot's K (then V) row, all KV heads, converted to fp32
// in L1 once for the whole group of query heads; K's scale folded into q, V's into the output.
template <int64_t D, typename T, Format F>
void decode_one_fp8(const T* q, const uint8_t* k, const uint8_t* v, const Geometry& g,
                    const float* k_scale, const float* v_scale, const int32_t* slots,
                    int64_t len, T* out, float* lse, std::vector<float>& work) {
  const int64_t group = g.hq / g.hkv, d = D ? D : g.d, row = g.hkv * d;
  // work: scores (hq, len), q in fp32 (hq, d), accumulators (hq, d), one converted row
  work.resize(g.hq * len + 2 * g.hq * d + row);
  float* sc = work.data();
  float* qf = sc + g.hq * len;
  float* acc = qf + g.hq * d;
  float* rf = acc + g.hq * d;
  for (int64_t h = 0; h < g.hq; ++h)
    for (int64_t e = 0; e < d; ++e) qf[h * d + e] = ld(q, h * d + e) * g.scale * k_scale[h / group];
  for (int64_t t = 0; t < len; ++t) {
    radixserve_fp8::row_to_float<F>(k + slots[t] * g.sk, row, rf);
    for (int64_t j = 0, h = 0; j < g.hkv; ++j) {  // KV head, then its group: no h / group
      const float* kh = rf + j * d;
      for (int64_t i = 0; i < group; ++i, ++h) {
        const float* qh = qf + h * d;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t e = 0; e < d; ++e) s += qh[e] * kh[e];
        sc[h * len + t] = s;
      }
    }
  }
  for (int64_t h = 0; h < g.hq; ++h) lse[h] = softmax(sc + h * len, len, g.softcap);
  std::fill(acc, acc + g.hq * d, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    radixserve_fp8::row_to_float<F>(v + slots[t] * g.sv, row, rf);
    for (int64_t j = 0, h = 0; j < g.hkv; ++j) {
      const float* vh = rf + j * d;
      for (int64_t i = 0; i < group; ++i, ++h) {
        const float p = sc[h * len + t];
        float* a = acc + h * d;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) a[e] += p * vh[e];
      }
    }
  }
  for (int64_t h = 0; h < g.hq; ++h)
    for (int64_t e = 0; e < d; ++e) st(out, h * d + e, acc[h * d + e] * v_scale[h / group]);
}

#if RS_FP8_AVX2 && RS_VEC_AVX2
// decode_one_fp8_blocked for the avx2 tier (head dims multiple of 8), in blocks of 8 keys: the
// block's rows converted once into L1 (load16, in order), each query head's 8 scores from 8
// dot products of 8-lane FMAs summed by sum8, its output accumulators in registers over the
// block's 8 values.
template <int64_t D, typename T, Format F>
void decode_one_fp8_blocked8(const T* q, const uint8_t* k, const uint8_t* v, const Geometry& g,
                             const float* k_scale, const float* v_scale, const int32_t* slots,
                             int64_t len, T* out, float* lse, std::vector<float>& work) {
  static_assert(D % 16 == 0 && D > 0);
  constexpr int64_t NV = D / 8, BLK = 8;
  const int64_t group = g.hq / g.hkv, row = g.hkv * D;
  constexpr float factor = radixserve_fp8::load_factor<F>();
  work.resize(g.hq * len + 2 * g.hq * D + BLK * row + BLK);
  float* sc = work.data();
  float* qf = sc + g.hq * len;
  float* acc = qf + g.hq * D;
  float* rf = acc + g.hq * D;  // (BLK, Hkv * D): the block's rows, converted
  float* tail = rf + BLK * row;  // a partial block's scores
  for (int64_t h = 0; h < g.hq; ++h)
    for (int64_t e = 0; e < D; ++e)
      qf[h * D + e] = ld(q, h * D + e) * (g.scale * k_scale[h / group] * factor);
  auto over_blocks = [&](const uint8_t* base, int64_t sstride, auto&& fn) {
    for (int64_t t0 = 0; t0 < len; t0 += BLK) {
      const int64_t n = std::min(BLK, len - t0);
      // the next block's rows requested now (into L2: prefetch_rows), this block's conversion
      // hides their latency
      radixserve_fp8::prefetch_rows<_MM_HINT_T1>(base, sstride, slots, t0 + BLK,
                                                 std::min(t0 + 2 * BLK, len), row);
      for (int64_t j = 0; j < n; ++j)
        for (int64_t c = 0; c < row; c += 16)
          radixserve_fp8::load16<F>(base + slots[t0 + j] * sstride + c, rf + j * row + c);
      for (int64_t h = 0; h < g.hq; ++h) fn(h, t0, n);
    }
  };
  over_blocks(k, g.sk, [&](int64_t h, int64_t t0, int64_t n) {
    // q in registers over the block (one load per FMA, not two: the loads bound this loop)
    __m256 qv[NV];
    for (int64_t c = 0; c < NV; ++c) qv[c] = _mm256_loadu_ps(qf + h * D + c * 8);
    const float* kh = rf + (h / group) * D;
    __m256 dots[BLK];
    for (int64_t j = 0; j < BLK; ++j) {
      __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();  // two chains: FMA latency
      if (j < n)
        for (int64_t c = 0; c < NV; c += 2) {
          a = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kh + j * row + c * 8), a);
          b = _mm256_fmadd_ps(qv[c + 1], _mm256_loadu_ps(kh + j * row + c * 8 + 8), b);
        }
      dots[j] = _mm256_add_ps(a, b);
    }
    const __m256 s = radixserve_vec::sum8(dots);
    if (n == BLK) {
      _mm256_storeu_ps(sc + h * len + t0, s);
    } else {
      _mm256_storeu_ps(tail, s);
      std::copy(tail, tail + n, sc + h * len + t0);
    }
  });
  for (int64_t h = 0; h < g.hq; ++h) lse[h] = softmax(sc + h * len, len, g.softcap);
  std::fill(acc, acc + g.hq * D, 0.f);
  over_blocks(v, g.sv, [&](int64_t h, int64_t t0, int64_t n) {
    __m256 a[NV];
    for (int64_t c = 0; c < NV; ++c) a[c] = _mm256_loadu_ps(acc + h * D + c * 8);
    const float* vh = rf + (h / group) * D;
    const float* p = sc + h * len + t0;
    for (int64_t j = 0; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      for (int64_t c = 0; c < NV; ++c)
        a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vh + j * row + c * 8), a[c]);
    }
    for (int64_t c = 0; c < NV; ++c) _mm256_storeu_ps(acc + h * D + c * 8, a[c]);
  });
  for (int64_t h = 0; h < g.hq; ++h)
    for (int64_t e = 0; e < D; ++e)
      st(out, h * D + e, acc[h * D + e] * (v_scale[h / group] * factor));
}
#endif

}  // namespace

void decode_fp8(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& k_scale, const at::Tensor& v_scale, const Geometry& g,
                const Batch& batch, at::Tensor& out, at::Tensor& lse) {
  if (decode_fp8_amx(q, k_cache, v_cache, k_scale, v_scale, g, batch, out, lse) ||
      decode_fp8_bf16(q, k_cache, v_cache, k_scale, v_scale, g, batch, out, lse) ||
      decode_fp8_avx512(q, k_cache, v_cache, k_scale, v_scale, g, batch, out, lse))
    return;
  auto run = [&](auto dtag, auto tag, auto ftag) {
    constexpr int64_t D = decltype(dtag)::value;
    constexpr Format F = decltype(ftag)::value;
    using T = decltype(tag);
    const Fp8Call<T> c(q, k_cache, v_cache, k_scale, v_scale, out, lse);
    each_request(batch, [&](int64_t b, std::vector<float>& work) {
#if RS_FP8_AVX2 && RS_VEC_AVX2
      if constexpr (D != 0 && D % 16 == 0) {
        return decode_one_fp8_blocked8<D, T, F>(c.q_of(b), c.k, c.v, g, c.k_scale, c.v_scale,
                                                batch.slots_of(b), batch.len_of(b),
                                                c.out_of(b), c.lse_of(b), work);
      }
#endif
      decode_one_fp8<D, T, F>(c.q_of(b), c.k, c.v, g, c.k_scale, c.v_scale, batch.slots_of(b),
                              batch.len_of(b), c.out_of(b), c.lse_of(b), work);
    });
  };
  auto by_format = [&](auto dtag, auto tag) {
    with_format(k_cache.scalar_type(), [&](auto ftag) { run(dtag, tag, ftag); });
  };
  auto by_dtype = [&](auto dtag) {
    if (q.scalar_type() == at::kFloat) {
      by_format(dtag, float{});
    } else {
      by_format(dtag, bf16_t{});
    }
  };
  switch (g.d) {
    case 64: by_dtype(std::integral_constant<int64_t, 64>{}); break;
    case 128: by_dtype(std::integral_constant<int64_t, 128>{}); break;
    case 32: by_dtype(std::integral_constant<int64_t, 32>{}); break;
    default: by_dtype(std::integral_constant<int64_t, 0>{});  // any other head_dim
  }
}

}  // namespace radixserve_decode
