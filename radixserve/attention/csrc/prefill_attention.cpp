// Causal prefill attention on CPU: one request's chunk of new tokens attends to its cached
// prefix (read in place from the paged KV pool through its slots) and causally to itself.
//
// Registered as torch.ops.radixserve.prefill_attention; radixserve/attention/cpu_kernels.py
// builds it (with paged_decode.cpp, one extension) and owns the reference semantics
// (prefill_attention_reference there).
//
// Shapes: q (M, Hq, D), k/v (M, Hkv, D): the chunk's tokens, any token/head strides with D
// contiguous; k_cache/v_cache (S, Hkv, D) with (Hkv, D) rows contiguous; prefix_slots (P,)
// int32 (P may be 0). Key index space: [0, P) the prefix, [P, P + M) the chunk; query i sees
// keys [0, P + i]. Query head h reads KV head h / (Hq / Hkv). Returns out (M, Hq, D) in q's
// dtype and lse (M, Hq) float32 (scores scaled, natural log). An 8-bit pool (float8_e4m3fn /
// float8_e5m2) comes with k_scale, v_scale (Hkv,) float32: its prefix rows are read in place
// and converted as the kernel copies them into its blocks (prefill_common.h: KVRows), each
// value its code times the scale rounded once to q's dtype, as kv_quant.dequantize gives.
// window > 0 (a sliding window): query i sees keys [P + i - window + 1, P + i] only (the caller
// passes only the prefix slots the chunk's first query can see); softcap > 0 (Gemma 2):
// each scaled score s is softcap * tanh(s / softcap) before the softmax. 0: none.
//
// Scheme (flash attention, fp32 accumulation): per KV head, K is converted once into a
// transposed fp32 matrix Kt (D, Lpad) and V into (Lpad, D); tasks are (KV head, block of BQ
// queries), each holding its G query heads x BQ queries as rows, walking key blocks of BK with
// an online softmax. Key blocks entirely after the block's last query are never touched; only
// the diagonal blocks look at the mask. Q.K^T is a broadcast-FMA over BK keys (Kt's rows are
// contiguous in keys), P.V a broadcast-FMA over D, 4 rows at a time so gcc keeps the
// accumulators in registers. bf16 inputs on AVX512-BF16 CPUs take prefill_attention_bf16.cpp's
// dot-product path instead (shared pieces: prefill_common.h).
#include <torch/library.h>

#include <optional>

#include "prefill_common.h"

namespace {

using namespace radixserve_prefill;  // NOLINT: the kernels' shared vocabulary

inline float to_f(float x) { return x; }
inline float to_f(at::BFloat16 x) { return static_cast<float>(x); }

// s[r][j] = sum_d q[r][d] * kt[d][j] for RQK rows and BK keys; s's rows W apart.
template <int64_t D, int64_t W>
inline void qk_rows(const float* q, const float* kt, int64_t lk, float* s) {
  float acc[RQK][BK] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float* kr = kt + d * lk;
    for (int64_t r = 0; r < RQK; ++r) {
      const float a = q[r * D + d];
#pragma omp simd
      for (int64_t j = 0; j < BK; ++j) acc[r][j] += a * kr[j];
    }
  }
  for (int64_t r = 0; r < RQK; ++r)
    for (int64_t j = 0; j < BK; ++j) s[r * W + j] = acc[r][j];
}

// o[r][:] += sum_{j < W} p[r][j] * v[j][:] for RQK rows (p is zero past a row's visible
// keys, V's rows past the last key are zeros: a fixed trip count the compiler unrolls), in
// column strips of 32: 8 x 32 accumulators = 16 zmm, the same shape as qk_rows.
template <int64_t D, int64_t W>
inline void pv_rows(const float* p, const float* v, float* o) {
  constexpr int64_t C = D < 32 ? D : 32;
  for (int64_t c = 0; c < D; c += C) {
    float acc[RQK][C];
    for (int64_t r = 0; r < RQK; ++r)
      for (int64_t e = 0; e < C; ++e) acc[r][e] = o[r * D + c + e];
    for (int64_t j = 0; j < W; ++j) {
      const float* vr = v + j * D + c;
      for (int64_t r = 0; r < RQK; ++r) {
        const float a = p[r * W + j];
#pragma omp simd
        for (int64_t e = 0; e < C; ++e) acc[r][e] += a * vr[e];
      }
    }
    for (int64_t r = 0; r < RQK; ++r)
      for (int64_t e = 0; e < C; ++e) o[r * D + c + e] = acc[r][e];
  }
}

