// The skinny GEMM for decode steps on CPU: y (M, N) = x (M, K) @ W.T (+ bias) (+ residual), or
// the gated form silu(x @ W.T) * (x @ U.T), for a few rows of x (M up to
// radixserve/model/skinny_kernel.py's bound; any M is computed, just not fast). A decode step
// reads every weight once, so the kernel's job is to stream W at the memory's bandwidth: the
// threads split the output channels into contiguous ranges, each thread reads its part of W
// row after row, front to back, each row once for every row of x (skinny_gemm.h), and the
// epilogue (bias, residual, silu * up, the rounding to x's dtype) runs on the fp32 sums before
// they are stored: the output is written once.
//
// Numerics: fp32 accumulation; x float32 or bfloat16 (widened to fp32, or kept in bf16 for
// vdpbf16ps with bf16 weights on the avx512_bf16 / amx builds), W float32 or bfloat16,
// bias in W's dtype, residual and y in x's dtype; y[m, n] rounded once from fp32 (bf16: to
// nearest even). Every y[m, n] is computed the same way whatever M is (skinny_gemm.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../../attention/csrc/bf16_access.h"
#include "skinny_gemm.h"

namespace {

using radixserve_bf16::ld;
using radixserve_bf16::st;
using radixserve_skinny::bf16_t;
using radixserve_skinny::dot_rows;

constexpr int64_t kTaskBytes = 64 * 1024;  // weight bytes per parallel task at least

// One call's operands, as raw pointers (W and U of type Wt; x, residual and y of type Xt).
template <typename Wt, typename Xt>
struct Call {
  const float* x;  // (M, ldx) fp32, zero padded past K (nullptr on the vdpbf16ps path)
  const bf16_t* xb;  // (M, ldx) bf16, zero padded: the vdpbf16ps path, else nullptr
  int64_t M, K, ldx, N;  // N: output columns
  const Wt* w;
  const Wt* up;    // nullptr unless gated
  const Wt* bias;  // nullptr or (N,)
  const Xt* res;   // nullptr or (M, N)
  Xt* y;           // (M, N)
};

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// Output columns [n0, n1): their weight rows (then up's: each a stream front to back) against
// every row of x into acc / uacc ((n1 - n0, M)), then the epilogue.
template <typename Wt, typename Xt>
void dots(const Call<Wt, Xt>& c, const Wt* w, int64_t n0, int64_t n1, float* acc) {
#if RS_SKINNY_DPBF16
  if constexpr (std::is_same_v<Wt, bf16_t>) {
    if (c.xb != nullptr) {
      for (int64_t n = n0; n < n1; ++n)
        radixserve_skinny::dot_rows_dp(w + n * c.K, c.K, c.xb, c.ldx, c.M, acc + (n - n0) * c.M);
      return;
    }
  }
#endif
  for (int64_t n = n0; n < n1; ++n)
    dot_rows(w + n * c.K, c.K, c.x, c.ldx, c.M, acc + (n - n0) * c.M);
}

template <typename Wt, typename Xt>
void columns(const Call<Wt, Xt>& c, int64_t n0, int64_t n1, float* acc, float* uacc) {
  dots(c, c.w, n0, n1, acc);
  if (c.up != nullptr) dots(c, c.up, n0, n1, uacc);
  for (int64_t n = n0; n < n1; ++n) {
    const float b = c.bias == nullptr ? 0.f : ld(c.bias, n);
    for (int64_t m = 0; m < c.M; ++m) {
      const int64_t at = m * c.N + n;
      float v = acc[(n - n0) * c.M + m];
      if (c.up != nullptr) {
        v = silu(v) * uacc[(n - n0) * c.M + m];
      } else {
        v += b;
        if (c.res != nullptr) v += ld(c.res, at);
      }
      st(c.y, at, v);
    }
  }
}

template <typename Wt, typename Xt>
void run(const Call<Wt, Xt>& c) {
  const int64_t row_bytes = c.K * static_cast<int64_t>(sizeof(Wt)) * (c.up ? 2 : 1);
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, row_bytes));
  at::parallel_for(0, c.N, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> acc((c.up ? 2 : 1) * (n1 - n0) * c.M);
    columns(c, n0, n1, acc.data(), acc.data() + (n1 - n0) * c.M);
  });
}

