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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

// A row of D values as fp32: the row itself for fp32, else converted into `buf`.
inline const float* as_float(const float* src, float*, int64_t) { return src; }
inline const float* as_float(const at::BFloat16* src, float* buf, int64_t d) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    // bf16 is fp32's upper half
    buf[i] = __builtin_bit_cast(float, static_cast<uint32_t>(bits[i]) << 16);
  }
  return buf;
}

inline float dot(const float* a, const float* b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

// One request: its query heads (hq of them, `group` per KV head) over `len` positions. A
// slot's K (and V) row holds all hkv heads contiguously (hkv * d values): each row is read
// once, for every head, so the request's keys are streamed from memory once per layer.
template <typename T>
void decode_one(const T* q, const T* k, const T* v, int64_t sk, int64_t sv, const int32_t* slots,
                int64_t len, int64_t hq, int64_t hkv, int64_t d, float scale, T* out, float* lse,
                std::vector<float>& work) {
  const int64_t group = hq / hkv, width = hkv * d;
  // work: scores (hq, len), q in fp32 (hq, d), accumulators (hq, d), one K/V row (hkv * d)
  work.resize(hq * len + 2 * hq * d + width);
  float* sc = work.data();
  float* qf = sc + hq * len;
  float* acc = qf + hq * d;
  float* row = acc + hq * d;
  for (int64_t i = 0; i < hq * d; ++i) qf[i] = to_float(q[i]) * scale;
  for (int64_t t = 0; t < len; ++t) {
    const float* kr = as_float(k + slots[t] * sk, row, width);
    for (int64_t h = 0; h < hq; ++h) sc[h * len + t] = dot(qf + h * d, kr + (h / group) * d, d);
  }
  for (int64_t h = 0; h < hq; ++h) {
    float* s = sc + h * len;
    float m = s[0];  // len >= 1 (checked); no infinities: this file builds with -ffast-math
    for (int64_t t = 1; t < len; ++t) m = s[t] > m ? s[t] : m;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    lse[h] = m + std::log(sum);
    const float inv = 1.f / sum;  // probabilities normalized here: out needs no division
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) s[t] *= inv;
  }
  for (int64_t i = 0; i < hq * d; ++i) acc[i] = 0.f;
  for (int64_t t = 0; t < len; ++t) {
    const float* vr = as_float(v + slots[t] * sv, row, width);
    for (int64_t h = 0; h < hq; ++h) {
      const float p = sc[h * len + t];
      const float* vh = vr + (h / group) * d;
      float* a = acc + h * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] += p * vh[i];
    }
  }
  for (int64_t i = 0; i < hq * d; ++i) out[i] = static_cast<T>(acc[i]);
}

std::tuple<at::Tensor, at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                                const at::Tensor& v_cache,
                                                const at::Tensor& slot_table,
                                                const at::Tensor& rows, const at::Tensor& starts,
                                                const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad ranks");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(slot_table.scalar_type() == at::kInt && rows.scalar_type() == at::kLong &&
                  starts.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "slot_table int32; rows, starts, seq_lens int64");
  const int64_t B = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_cache.size(1);
  TORCH_CHECK(hq % hkv == 0 && k_cache.size(2) == d && v_cache.size(1) == hkv &&
                  v_cache.size(2) == d, "head counts / head_dim mismatch");
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1 && k_cache.stride(1) == d &&
                  v_cache.stride(1) == d, "k_cache / v_cache rows must be (Hkv, D) contiguous");
  TORCH_CHECK(rows.numel() == B && starts.numel() == B && seq_lens.numel() == B, "bad batch");
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
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* qp = static_cast<const scalar_t*>(qc.data_ptr());
    const scalar_t* kp = static_cast<const scalar_t*>(k_cache.data_ptr());
    const scalar_t* vp = static_cast<const scalar_t*>(v_cache.data_ptr());
    scalar_t* op = static_cast<scalar_t*>(out.data_ptr());
    float* lsep = lse.data_ptr<float>();
    const int32_t* slots = st.data_ptr<int32_t>();
    const int64_t sk = k_cache.stride(0), sv = v_cache.stride(0);
    // One task per request: it streams the request's K and V rows once for all its heads.
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> work;
      for (int64_t b = begin; b < end; ++b) {
        decode_one<scalar_t>(qp + b * hq * d, kp, vp, sk, sv,
                             slots + rows_p[b] * lmax + starts_p[b], lens_p[b] - starts_p[b],
                             hq, hkv, d, static_cast<float>(scale), op + b * hq * d,
                             lsep + b * hq, work);
      }
    });
  };
  if (q.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
    run(at::BFloat16{});
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(radixserve, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slot_table, Tensor rows, "
      "Tensor starts, Tensor seq_lens, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("paged_decode", &paged_decode); }
