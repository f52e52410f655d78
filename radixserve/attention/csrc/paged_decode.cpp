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
// An 8-bit pool (float8_e4m3fn / float8_e5m2) comes with k_scale, v_scale (Hkv,) float32: a
// key is its stored value times k_scale of its head (folded into q), a value likewise (folded
// into the output); each slot's row is converted to fp32 once as it is read (fp8_access.h).
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
#include "fp8_access.h"
#include "vec_math.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define RS_DECODE_BF16_DOT 1
#else
#define RS_DECODE_BF16_DOT 0
#endif

namespace {

using radixserve_bf16::bf16_t;
using radixserve_bf16::ld;
using radixserve_bf16::st;

inline bool is_fp8(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

struct Geometry {
  int64_t hq, hkv, d, sk, sv;  // query heads, KV heads, head_dim, slot strides of the caches
  float scale;
};

// Scores of every query head of a request over its `len` positions, into sc (hq, len): one
// walk over the keys, each slot's row (all KV heads, contiguous) read once for all heads. D
// is compile-time (D = 0: the generic instance for other head dims) so that each
// dot product is a fixed run of vector FMAs and one horizontal sum.
#if RS_DECODE_BF16_DOT
// bf16 with AVX512-BF16: each dot product as vdpbf16ps over 32 (q, k) pairs per instruction,
// q and k used exactly as stored (bf16), the scale applied to the fp32 score.
template <int64_t D>
void scores_dot(const bf16_t* q, const bf16_t* k, const Geometry& g, const int32_t* slots,
                int64_t len, float* sc) {
  static_assert(D % 32 == 0);
  const int64_t group = g.hq / g.hkv;
  for (int64_t t = 0; t < len; ++t) {
    const bf16_t* kr = k + slots[t] * g.sk;
    for (int64_t h = 0; h < g.hq; ++h) {
      const bf16_t* qh = q + h * D;
      const bf16_t* kh = kr + (h / group) * D;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t e = 0; e < D; e += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qh + e),
                               (__m512bh)_mm512_loadu_si512(kh + e));
      sc[h * len + t] = _mm512_reduce_add_ps(acc) * g.scale;
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
  for (int64_t i = 0; i < g.hq * d; ++i) qf[i] = ld(q, i) * g.scale;
  for (int64_t t = 0; t < len; ++t) {
    const T* kr = k + slots[t] * g.sk;
    for (int64_t h = 0; h < g.hq; ++h) {
      const float* qh = qf + h * d;
      const T* kh = kr + (h / group) * d;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t e = 0; e < d; ++e) s += qh[e] * ld(kh, e);
      sc[h * len + t] = s;
    }
  }
}

// Softmax of one head's scores in place (normalized: out needs no division); returns the lse.
// exp's argument is clamped at -80 (e^-80 ~ 2e-35 next to the max's 1: nothing in fp32).
inline float softmax(float* s, int64_t len) {
#if defined(__AVX512F__)
  // len >= 1 (checked); no infinities: this file builds with -ffast-math
  auto tail = [len](int64_t t) -> __mmask16 {
    return len - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - t)) - 1);
  };
  __m512 vmax = _mm512_set1_ps(s[0]);
  for (int64_t t = 0; t < len; t += 16)
    vmax = _mm512_mask_max_ps(vmax, tail(t), vmax, _mm512_maskz_loadu_ps(tail(t), s + t));
  const float m = _mm512_reduce_max_ps(vmax);
  const __m512 vm = _mm512_set1_ps(m), floor = _mm512_set1_ps(-80.f);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 k = tail(t);
    const __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), vm), floor);
    const __m512 e = _mm512_maskz_mov_ps(k, radixserve_vec::exp_ps(x));
    _mm512_mask_storeu_ps(s + t, k, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  const float sum = _mm512_reduce_add_ps(vsum);
#else
  float m = s[0];  // len >= 1 (checked); no infinities: this file builds with -ffast-math
#pragma omp simd reduction(max : m)
  for (int64_t t = 1; t < len; ++t) m = s[t] > m ? s[t] : m;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    const float x = s[t] - m;
    s[t] = std::exp(x > -80.f ? x : -80.f);
    sum += s[t];
  }
#endif
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t t = 0; t < len; ++t) s[t] *= inv;
  return m + std::log(sum);
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
  for (int64_t h = 0; h < g.hq; ++h) lse[h] = softmax(sc + h * len, len);
  float* acc = sc + g.hq * len;
  std::fill(acc, acc + g.hq * d, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const T* vr = v + slots[t] * g.sv;
    for (int64_t h = 0; h < g.hq; ++h) {
      const float p = sc[h * len + t];
      const T* vh = vr + (h / group) * d;
      float* a = acc + h * d;
#pragma omp simd
      for (int64_t e = 0; e < d; ++e) a[e] += p * ld(vh, e);
    }
  }
  for (int64_t i = 0; i < g.hq * d; ++i) st(out, i, acc[i]);
}

// decode_one over an 8-bit pool: each slot's K (then V) row, all KV heads, converted to fp32
// in L1 once for the whole group of query heads; K's scale folded into q, V's into the output.
template <int64_t D, typename T, radixserve_fp8::Format F>
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
  for (int64_t h = 0; h < g.hq; ++h) lse[h] = softmax(sc + h * len, len);
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

// decode_one_fp8 with AVX-512 for head dims that are multiples of 32, in blocks of 16 keys:
// the block's rows (all KV heads) are converted once into L1 (load32_permuted: q is permuted
// alike, the output permuted back), then each query head's 16 scores come from 16 dot
// products summed by sum16 (no horizontal sum per key), and its output accumulators stay in
// registers over the block's 16 values.
template <int64_t D, typename T, radixserve_fp8::Format F>
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
  for (int64_t h = 0; h < g.hq; ++h) lse[h] = softmax(sc + h * len, len);
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

