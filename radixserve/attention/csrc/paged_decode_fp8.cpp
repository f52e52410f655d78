// Paged decode attention over an 8-bit KV pool (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): the
// rows are read in place and converted as they are read (fp8_access.h), never the pool. A key
// is its stored value times k_scale of its KV head, a value likewise with v_scale: the scales
// fold out of the inner loops (into q or the scores, and into the output).
//
// paged_decode.cpp owns the op, its checks and its semantics; this file is decode_fp8 there.
// Four paths by what the CPU has, for bf16 queries and head dims multiple of 64: AMX-BF16
// (paged_decode_fp8_amx.cpp), else AVX512-BF16 + VBMI (paged_decode_fp8_bf16.cpp), both with
// rows converted to bf16 by table lookups; otherwise, here, AVX-512 CPUs take
// decode_one_fp8_blocked (rows to fp32, FMAs) and the rest decode_one_fp8 (portable).
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
#if RS_FP8_AVX512  // vec_math.h declares radixserve_vec only under __AVX512F__
using radixserve_vec::sum16;
#endif

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
    for (int64_t h = 0; h < g.hq; ++h) {
      const float* qh = qf + h * d;
      const float* kh = rf + (h / group) * d;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t e = 0; e < d; ++e) s += qh[e] * kh[e];
      sc[h * len + t] = s;
    }
  }
  for (int64_t h = 0; h < g.hq; ++h) lse[h] = softmax(sc + h * len, len, g.softcap);
  std::fill(acc, acc + g.hq * d, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    radixserve_fp8::row_to_float<F>(v + slots[t] * g.sv, row, rf);
    for (int64_t h = 0; h < g.hq; ++h) {
      const float p = sc[h * len + t];
      const float* vh = rf + (h / group) * d;
      float* a = acc + h * d;
#pragma omp simd
      for (int64_t e = 0; e < d; ++e) a[e] += p * vh[e];
    }
  }
  for (int64_t h = 0; h < g.hq; ++h)
    for (int64_t e = 0; e < d; ++e) st(out, h * d + e, acc[h * d + e] * v_scale[h / group]);
}

