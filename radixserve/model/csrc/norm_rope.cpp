// RMSNorm and rotary embeddings on CPU, each one pass over its rows instead of torch's
// sequence of elementwise ops (every op of which reads and writes the whole (T, hidden)
// activation and allocates its result).
//
// Registered as torch.ops.radixserve.rms_norm, .rope_qk and .rope_store;
// radixserve/model/norm_rope.py builds them and owns their specification (the torch code they
// replace, rms_norm_reference and rope_qk_reference there, which the tests compare with).
//
// Numerics: the same operations in the same order as the torch code, each product rounded on
// its own (this file builds without -ffast-math and with -ffp-contract=off: no FMA
// contraction), so rope_qk is bit-identical to it; rms_norm too in fp32 with `lanes` set
// (its sum of squares added in the order torch's CPU sum kernel adds a row), else it differs
// only in the order of that sum (vectorized here, another tree in torch).
//
// rms_norm: x (T, H) with H contiguous, w (H,), fp32 or bf16 (both the same dtype).
//   fp32 (HF's order): out = w * (x * (1 / sqrt(sum(x^2) / H + eps)))
//   bf16: the sum in fp32, then out = bf16(bf16(x * r) * w)
//   lanes (fp32 only): 0, this file's own order of the sum; 4, 8 or 16, torch's for its
//   Vectorized<float> of that many lanes (norm_rope.py finds the one that matches torch).
// rope_qk: qkv (T, W) with W contiguous, its first n_heads * D columns the q and k heads;
//   cos, sin (T, D) (sin with its first half negated, see model/rope.py); out (T, n_heads, D)
//   contiguous: out[t, h, e] = x[e] * cos[t, e] + x[(e + D / 2) % D] * sin[t, e].
// rope_store: a decode layer's RoPE and K/V store in one call (per layer the separate ops
//   and their Python glue cost more than the arithmetic: 30 layers, one token). qkv (T, W)
//   with W contiguous: q_heads q heads, then Hkv k heads, then Hkv v heads, D wide each,
//   Hkv = k_cache.size(1), D = cos.size(1); k_cache, v_cache (S, Hkv, D), each slot's
//   (Hkv, D) contiguous, qkv's dtype; slots (T,) int64. The q and k heads are rotated in
//   place (as rope_qk computes them), then k_cache[slots[t]] = the rotated k heads and
//   v_cache[slots[t]] = the v heads, bit for bit. Returns the rotated q heads: a (T, q_heads, D)
//   view of qkv (made here: a slice and a view from Python cost more than this op's work).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../../attention/csrc/bf16_access.h"