// x (M, K) -> (M, ldx) fp32, zero padded, input k at x_slot(k) (bf16 weights: permuted).
std::vector<float> widen_x(const at::Tensor& x, int64_t ldx, bool bf16_weights) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<float> xp(M * ldx, 0.f);
  const bool f32 = x.scalar_type() == at::kFloat;
  const float* xf = f32 ? x.data_ptr<float>() : nullptr;
  const auto* xb = f32 ? nullptr : reinterpret_cast<const bf16_t*>(x.data_ptr());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k)
      xp[m * ldx + radixserve_skinny::x_slot(k, bf16_weights)] =
          f32 ? xf[m * K + k] : ld(xb, m * K + k);
  return xp;
}

// x (M, K) bf16 -> (M, ldx) bf16, zero padded (the vdpbf16ps path's operand, natural order).
std::vector<bf16_t> pad_bf16(const at::Tensor& x, int64_t ldx) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<bf16_t> xp(M * ldx, 0);
  const auto* src = reinterpret_cast<const bf16_t*>(x.data_ptr());
  for (int64_t m = 0; m < M; ++m) std::copy(src + m * K, src + (m + 1) * K, xp.data() + m * ldx);
  return xp;
}

template <typename Wt, typename Xt>
void dispatch(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
              const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& up,
              int64_t ldx, at::Tensor& y) {
  const bool dp = RS_SKINNY_DPBF16 && std::is_same_v<Wt, bf16_t> && std::is_same_v<Xt, bf16_t>;
  const std::vector<float> xf = dp ? std::vector<float>() : widen_x(x, ldx, sizeof(Wt) == 2);
  const std::vector<bf16_t> xb = dp ? pad_bf16(x, ldx) : std::vector<bf16_t>();
  const auto wp = [](const at::Tensor& t) { return reinterpret_cast<const Wt*>(t.data_ptr()); };
  const Call<Wt, Xt> c{dp ? nullptr : xf.data(), dp ? xb.data() : nullptr, x.size(0), w.size(1),
                       ldx, y.size(1), wp(w), up ? wp(*up) : nullptr,
                       bias ? wp(*bias) : nullptr,
                       residual ? reinterpret_cast<const Xt*>(residual->data_ptr()) : nullptr,
                       reinterpret_cast<Xt*>(y.data_ptr())};
  run(c);
}

at::Tensor skinny_linear(const at::Tensor& x_in, const at::Tensor& w,
                         const c10::optional<at::Tensor>& bias,
                         const c10::optional<at::Tensor>& residual,
                         const c10::optional<at::Tensor>& up) {
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1),
              "x (M, K) and w (N, K)");
  const auto wt = w.scalar_type(), xt = x_in.scalar_type();
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16, "w: float32 or bfloat16");
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16, "x: float32 or bfloat16");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  const int64_t M = x_in.size(0), K = w.size(1), N = w.size(0);
  if (up) {
    TORCH_CHECK(up->sizes() == w.sizes() && up->scalar_type() == wt && up->is_contiguous(),
                "up must be shaped as w, same dtype, contiguous");
    TORCH_CHECK(!bias && !residual, "the gated form takes no bias or residual");
  }
  if (bias)
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == wt && bias->is_contiguous(),
                "bias: (N,) in w's dtype");
  if (residual)
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == M && residual->size(1) == N &&
                residual->scalar_type() == xt && residual->is_contiguous(),
                "residual: (M, N) contiguous in x's dtype");
  at::Tensor y = at::empty({M, N}, x_in.options());
  if (M == 0 || N == 0) return y;
  const at::Tensor x = x_in.contiguous();
  const int64_t ldx = (K + radixserve_skinny::kXPad - 1) / radixserve_skinny::kXPad *
                      radixserve_skinny::kXPad;
  const bool wf = wt == at::kFloat, xf = xt == at::kFloat;
  if (wf && xf) dispatch<float, float>(x, w, bias, residual, up, ldx, y);
  else if (wf) dispatch<float, bf16_t>(x, w, bias, residual, up, ldx, y);
  else if (xf) dispatch<bf16_t, float>(x, w, bias, residual, up, ldx, y);
  else dispatch<bf16_t, bf16_t>(x, w, bias, residual, up, ldx, y);
  return y;
}

}  // namespace

// A fragment in the tier's namespace (platform/kernels.py defines RADIXSERVE_OPS_NS per build).
#ifndef RADIXSERVE_OPS_NS
#define RADIXSERVE_OPS_NS radixserve
#endif
TORCH_LIBRARY_FRAGMENT(RADIXSERVE_OPS_NS, m) {
  m.def("skinny_linear(Tensor x, Tensor w, Tensor? bias, Tensor? residual, Tensor? up) -> "
        "Tensor");
}

TORCH_LIBRARY_IMPL(RADIXSERVE_OPS_NS, CPU, m) { m.impl("skinny_linear", &skinny_linear); }
