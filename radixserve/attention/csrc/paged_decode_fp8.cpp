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
// Scores of query heads h0 .. h0 + ng - 1 (ng <= 3) of KV head kh over one block of 8 keys
// from t0 (n live; the rest repeat the last key and are not stored), into sc (hq, len): each
// key's row widened into registers 16 values at a time (widen16, no store), the FMAs reading q
// (qf: (hq, D)) from L1; each key pair's 8-lane dot products folded at once (hadd), two pairs
// per 128-bit half (hadd), the block's two 4-key vectors into its 8 scores. 16 ymm hold it:
// 6 accumulators, 3 pair and 3 quad folds, the widened values.
template <int64_t D, Format F>
void scores8(const uint8_t* k, int64_t sk, const int32_t* slots, int64_t t0, int64_t n,
             int64_t kh, int64_t h0, int64_t ng, const float* qf, float* sc, int64_t len) {
  constexpr int64_t G = 3;
  __m256 quad[2][G];
#pragma GCC unroll 2
  for (int64_t p4 = 0; p4 < 2; ++p4) {
    __m256 pair[2][G];
#pragma GCC unroll 2
    for (int64_t p2 = 0; p2 < 2; ++p2) {
      __m256 acc[2][G];
#pragma GCC unroll 2
      for (int64_t e = 0; e < 2; ++e) {
        const int64_t j = std::min(4 * p4 + 2 * p2 + e, n - 1);
        const uint8_t* r = k + slots[t0 + j] * sk + kh * D;
#pragma GCC unroll 3
        for (int64_t g = 0; g < G; ++g) acc[e][g] = _mm256_setzero_ps();
#pragma GCC unroll 16
        for (int64_t c = 0; c < D; c += 16) {
          __m256 x0, x1;
          radixserve_fp8::widen16<F>(r + c, x0, x1);
#pragma GCC unroll 3
          for (int64_t g = 0; g < G; ++g) {
            if (g >= ng) break;
            const float* qh = qf + (h0 + g) * D + c;
            acc[e][g] = _mm256_fmadd_ps(_mm256_loadu_ps(qh), x0, acc[e][g]);
            acc[e][g] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8), x1, acc[e][g]);
          }
        }
      }
#pragma GCC unroll 3
      for (int64_t g = 0; g < G; ++g) pair[p2][g] = _mm256_hadd_ps(acc[0][g], acc[1][g]);
    }
#pragma GCC unroll 3
    for (int64_t g = 0; g < G; ++g) quad[p4][g] = _mm256_hadd_ps(pair[0][g], pair[1][g]);
  }
  alignas(32) float tail[8];
  for (int64_t g = 0; g < ng; ++g) {
    const __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(quad[0][g], quad[1][g], 0x20),
                                   _mm256_permute2f128_ps(quad[0][g], quad[1][g], 0x31));
    float* dst = sc + (h0 + g) * len + t0;
    if (n == 8) {
      _mm256_storeu_ps(dst, s);
    } else {
      _mm256_store_ps(tail, s);
      std::copy(tail, tail + n, dst);
    }
  }
}

// decode_one_fp8_blocked for the avx2 tier (head dims multiple of 16), in blocks of 8 keys:
// scores by scores8 (rows widened in registers, up to 3 heads per row); for P.V the block's
// value rows converted once into L1 (load16, in order), each query head's output accumulators
// in registers over the block's 8 values (16 ymm cannot hold a row and a head's accumulators).
template <int64_t D, typename T, Format F>
void decode_one_fp8_blocked8(const T* q, const uint8_t* k, const uint8_t* v, const Geometry& g,
                             const float* k_scale, const float* v_scale, const int32_t* slots,
                             int64_t len, T* out, float* lse, std::vector<float>& work) {
  static_assert(D % 16 == 0 && D > 0);
  constexpr int64_t NV = D / 8, BLK = 8;
  const int64_t group = g.hq / g.hkv, row = g.hkv * D;
  constexpr float factor = radixserve_fp8::load_factor<F>();
  work.resize(g.hq * len + 2 * g.hq * D + BLK * row);
  float* sc = work.data();
  float* qf = sc + g.hq * len;
  float* acc = qf + g.hq * D;
  float* rf = acc + g.hq * D;  // (BLK, Hkv * D): the block's value rows, converted
  for (int64_t h = 0; h < g.hq; ++h)
    for (int64_t e = 0; e < D; ++e)
      qf[h * D + e] = ld(q, h * D + e) * (g.scale * k_scale[h / group] * factor);
  auto over_blocks = [&](const uint8_t* base, int64_t sstride, auto&& fn) {  // P.V
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
  for (int64_t t0 = 0; t0 < len; t0 += BLK) {  // scores: the rows widened in registers
    radixserve_fp8::prefetch_rows<_MM_HINT_T1>(k, g.sk, slots, t0 + BLK,
                                               std::min(t0 + 2 * BLK, len), row);
    const int64_t n = std::min(BLK, len - t0);
    for (int64_t kh = 0; kh < g.hkv; ++kh)
      for (int64_t h0 = kh * group; h0 < (kh + 1) * group; h0 += 3)
        scores8<D, F>(k, g.sk, slots, t0, n, kh, h0, std::min<int64_t>(3, (kh + 1) * group - h0),
                      qf, sc, len);
  }
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
    case 256: by_dtype(std::integral_constant<int64_t, 256>{}); break;
    default: by_dtype(std::integral_constant<int64_t, 0>{});  // any other head_dim
  }
}

}  // namespace radixserve_decode