namespace {

using radixserve_bf16::bf16_t;  // fp32 / bf16 element access: ld, st
using radixserve_bf16::ld;
using radixserve_bf16::st;

// The value rounded to T and back: what a torch op producing a T tensor hands the next op.
inline float rnd(float v, const float*) { return v; }
inline float rnd(float v, const bf16_t*) {
  bf16_t b;
  st(&b, 0, v);
  return ld(&b, 0);
}

// run(float{}) or run(bf16_t{}) by the tensors' dtype; others are an error.
template <typename F>
void with_dtype(at::ScalarType t, const F& run) {
  if (t == at::kFloat) {
    run(float{});
  } else {
    TORCH_CHECK(t == at::kBFloat16, "float32 or bfloat16 only");
    run(bf16_t{});
  }
}

constexpr int64_t GRAIN = 16;  // rows per parallel task: a few KB each, enough to amortize

// torch's utils::CeilLog2: ceil(log2(x)), and 1 for x <= 2
inline int64_t ceil_log2(int64_t x) {
  return x <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// The sum of squares of a contiguous fp32 row of h, added in the order of torch's CPU sum
// over a contiguous last dimension (ATen's cascade_sum -> vectorized_inner_sum) for its
// Vectorized<float> of L lanes, so that `x.pow(2).mean(-1)` is matched bit for bit: the row as
// whole vectors, read in groups of 4 into 4 running vector sums (ILP), each step of
// 2^power groups cascaded into 3 higher levels (a pairwise-like tree that keeps the
// magnitudes added alike); then the levels, the vectors past the last whole group (into the
// first sum), the other 3 sums into the first; then the scalar tail's squares in order and
// the L lanes one by one. Every add is lane-wise or scalar, so the compiler's vectorizing of
// the lane loops changes no result.
template <int L>
float sum_squares_torch_order(const float* x, int64_t h) {
  constexpr int kRows = 4, kLevels = 4;
  const int64_t vecs = h / L, groups = vecs / kRows;
  float acc[kLevels][kRows][L] = {};
  auto add_group = [x](float (&a)[kRows][L], int64_t g) {
    const float* p = x + g * kRows * L;
    for (int r = 0; r < kRows; ++r)
      for (int l = 0; l < L; ++l) a[r][l] += p[r * L + l] * p[r * L + l];
  };
  const int64_t power = std::max<int64_t>(4, ceil_log2(groups) / kLevels);
  const int64_t step = int64_t{1} << power, mask = step - 1;
  int64_t g = 0;
  while (g + step <= groups) {
    for (int64_t j = 0; j < step; ++j, ++g) add_group(acc[0], g);
    for (int j = 1; j < kLevels; ++j) {
      for (int r = 0; r < kRows; ++r)
        for (int l = 0; l < L; ++l) {
          acc[j][r][l] += acc[j - 1][r][l];
          acc[j - 1][r][l] = 0.f;
        }
      if ((g & (mask << (j * power))) != 0) break;
    }
  }
  for (; g < groups; ++g) add_group(acc[0], g);
  for (int j = 1; j < kLevels; ++j)
    for (int r = 0; r < kRows; ++r)
      for (int l = 0; l < L; ++l) acc[0][r][l] += acc[j][r][l];
  for (int64_t v = groups * kRows; v < vecs; ++v)
    for (int l = 0; l < L; ++l) acc[0][0][l] += x[v * L + l] * x[v * L + l];
  for (int r = 1; r < kRows; ++r)
    for (int l = 0; l < L; ++l) acc[0][0][l] += acc[0][r][l];
  float s = 0.f;
  for (int64_t e = vecs * L; e < h; ++e) s += x[e] * x[e];
  for (int l = 0; l < L; ++l) s += acc[0][0][l];
  return s;
}

// The row's sum of squares: in torch's order for `lanes` lanes (fp32), or vectorized here (0).
template <typename T>
float sum_squares(const T* xr, int64_t h, int64_t lanes) {
  if constexpr (std::is_same_v<T, float>) {
    if (lanes == 16) return sum_squares_torch_order<16>(xr, h);
    if (lanes == 8) return sum_squares_torch_order<8>(xr, h);
    if (lanes == 4) return sum_squares_torch_order<4>(xr, h);
  }
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t e = 0; e < h; ++e) {
    const float v = ld(xr, e);
    ss += v * v;
  }
  return ss;
}

template <typename T>
void rms_rows(const T* x, int64_t sx, const T* w, T* out, int64_t rows_begin, int64_t rows_end,
              int64_t h, float eps, int64_t lanes) {
  for (int64_t t = rows_begin; t < rows_end; ++t) {
    const T* xr = x + t * sx;
    T* o = out + t * h;
    const float ss = sum_squares<T>(xr, h, lanes);
    const float r = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
    // x * r is rounded (to T) before the weight's product, as in the torch code
#pragma omp simd
    for (int64_t e = 0; e < h; ++e) st(o, e, ld(w, e) * rnd(ld(xr, e) * r, xr));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, int64_t lanes) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0), "x (T, H), w (H,)");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and w must share a dtype");
  TORCH_CHECK(x.stride(1) == 1, "x's rows must be contiguous");
  TORCH_CHECK(lanes == 0 || ((lanes == 4 || lanes == 8 || lanes == 16) &&
                             x.scalar_type() == at::kFloat),
              "lanes: 0, or 4, 8 or 16 for float32");
  const at::Tensor wc = w.contiguous();
  const int64_t n = x.size(0), h = x.size(1);
  at::Tensor out = at::empty({n, h}, x.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.data_ptr());
    const T* wp = static_cast<const T*>(wc.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    at::parallel_for(0, n, GRAIN, [&](int64_t b, int64_t e) {
      rms_rows<T>(xp, x.stride(0), wp, op, b, e, h, static_cast<float>(eps), lanes);
    });
  };
  with_dtype(x.scalar_type(), run);
  return out;
}

