// Paged decode attention on CPU: one query token per request attends to its keys read in
// place from the paged KV pool through the slot table (no gather into a padded block).
//
// Registered as torch.ops.radixserve.paged_decode; radixserve/attention/cpu_kernels.py builds
// it and owns the reference semantics (see paged_decode_reference there).
//
// Shapes: q (B, Hq, D); k_cache, v_cache (S, Hkv, D) with D contiguous; slot_table (R, Lmax)
// int32; rows, starts, seq_lens (B,) int64. Request b attends to positions
// [starts[b], seq_lens[b]) of table row rows[b]. Query head h reads KV head h / (Hq / Hkv).
// Returns out (B, Hq, D) in q's dtype and lse (B, Hq) float32 (natural log of the softmax's
// denominator, scores scaled), so that callers can merge with other partial attentions.
// softcap > 0 (Gemma 2's logit soft-capping): each scaled score s is softcap * tanh(s / softcap)
// before the softmax (and in the lse); 0: none. A sliding window is the caller's: it raises
// starts[b] to seq_lens[b] - window.
// An 8-bit pool (float8_e4m3fn / float8_e5m2) comes with k_scale, v_scale (Hkv,) float32: a
// key is its stored value times k_scale of its head, a value likewise; paged_decode_fp8.cpp
// reads such a pool (this file checks the arguments and dispatches).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "bf16_access.h"
#include "decode_common.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define RS_DECODE_BF16_DOT 1
#else
#define RS_DECODE_BF16_DOT 0
#endif

namespace {

using radixserve_bf16::bf16_t;
using radixserve_bf16::ld;
using radixserve_bf16::st;

using radixserve_decode::Geometry;
using radixserve_decode::kPrefetchAhead;
using radixserve_decode::prefetch_row;
using radixserve_decode::softmax;

inline bool is_fp8(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

// Scores of every query head of a request over its `len` positions, into sc (hq, len): one
// walk over the keys, each slot's row (all KV heads, contiguous) read once for all heads, KV
// head by KV head and its GQA group's query heads under it (no h / group per key and head:
// an integer division cost more than a 16-wide dot product). D
// is compile-time (D = 0: the generic instance for other head dims) so that each
// dot product is a fixed run of vector FMAs and one horizontal sum.
#if RS_DECODE_BF16_DOT
// bf16 with AVX512-BF16: each dot product as vdpbf16ps over 32 (q, k) pairs per instruction,
// q and k used exactly as stored (bf16), the scale applied to the fp32 score.
template <int64_t D>
void scores_dot(const bf16_t* q, const bf16_t* k, const Geometry& g, const int32_t* slots,
                int64_t len, float* sc) {
  static_assert(D % 32 == 0);
  const int64_t group = g.hq / g.hkv, row = g.hkv * D * 2, stride = g.sk * 2;
  // the first rows' misses issued together (they overlap), then one row ahead per key
  for (int64_t t = 0; t < kPrefetchAhead && t < len; ++t) prefetch_row(k, slots[t], stride, row);
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchAhead < len) prefetch_row(k, slots[t + kPrefetchAhead], stride, row);
    const bf16_t* kr = k + slots[t] * g.sk;
    for (int64_t j = 0, h = 0; j < g.hkv; ++j) {
      const bf16_t* kh = kr + j * D;
      for (int64_t i = 0; i < group; ++i, ++h) {
        const bf16_t* qh = q + h * D;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t e = 0; e < D; e += 32)
          acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qh + e),
                                 (__m512bh)_mm512_loadu_si512(kh + e));
        sc[h * len + t] = _mm512_reduce_add_ps(acc) * g.scale;
      }
    }
  }
}
#endif