// One block of W keys from k0 for the task's rows: scores, online softmax, P.V into o.
template <int64_t D, int64_t W>
void key_block(const float* qf, const float* kt, const float* vf, const Shape& sh, int64_t q0,
               int64_t used, int64_t rows, int64_t k0, float* s, float* o, float* mrow,
               float* lrow) {
  const int64_t kn = std::min(W, sh.p + q0 + (used + sh.g - 1) / sh.g - k0);
  for (int64_t r = 0; r < rows; r += RQK)
    for (int64_t c = 0; c < W; c += BK)
      qk_rows<D, W>(qf + r * D, kt + k0 + c, sh.lpad, s + r * W + c);
  for (int64_t r = 0; r < rows; ++r) {
    // visible keys of this row in the block: up to key p + q0 + i inclusive
    const int64_t query = sh.p + q0 + r / sh.g;
    const int64_t vis = r < used ? std::min(kn, query + 1 - k0) : 0;
    float* sr = s + r * W;
    float alpha = 1.f;
    // nothing visible: padding rows, a diagonal block past the query, keys before its window
    if (!softmax_row_limited<W>(sh, sr, k0, query, vis, mrow[r], lrow[r], alpha)) continue;
    if (alpha != 1.f) {
      float* orow = o + r * D;
#pragma omp simd
      for (int64_t e = 0; e < D; ++e) orow[e] *= alpha;
    }
  }
  for (int64_t r = 0; r < rows; r += RQK) pv_rows<D, W>(s + r * W, vf + k0 * D, o + r * D);
}

// One task: KV head h, queries [q0, q0 + nq). Rows r = i * g + gi (gi: head in the group),
// padded to a multiple of RQK with zero queries that see nothing.
template <int64_t D, typename T>
void attend_task(const T* q, int64_t sq0, int64_t sq1, const float* kt, const float* vf,
                 const Shape& sh, int64_t h, int64_t q0, int64_t nq, T* out, float* lse,
                 std::vector<float>& work) {
  const int64_t used = nq * sh.g, rows = (used + RQK - 1) / RQK * RQK;
  work.resize(rows * (2 * D + BIG + 2));
  float* qf = work.data();
  float* o = qf + rows * D;
  float* s = o + rows * D;
  float* mrow = s + rows * BIG;
  float* lrow = mrow + rows;
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = qf + r * D;
    if (r < used) {
      const T* src = q + (q0 + r / sh.g) * sq0 + (h * sh.g + r % sh.g) * sq1;
      for (int64_t e = 0; e < D; ++e) dst[e] = to_f(src[e]) * sh.scale;
    } else {
      for (int64_t e = 0; e < D; ++e) dst[e] = 0.f;
    }
  }
  std::fill(o, o + rows * D, 0.f);
  std::fill(mrow, mrow + rows, NEG);
  std::fill(lrow, lrow + rows, 0.f);
  const int64_t full = sh.p + q0;       // keys every query of the task sees
  const int64_t kend = sh.p + q0 + nq;  // keys the block's last query sees
  int64_t k0 = first_key_block(sh, q0);
  for (; k0 + BIG <= full; k0 += BIG)
    key_block<D, BIG>(qf, kt, vf, sh, q0, used, rows, k0, s, o, mrow, lrow);
  for (; k0 < kend; k0 += BK) key_block<D, BK>(qf, kt, vf, sh, q0, used, rows, k0, s, o, mrow, lrow);
  for (int64_t r = 0; r < used; ++r) {
    const int64_t i = r / sh.g, head = h * sh.g + r % sh.g;
    const float inv = 1.f / lrow[r];
    T* dst = out + ((q0 + i) * sh.hq + head) * D;
    for (int64_t e = 0; e < D; ++e) dst[e] = static_cast<T>(o[r * D + e] * inv);
    lse[(q0 + i) * sh.hq + head] = mrow[r] + std::log(lrow[r]);
  }
}

// Kt (Hkv, D, Lpad) and V (Hkv, Lpad, D) in fp32: the prefix from the pool, then the chunk.
template <int64_t D, typename T>
void convert_kv(const KVRows<T>& src, const Shape& sh, float* kt, float* vf) {
  at::parallel_for(0, sh.hkv, 1, [&](int64_t hb, int64_t he) {
    for (int64_t h = hb; h < he; ++h) {
      float* kth = kt + h * D * sh.lpad;
      float* vh = vf + h * sh.lpad * D;
      T kb[D], vb[D];  // an 8-bit prefix row, converted
      for (int64_t t = 0; t < sh.lpad; ++t) {
        const auto [kr, vr] = src.rows(t, h, D, sh, kb, vb);
        for (int64_t e = 0; e < D; ++e) {
          kth[e * sh.lpad + t] = kr ? to_f(kr[e]) : 0.f;
          vh[t * D + e] = vr ? to_f(vr[e]) : 0.f;
        }
      }
    }
  });
}