template <typename T>
void rope_rows(const T* x, int64_t sx, const T* cos, const T* sin, int64_t sc, int64_t ss,
               T* out, int64_t rows_begin, int64_t rows_end, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t t = rows_begin; t < rows_end; ++t) {
    const T* c = cos + t * sc;
    const T* s = sin + t * ss;
    for (int64_t hh = 0; hh < heads; ++hh) {
      const T* xr = x + t * sx + hh * d;
      T* o = out + (t * heads + hh) * d;
      // The two halves: the partner of e is e + half, then e - half (torch.roll by half).
#pragma omp simd
      for (int64_t e = 0; e < half; ++e)
        st(o, e, rnd(ld(xr, e) * ld(c, e), xr) + rnd(ld(xr, e + half) * ld(s, e), xr));
#pragma omp simd
      for (int64_t e = half; e < d; ++e)
        st(o, e, rnd(ld(xr, e) * ld(c, e), xr) + rnd(ld(xr, e - half) * ld(s, e), xr));
    }
  }
}

at::Tensor rope_qk(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                   int64_t heads) {
  TORCH_CHECK(qkv.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(qkv.dim() == 2 && cos.dim() == 2 && sin.dim() == 2, "qkv (T, W), cos/sin (T, D)");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "qkv, cos and sin must share a dtype");
  const int64_t n = qkv.size(0), d = cos.size(1);
  TORCH_CHECK(d % 2 == 0 && sin.size(1) == d && cos.size(0) == n && sin.size(0) == n,
              "cos/sin: (T, D), D even");
  TORCH_CHECK(heads >= 1 && heads * d <= qkv.size(1), "qkv too narrow for the heads");
  TORCH_CHECK(qkv.stride(1) == 1 && cos.stride(1) == 1 && sin.stride(1) == 1,
              "rows must be contiguous");
  at::Tensor out = at::empty({n, heads, d}, qkv.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(qkv.data_ptr());
    const T* cp = static_cast<const T*>(cos.data_ptr());
    const T* sp = static_cast<const T*>(sin.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    at::parallel_for(0, n, GRAIN, [&](int64_t b, int64_t e) {
      rope_rows<T>(xp, qkv.stride(0), cp, sp, cos.stride(0), sin.stride(0), op, b, e, heads, d);
    });
  };
  with_dtype(qkv.scalar_type(), run);
  return out;
}

// Rotates n_heads heads of row x (D wide each, contiguous) in place, as rope_rows: each head
// read into `tmp` first (an element's partner is overwritten before it is read otherwise).
template <typename T>
void rope_heads_inplace(T* x, const T* c, const T* s, int64_t n_heads, int64_t d, T* tmp) {
  const int64_t half = d / 2;
  for (int64_t hh = 0; hh < n_heads; ++hh) {
    T* xr = x + hh * d;
    std::copy(xr, xr + d, tmp);
#pragma omp simd
    for (int64_t e = 0; e < half; ++e)
      st(xr, e, rnd(ld(tmp, e) * ld(c, e), xr) + rnd(ld(tmp, e + half) * ld(s, e), xr));
#pragma omp simd
    for (int64_t e = half; e < d; ++e)
      st(xr, e, rnd(ld(tmp, e) * ld(c, e), xr) + rnd(ld(tmp, e - half) * ld(s, e), xr));
  }
}

constexpr int64_t kMaxHeadDim = 512;  // rope_store's per-head scratch, on the stack

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      int64_t q_heads, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& slots) {
  TORCH_CHECK(qkv.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu() &&
                  k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  slots.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(qkv.dim() == 2 && cos.dim() == 2 && sin.dim() == 2 && k_cache.dim() == 3 &&
                  v_cache.dim() == 3 && slots.dim() == 1,
              "qkv (T, W), cos/sin (T, D), k_cache/v_cache (S, Hkv, D), slots (T,)");
  const auto dt = qkv.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dt && sin.scalar_type() == dt &&
                  k_cache.scalar_type() == dt && v_cache.scalar_type() == dt,
              "qkv, cos, sin, k_cache and v_cache must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong, "slots: int64");
  const int64_t n = qkv.size(0), d = cos.size(1), hkv = k_cache.size(1), ns = k_cache.size(0);
  TORCH_CHECK(d % 2 == 0 && d <= kMaxHeadDim && sin.size(1) == d && cos.size(0) == n &&
                  sin.size(0) == n, "cos/sin: (T, D), D even, at most 512");
  TORCH_CHECK(k_cache.size(2) == d && v_cache.size(1) == hkv && v_cache.size(2) == d &&
                  v_cache.size(0) == ns, "k_cache, v_cache: (S, Hkv, D) alike");
  TORCH_CHECK(k_cache.stride(2) == 1 && k_cache.stride(1) == d && v_cache.stride(2) == 1 &&
                  v_cache.stride(1) == d, "k_cache / v_cache rows must be (Hkv, D) contiguous");
  TORCH_CHECK(q_heads >= 1 && (q_heads + 2 * hkv) * d <= qkv.size(1),
              "qkv too narrow for the q, k and v heads");
  TORCH_CHECK(slots.size(0) == n, "slots: one per row of qkv");
  TORCH_CHECK(qkv.stride(1) == 1 && cos.stride(1) == 1 && sin.stride(1) == 1,
              "rows must be contiguous");
  const at::Tensor sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(0 <= sp[t] && sp[t] < ns, "slot out of range");
  auto run = [&](auto tag) {
    using T = decltype(tag);
    T* xp = static_cast<T*>(qkv.data_ptr());
    const T* cp = static_cast<const T*>(cos.data_ptr());
    const T* snp = static_cast<const T*>(sin.data_ptr());
    T* kp = static_cast<T*>(k_cache.data_ptr());
    T* vp = static_cast<T*>(v_cache.data_ptr());
    const int64_t sx = qkv.stride(0), sc = cos.stride(0), ss = sin.stride(0);
    const int64_t sk = k_cache.stride(0), sv = v_cache.stride(0), kv = hkv * d;
    at::parallel_for(0, n, GRAIN, [&](int64_t b, int64_t e) {
      T tmp[kMaxHeadDim];
      for (int64_t t = b; t < e; ++t) {
        T* row = xp + t * sx;
        rope_heads_inplace<T>(row, cp + t * sc, snp + t * ss, q_heads + hkv, d, tmp);
        const T* k = row + q_heads * d;
        std::copy(k, k + kv, kp + sp[t] * sk);
        std::copy(k + kv, k + 2 * kv, vp + sp[t] * sv);
      }
    });
  };
  with_dtype(dt, run);
  return qkv.narrow(1, 0, q_heads * d).view({n, q_heads, d});
}

}  // namespace

// Each tier's build names its own op namespace (radixserve_<tier>: platform/kernels.py), so
// several tiers load side by side in one process.
#ifndef RADIXSERVE_OPS_NS
#define RADIXSERVE_OPS_NS radixserve
#endif
TORCH_LIBRARY_FRAGMENT(RADIXSERVE_OPS_NS, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, int lanes=0) -> Tensor");
  m.def("rope_qk(Tensor qkv, Tensor cos, Tensor sin, int heads) -> Tensor");
  m.def(
      "rope_store(Tensor(a!) qkv, Tensor cos, Tensor sin, int q_heads, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slots) -> Tensor(a)");
}

TORCH_LIBRARY_IMPL(RADIXSERVE_OPS_NS, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_qk", &rope_qk);
  m.impl("rope_store", &rope_store);
}