template <int64_t D, typename T>
void scores(const T* q, const T* k, const Geometry& g, const int32_t* slots, int64_t len,
            float* qf, float* sc) {
#if RS_DECODE_BF16_DOT
  if constexpr (std::is_same_v<T, bf16_t> && D != 0 && D % 32 == 0) {
    return scores_dot<D>(q, k, g, slots, len, sc);
  }
#endif
  const int64_t d = D ? D : g.d, group = g.hq / g.hkv;
  const int64_t row = g.hkv * d * int64_t{sizeof(T)}, stride = g.sk * int64_t{sizeof(T)};
  for (int64_t t = 0; t < kPrefetchAhead && t < len; ++t) prefetch_row(k, slots[t], stride, row);
  for (int64_t i = 0; i < g.hq * d; ++i) qf[i] = ld(q, i) * g.scale;
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchAhead < len) prefetch_row(k, slots[t + kPrefetchAhead], stride, row);
    const T* kr = k + slots[t] * g.sk;
    for (int64_t j = 0, h = 0; j < g.hkv; ++j) {
      const T* kh = kr + j * d;
      for (int64_t i = 0; i < group; ++i, ++h) {
        const float* qh = qf + h * d;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t e = 0; e < d; ++e) s += qh[e] * ld(kh, e);
        sc[h * len + t] = s;
      }
    }
  }
}

// One request: scores for all heads, softmax, then one walk over the values for all heads,
// the (hq, d) accumulators in L1. (Walking the values once per KV head with a group's
// accumulators in registers was slower in fp32 here: three strided passes over the rows.)
template <int64_t D, typename T>
void decode_one(const T* q, const T* k, const T* v, const Geometry& g, const int32_t* slots,
                int64_t len, T* out, float* lse, std::vector<float>& work) {
  const int64_t group = g.hq / g.hkv, d = D ? D : g.d;
  // work: scores (hq, len), then (hq, d): q in fp32 for the scores, the accumulators after
  work.resize(g.hq * len + g.hq * d);
  float* sc = work.data();
  scores<D, T>(q, k, g, slots, len, sc + g.hq * len, sc);
  // the first value rows' misses overlap the softmax
  const int64_t row = g.hkv * d * int64_t{sizeof(T)}, stride = g.sv * int64_t{sizeof(T)};
  for (int64_t t = 0; t < kPrefetchAhead && t < len; ++t) prefetch_row(v, slots[t], stride, row);
  for (int64_t h = 0; h < g.hq; ++h) lse[h] = softmax(sc + h * len, len, g.softcap);
  float* acc = sc + g.hq * len;
  std::fill(acc, acc + g.hq * d, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchAhead < len) prefetch_row(v, slots[t + kPrefetchAhead], stride, row);
    const T* vr = v + slots[t] * g.sv;
    for (int64_t j = 0, h = 0; j < g.hkv; ++j) {
      const T* vh = vr + j * d;
      for (int64_t i = 0; i < group; ++i, ++h) {
        const float p = sc[h * len + t];
        float* a = acc + h * d;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) a[e] += p * ld(vh, e);
      }
    }
  }
  for (int64_t i = 0; i < g.hq * d; ++i) st(out, i, acc[i]);
}