std::tuple<at::Tensor, at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                                const at::Tensor& v_cache,
                                                const at::Tensor& slot_table,
                                                const at::Tensor& rows, const at::Tensor& starts,
                                                const at::Tensor& seq_lens, double scale,
                                                const std::optional<at::Tensor>& k_scale,
                                                const std::optional<at::Tensor>& v_scale) {
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
  at::Tensor ks, vs;
  if (fp8) {
    ks = k_scale->contiguous();
    vs = v_scale->contiguous();
    TORCH_CHECK(ks.scalar_type() == at::kFloat && vs.scalar_type() == at::kFloat &&
                    ks.numel() == hkv && vs.numel() == hkv, "k_scale, v_scale: (Hkv,) float32");
  }
  const at::Tensor qc = q.contiguous(), st = slot_table.contiguous();
  const at::Tensor rw = rows.contiguous(), sa = starts.contiguous(), sl = seq_lens.contiguous();
  const int64_t lmax = st.size(1);
  const int64_t* rp = rw.data_ptr<int64_t>();
  const int64_t* sp = sa.data_ptr<int64_t>();
  const int64_t* lp = sl.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(0 <= sp[b] && sp[b] < lp[b] && lp[b] <= lmax && 0 <= rp[b] && rp[b] < st.size(0),
                "bad starts / seq_lens / rows");
  at::Tensor out = at::empty_like(qc);
  at::Tensor lse = at::empty({B, hq}, q.options().dtype(at::kFloat));
  const int64_t* rows_p = rp;
  const int64_t* starts_p = sp;
  const int64_t* lens_p = lp;
  const Geometry geo{hq, hkv, d, k_cache.stride(0), v_cache.stride(0), static_cast<float>(scale)};
  auto run = [&](auto dtag, auto tag) {
    constexpr int64_t D = decltype(dtag)::value;
    using T = decltype(tag);
    const T* qp = static_cast<const T*>(qc.data_ptr());
    const T* kp = static_cast<const T*>(k_cache.data_ptr());
    const T* vp = static_cast<const T*>(v_cache.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    float* lsep = lse.data_ptr<float>();
    const int32_t* slots = st.data_ptr<int32_t>();
    // One task per request: it streams the request's K and V rows once for all its heads.
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> work;
      for (int64_t b = begin; b < end; ++b) {
        decode_one<D, T>(qp + b * hq * d, kp, vp, geo, slots + rows_p[b] * lmax + starts_p[b],
                         lens_p[b] - starts_p[b], op + b * hq * d, lsep + b * hq, work);
      }
    });
  };
  // An 8-bit pool: one task per request, as above, rows converted as they are read.
  auto run_fp8 = [&](auto dtag, auto tag, auto ftag) {
    constexpr int64_t D = decltype(dtag)::value;
    constexpr radixserve_fp8::Format F = decltype(ftag)::value;
    using T = decltype(tag);
    const T* qp = static_cast<const T*>(qc.data_ptr());
    const uint8_t* kp = static_cast<const uint8_t*>(k_cache.data_ptr());
    const uint8_t* vp = static_cast<const uint8_t*>(v_cache.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    float* lsep = lse.data_ptr<float>();
    const int32_t* slots = st.data_ptr<int32_t>();
    const float* ksp = ks.data_ptr<float>();
    const float* vsp = vs.data_ptr<float>();
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> work;
      for (int64_t b = begin; b < end; ++b) {
        const int32_t* sb = slots + rows_p[b] * lmax + starts_p[b];
        const int64_t len = lens_p[b] - starts_p[b];
#if RS_FP8_AVX512
        if constexpr (D != 0 && D % 32 == 0) {
          decode_one_fp8_blocked<D, T, F>(qp + b * hq * d, kp, vp, geo, ksp, vsp, sb, len,
                                          op + b * hq * d, lsep + b * hq, work);
          continue;
        }
#endif
        decode_one_fp8<D, T, F>(qp + b * hq * d, kp, vp, geo, ksp, vsp, sb, len,
                                op + b * hq * d, lsep + b * hq, work);
      }
    });
  };
  auto by_format = [&](auto dtag, auto tag) {
    using radixserve_fp8::Format;
    if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
      run_fp8(dtag, tag, std::integral_constant<Format, Format::E4M3>{});
    } else {
      run_fp8(dtag, tag, std::integral_constant<Format, Format::E5M2>{});
    }
  };
  auto by_dtype = [&](auto dtag) {
    if (fp8) {
      TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
                  "float32 or bfloat16 only");
      if (q.scalar_type() == at::kFloat) {
        by_format(dtag, float{});
      } else {
        by_format(dtag, bf16_t{});
      }
      return;
    }
    if (q.scalar_type() == at::kFloat) {
      run(dtag, float{});
    } else {
      TORCH_CHECK(q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
      run(dtag, bf16_t{});
    }
  };
  switch (d) {
    case 64: by_dtype(std::integral_constant<int64_t, 64>{}); break;
    case 128: by_dtype(std::integral_constant<int64_t, 128>{}); break;
    case 32: by_dtype(std::integral_constant<int64_t, 32>{}); break;
    default: by_dtype(std::integral_constant<int64_t, 0>{});  // any other head_dim
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(radixserve, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slot_table, Tensor rows, "
      "Tensor starts, Tensor seq_lens, float scale, Tensor? k_scale=None, "
      "Tensor? v_scale=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("paged_decode", &paged_decode); }