#if RS_FP8_AVX512
// decode_one_fp8 with AVX-512 for head dims that are multiples of 32, in blocks of 16 keys:
// the block's rows (all KV heads) are converted once into L1 (load32_permuted: q is permuted
// alike, the output permuted back), then each query head's 16 scores come from 16 dot
// products summed by sum16 (no horizontal sum per key), and its output accumulators stay in
// registers over the block's 16 values.
template <int64_t D, typename T, Format F>
void decode_one_fp8_blocked(const T* q, const uint8_t* k, const uint8_t* v, const Geometry& g,
                            const float* k_scale, const float* v_scale, const int32_t* slots,
                            int64_t len, T* out, float* lse, std::vector<float>& work) {
  static_assert(D % 32 == 0 && D > 0);
  constexpr int64_t NV = D / 16, BLK = 16;
  const int64_t group = g.hq / g.hkv, row = g.hkv * D;
  constexpr float factor = radixserve_fp8::load32_factor<F>();
  work.resize(g.hq * len + 2 * g.hq * D + BLK * row);
  float* sc = work.data();
  float* qf = sc + g.hq * len;
  float* acc = qf + g.hq * D;
  float* rf = acc + g.hq * D;  // (BLK, Hkv * D): the block's rows, converted
  using radixserve_fp8::permuted32;
  for (int64_t h = 0; h < g.hq; ++h)
    for (int64_t e = 0; e < D; ++e)
      qf[h * D + e] = ld(q, h * D + (e & ~31) + permuted32(e & 31)) *
                      (g.scale * k_scale[h / group] * factor);
  auto convert_block = [&](const uint8_t* base, int64_t sstride, int64_t t0, int64_t n) {
    // The next block's rows are requested now: slots are scattered (pages), so the hardware
    // prefetcher cannot guess them, and the conversion below hides their latency.
    for (int64_t j = t0 + BLK; j < std::min(t0 + 2 * BLK, len); ++j)
      for (int64_t c = 0; c < row; c += 64)
        _mm_prefetch(reinterpret_cast<const char*>(base + slots[j] * sstride + c), _MM_HINT_T0);
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* src = base + slots[t0 + j] * sstride;
      for (int64_t c = 0; c < row; c += 32)
        radixserve_fp8::load32_permuted<F>(src + c, rf + j * row + c);
    }
  };
  // Blocks of 16 rows from `base`, converted; fn(h, t0, n) for every query head.
  auto over_blocks = [&](const uint8_t* base, int64_t sstride, auto&& fn) {
    for (int64_t t0 = 0; t0 < len; t0 += BLK) {
      const int64_t n = std::min(BLK, len - t0);
      convert_block(base, sstride, t0, n);
      for (int64_t h = 0; h < g.hq; ++h) fn(h, t0, n);
    }
  };
  over_blocks(k, g.sk, [&](int64_t h, int64_t t0, int64_t n) {
    __m512 qv[NV];
    for (int64_t c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(qf + h * D + c * 16);
    const float* kh = rf + (h / group) * D;
    __m512 dots[BLK];
    for (int64_t j = 0; j < BLK; ++j) {
      __m512 a = _mm512_setzero_ps();
      if (j < n)
        for (int64_t c = 0; c < NV; ++c)
          a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kh + j * row + c * 16), a);
      dots[j] = a;
    }
    _mm512_mask_storeu_ps(sc + h * len + t0, static_cast<__mmask16>((1u << n) - 1),
                          sum16(dots));
  });
  for (int64_t h = 0; h < g.hq; ++h) lse[h] = softmax(sc + h * len, len, g.softcap);
  std::fill(acc, acc + g.hq * D, 0.f);
  over_blocks(v, g.sv, [&](int64_t h, int64_t t0, int64_t n) {
    __m512 a[NV];
    for (int64_t c = 0; c < NV; ++c) a[c] = _mm512_loadu_ps(acc + h * D + c * 16);
    const float* vh = rf + (h / group) * D;
    const float* p = sc + h * len + t0;
    for (int64_t j = 0; j < n; ++j) {
      const __m512 pj = _mm512_set1_ps(p[j]);
      for (int64_t c = 0; c < NV; ++c)
        a[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vh + j * row + c * 16), a[c]);
    }
    for (int64_t c = 0; c < NV; ++c) _mm512_storeu_ps(acc + h * D + c * 16, a[c]);
  });
  for (int64_t h = 0; h < g.hq; ++h)
    for (int64_t e = 0; e < D; ++e)
      st(out, h * D + (e & ~31) + permuted32(e & 31),
         acc[h * D + e] * (v_scale[h / group] * factor));
}
#endif


}  // namespace

void decode_fp8(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& k_scale, const at::Tensor& v_scale, const Geometry& g,
                const Batch& batch, at::Tensor& out, at::Tensor& lse) {
  if (decode_fp8_amx(q, k_cache, v_cache, k_scale, v_scale, g, batch, out, lse) ||
      decode_fp8_bf16(q, k_cache, v_cache, k_scale, v_scale, g, batch, out, lse))
    return;
  auto run = [&](auto dtag, auto tag, auto ftag) {
    constexpr int64_t D = decltype(dtag)::value;
    constexpr Format F = decltype(ftag)::value;
    using T = decltype(tag);
    const Fp8Call<T> c(q, k_cache, v_cache, k_scale, v_scale, out, lse);
    each_request(batch, [&](int64_t b, std::vector<float>& work) {
#if RS_FP8_AVX512
      if constexpr (D != 0 && D % 32 == 0) {
        return decode_one_fp8_blocked<D, T, F>(c.q_of(b), c.k, c.v, g, c.k_scale, c.v_scale,
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