std::tuple<at::Tensor, at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                                const at::Tensor& v_cache,
                                                const at::Tensor& slot_table,
                                                const at::Tensor& rows, const at::Tensor& starts,
                                                const at::Tensor& seq_lens, double scale,
                                                const std::optional<at::Tensor>& k_scale,
                                                const std::optional<at::Tensor>& v_scale,
                                                double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad ranks");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  const bool fp8 = is_fp8(k_cache.scalar_type());
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() &&
                  (fp8 || k_cache.scalar_type() == q.scalar_type()),
              "k_cache and v_cache share a dtype: q's, or an 8-bit float");
  TORCH_CHECK(slot_table.scalar_type() == at::kInt && rows.scalar_type() == at::kLong &&
                  starts.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "slot_table int32; rows, starts, seq_lens int64");
  const int64_t B = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_cache.size(1);
  TORCH_CHECK(hq % hkv == 0 && k_cache.size(2) == d && v_cache.size(1) == hkv &&
                  v_cache.size(2) == d, "head counts / head_dim mismatch");
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1 && k_cache.stride(1) == d &&
                  v_cache.stride(1) == d, "k_cache / v_cache rows must be (Hkv, D) contiguous");
  TORCH_CHECK(rows.numel() == B && starts.numel() == B && seq_lens.numel() == B, "bad batch");
  TORCH_CHECK(fp8 == (k_scale.has_value() && v_scale.has_value()),
              "k_scale and v_scale: given exactly when the caches are 8-bit");
  const at::Tensor qc = q.contiguous(), st = slot_table.contiguous();
  const at::Tensor rw = rows.contiguous(), sa = starts.contiguous(), sl = seq_lens.contiguous();
  const radixserve_decode::Batch batch{B, st.size(1), st.data_ptr<int32_t>(),
                                       rw.data_ptr<int64_t>(), sa.data_ptr<int64_t>(),
                                       sl.data_ptr<int64_t>()};
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(0 <= batch.starts[b] && batch.starts[b] < batch.lens[b] &&
                    batch.lens[b] <= batch.lmax && 0 <= batch.rows[b] &&
                    batch.rows[b] < st.size(0), "bad starts / seq_lens / rows");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "float32 or bfloat16 only");
  at::Tensor out = at::empty_like(qc);
  at::Tensor lse = at::empty({B, hq}, q.options().dtype(at::kFloat));
  TORCH_CHECK(softcap >= 0.0, "softcap: > 0, or 0 for none");
  const Geometry geo{hq, hkv, d, k_cache.stride(0), v_cache.stride(0), static_cast<float>(scale),
                     static_cast<float>(softcap)};
  if (fp8) {
    const at::Tensor ks = k_scale->contiguous(), vs = v_scale->contiguous();
    TORCH_CHECK(ks.scalar_type() == at::kFloat && vs.scalar_type() == at::kFloat &&
                    ks.numel() == hkv && vs.numel() == hkv, "k_scale, v_scale: (Hkv,) float32");
    radixserve_decode::decode_fp8(qc, k_cache, v_cache, ks, vs, geo, batch, out, lse);
    return {out, lse};
  }
  auto run = [&](auto dtag, auto tag) {
    constexpr int64_t D = decltype(dtag)::value;
    using T = decltype(tag);
    const T* qp = static_cast<const T*>(qc.data_ptr());
    const T* kp = static_cast<const T*>(k_cache.data_ptr());
    const T* vp = static_cast<const T*>(v_cache.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    float* lsep = lse.data_ptr<float>();
    radixserve_decode::each_request(batch, [&](int64_t b, std::vector<float>& work) {
      decode_one<D, T>(qp + b * hq * d, kp, vp, geo, batch.slots_of(b), batch.len_of(b),
                       op + b * hq * d, lsep + b * hq, work);
    });
  };
  auto by_dtype = [&](auto dtag) {
    if (q.scalar_type() == at::kFloat) {
      run(dtag, float{});
    } else {
      run(dtag, bf16_t{});
    }
  };
  switch (d) {
    case 64: by_dtype(std::integral_constant<int64_t, 64>{}); break;
    case 128: by_dtype(std::integral_constant<int64_t, 128>{}); break;
    case 32: by_dtype(std::integral_constant<int64_t, 32>{}); break;
    // small models' heads: the generic loops' per-dot overhead (a runtime trip count, its
    // peel and remainder) cost more than their 16 products
    case 16: by_dtype(std::integral_constant<int64_t, 16>{}); break;
    default: by_dtype(std::integral_constant<int64_t, 0>{});  // any other head_dim
  }
  return {out, lse};
}

}  // namespace

// Each tier's build names its own op namespace (radixserve_<tier>: platform/kernels.py), so
// several tiers load side by side in one process.
#ifndef RADIXSERVE_OPS_NS
#define RADIXSERVE_OPS_NS radixserve
#endif
TORCH_LIBRARY_FRAGMENT(RADIXSERVE_OPS_NS, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slot_table, Tensor rows, "
      "Tensor starts, Tensor seq_lens, float scale, Tensor? k_scale=None, "
      "Tensor? v_scale=None, float softcap=0.0) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(RADIXSERVE_OPS_NS, CPU, m) { m.impl("paged_decode", &paged_decode); }