template <int64_t D, typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
         const at::Tensor& vc, const at::Tensor& slots, const Shape& sh, at::Tensor& out,
         at::Tensor& lse) {
  std::vector<float> kt(sh.hkv * D * sh.lpad), vf(sh.hkv * sh.lpad * D);
  convert_kv<D, T>(KVRows<T>::of(k, v, kc, vc, slots, sh), sh, kt.data(), vf.data());
  const T* qp = static_cast<const T*>(q.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  float* lp = lse.data_ptr<float>();
  for_each_task(sh, [&](int64_t h, int64_t q0, int64_t nq, std::vector<float>& work) {
    attend_task<D, T>(qp, q.stride(0), q.stride(1), kt.data() + h * D * sh.lpad,
                      vf.data() + h * sh.lpad * D, sh, h, q0, nq, op, lp, work);
  });
}

template <int64_t D>
void dispatch_dtype(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& slots,
                    const Shape& sh, at::Tensor& out, at::Tensor& lse) {
  if (q.scalar_type() == at::kFloat) {
    run<D, float>(q, k, v, kc, vc, slots, sh, out, lse);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
#if RS_PREFILL_BF16_DOT
    return run_dot<D>(q, k, v, kc, vc, slots, sh, out, lse);  // head dims 32/64/128 only
#endif
    run<D, at::BFloat16>(q, k, v, kc, vc, slots, sh, out, lse);
  }
}

std::tuple<at::Tensor, at::Tensor> prefill_attention(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& prefix_slots, double scale,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
    double softcap, int64_t window) {
  TORCH_CHECK(softcap >= 0.0 && window >= 0, "softcap, window: > 0, or 0 for none");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 3 &&
                  v_cache.dim() == 3, "bad ranks");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && k_cache.device().is_cpu(),
              "CPU tensors only");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn ||
                   k_cache.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "q, k and v must share a dtype");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() &&
                  (fp8 || k_cache.scalar_type() == q.scalar_type()),
              "k_cache and v_cache share a dtype: q's, or an 8-bit float");
  TORCH_CHECK(fp8 == (k_scale.has_value() && v_scale.has_value()),
              "k_scale and v_scale: given exactly when the caches are 8-bit");
  const int64_t m = q.size(0), hq = q.size(1), d = q.size(2), hkv = k.size(1);
  at::Tensor ks, vs;  // an 8-bit pool's scales, contiguous (kept alive through the call)
  if (fp8) {
    ks = k_scale->contiguous();
    vs = v_scale->contiguous();
    TORCH_CHECK(ks.scalar_type() == at::kFloat && vs.scalar_type() == at::kFloat &&
                    ks.numel() == hkv && vs.numel() == hkv, "k_scale, v_scale: (Hkv,) float32");
  }
  TORCH_CHECK(m >= 1 && k.size(0) == m && v.size(0) == m, "q, k, v: the same token count");
  TORCH_CHECK(hkv >= 1 && hq % hkv == 0 && v.size(1) == hkv && k.size(2) == d && v.size(2) == d &&
                  k_cache.size(1) == hkv && v_cache.size(1) == hkv && k_cache.size(2) == d &&
                  v_cache.size(2) == d, "head counts / head_dim mismatch");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "D must be contiguous");
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1 && k_cache.stride(1) == d &&
                  v_cache.stride(1) == d, "k_cache / v_cache rows must be (Hkv, D) contiguous");
  TORCH_CHECK(prefix_slots.dim() == 1 && prefix_slots.scalar_type() == at::kInt,
              "prefix_slots: 1-D int32");
  const at::Tensor slots = prefix_slots.contiguous();
  const int64_t p = slots.numel();
  const int32_t* sp = slots.data_ptr<int32_t>();
  for (int64_t t = 0; t < p; ++t)
    TORCH_CHECK(0 <= sp[t] && sp[t] < k_cache.size(0) && sp[t] < v_cache.size(0), "bad slot");
  const Shape sh{m, p, hq, hkv, hq / hkv, (p + m + BK - 1) / BK * BK, static_cast<float>(scale),
                 fp8 ? ks.data_ptr<float>() : nullptr, fp8 ? vs.data_ptr<float>() : nullptr,
                 window, static_cast<float>(softcap)};
  at::Tensor out = at::empty({m, hq, d}, q.options());
  at::Tensor lse = at::empty({m, hq}, q.options().dtype(at::kFloat));
  switch (d) {
    case 64: dispatch_dtype<64>(q, k, v, k_cache, v_cache, slots, sh, out, lse); break;
    case 128: dispatch_dtype<128>(q, k, v, k_cache, v_cache, slots, sh, out, lse); break;
    case 32: dispatch_dtype<32>(q, k, v, k_cache, v_cache, slots, sh, out, lse); break;
    default: TORCH_CHECK(false, "head_dim must be 32, 64 or 128");
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def(
      "prefill_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, "
      "Tensor prefix_slots, float scale, Tensor? k_scale=None, Tensor? v_scale=None, "
      "float softcap=0.0, int window=0) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
