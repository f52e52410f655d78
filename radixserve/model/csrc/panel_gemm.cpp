// The panel GEMM for CPU linears, decode and prefill alike: y (M, N) = x (M, K) @ W.T (+ bias)
// (+ residual), or the gated form silu(x @ G.T) * (x @ U.T), with W in the panel layout of
// panel_gemm.h (packed once at load: radixserve/model/panel_kernel.py). Work is split into
// tasks of (a chunk of rows of x that fits L2, one output panel), chunk-major: a decode step
// (one chunk) gives each thread a contiguous range of panels, so each thread streams its part
// of the weight front to back once; a prefill thread keeps its chunk of x in L2 while the
// panels pass. Each tile's fp32 sums go through the epilogue (bias, residual, silu * up, one
// rounding to x's dtype) before they are stored: the output is written once.
//
// Numerics: fp32 accumulation in the order panel_gemm.h describes, the same for every M;
// x float32 or bfloat16 (widened to fp32, or kept in bf16 for vdpbf16ps with bf16 weights on
// the avx512_bf16 / amx builds), bias fp32, residual and y in x's dtype, y rounded once
// (bf16: to nearest even).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../../attention/csrc/bf16_access.h"
#include "panel_gemm.h"

namespace {

using radixserve_bf16::ld;
using radixserve_bf16::st;
using radixserve_panel::bf16_t;
using radixserve_panel::kR;
using radixserve_panel::Vec;

constexpr int64_t kTaskBytes = 64 * 1024;    // weight bytes per thread's share at least
constexpr int64_t kChunkBytes = 256 * 1024;  // bytes of x per task (L2-resident)

// One call's operands as raw pointers (weights of type Wt; residual and y of type Xt).
template <typename Wt, typename Xt>
struct Call {
  const float* xf;     // (M, ldx) fp32, zero padded past K; nullptr on the vdpbf16ps path
  const bf16_t* xb;    // (M, ldx) bf16, zero padded past K: the vdpbf16ps path, else nullptr
  int64_t M, K, ldx;   // K: the panel's rows (fp32) or input pairs (bf16)
  int64_t N, panels;   // output channels; output panels (gated: each a gate and an up panel)
  const Wt* w;         // the panels, each panel_elems long
  int64_t panel_elems;
  bool gated;
  const float* bias;   // nullptr or (N,)
  const Xt* res;       // nullptr or (M, N)
  Xt* y;               // (M, N)
};

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// out (mr, kR) = rows m0 .. m0 + mr of x against one panel.
template <typename Wt, typename Xt>
void tile(const Call<Wt, Xt>& c, const Wt* panel, int64_t m0, int mr, float* out) {
  radixserve_panel::with_rows(mr, [&](auto rows) {
    constexpr int MR = decltype(rows)::value;
    if constexpr (std::is_same_v<Wt, float>) {
      radixserve_panel::tile_f32<MR>(panel, c.K, c.xf + m0 * c.ldx, c.ldx, out);
    } else {
#if RS_PANEL_DPBF16
      if (c.xb != nullptr) {
        radixserve_panel::tile_dp<MR>(panel, c.K, c.xb + m0 * c.ldx, c.ldx, out);
        return;
      }
#endif
      radixserve_panel::tile_bf16<MR>(panel, c.K, c.xf + m0 * c.ldx, c.ldx, out);
    }
  });
}

// Row m of a tile: its sums a (fp32; u, the up projection's where gated) of channels n0 ..
// n0 + nr to y. One branch-free loop per operand, so that each vectorizes.
template <typename Wt, typename Xt>
inline void epilogue(const Call<Wt, Xt>& c, float* a, const float* u, int64_t m, int64_t n0,
                     int64_t nr) {
  const int64_t at = m * c.N + n0;
  if (c.gated) {
#if RS_PANEL_AVX512 || RS_PANEL_AVX2
    for (int r = 0; r < kR; r += Vec::L)  // a and u hold kR sums (the lanes past nr unused)
      Vec::store(a + r, Vec::mul(radixserve_panel::silu(Vec::load(a + r)), Vec::load(u + r)));
#else
    for (int64_t r = 0; r < nr; ++r) a[r] = silu(a[r]) * u[r];
#endif
  } else {
    if (c.bias != nullptr) {
      const float* b = c.bias + n0;
      for (int64_t r = 0; r < nr; ++r) a[r] += b[r];
    }
    if (c.res != nullptr)
      for (int64_t r = 0; r < nr; ++r) a[r] += ld(c.res, at + r);
  }
  for (int64_t r = 0; r < nr; ++r) st(c.y, at + r, a[r]);
}

// Output panel p, rows [m0, m1): tiles of at most kMR rows, each through the epilogue.
template <typename Wt, typename Xt>
void task(const Call<Wt, Xt>& c, int64_t p, int64_t m0, int64_t m1) {
  alignas(64) float acc[Vec::kMR * kR], up[Vec::kMR * kR];
  const int64_t step = c.gated ? 2 : 1;
  const Wt* panel = c.w + p * step * c.panel_elems;
  const int64_t n0 = p * kR, nr = std::min<int64_t>(kR, c.N - n0);
  for (int64_t t = m0; t < m1; t += Vec::kMR) {
    const int mr = static_cast<int>(std::min<int64_t>(Vec::kMR, m1 - t));
    tile(c, panel, t, mr, acc);
    if (c.gated) tile(c, panel + c.panel_elems, t, mr, up);
    for (int m = 0; m < mr; ++m) epilogue(c, acc + m * kR, up + m * kR, t + m, n0, nr);
  }
}

template <typename Wt, typename Xt>
void run(const Call<Wt, Xt>& c) {
  // Rows of x per task: a chunk of kChunkBytes stays in L2 while the task's panels stream by.
  const int64_t x_row = c.ldx * static_cast<int64_t>(c.xb != nullptr ? sizeof(bf16_t) : 4);
  const int64_t rows = std::max<int64_t>(1, kChunkBytes / x_row / Vec::kMR) * Vec::kMR;
  const int64_t chunks = (c.M + rows - 1) / rows;
  const int64_t panel_bytes = c.panel_elems * static_cast<int64_t>(sizeof(Wt)) * (c.gated ? 2 : 1);
  // A task is (chunk, panel), chunk-major: a thread's range is one chunk (or a few) against
  // consecutive panels, i.e. the weight streamed front to back; a decode step (one chunk)
  // gives each thread a contiguous share of the panels, at least kTaskBytes of them.
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / panel_bytes);
  at::parallel_for(0, chunks * c.panels, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m0 = i / c.panels * rows;
      task(c, i % c.panels, m0, std::min(c.M, m0 + rows));
    }
  });
}

// x (M, K) -> (M, ldx) in T, zero padded past K: fp32 (x widened), or bf16 (a bf16 x as is).
template <typename T>
std::vector<T> padded(const at::Tensor& x, int64_t ldx) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<T> out(M * ldx, T(0));
  const bool f32 = x.scalar_type() == at::kFloat;
  const float* xf = f32 ? x.data_ptr<float>() : nullptr;
  const auto* xb = f32 ? nullptr : reinterpret_cast<const bf16_t*>(x.data_ptr());
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      if constexpr (std::is_same_v<T, float>) out[m * ldx + k] = f32 ? xf[m * K + k] : ld(xb, m * K + k);
      else out[m * ldx + k] = xb[m * K + k];  // the vdpbf16ps path: x is bf16
    }
  }
  return out;
}

template <typename Wt, typename Xt>
void dispatch(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t panels,
              const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& res,
              bool gated, at::Tensor& y) {
  const int64_t K = x.size(1);
  const int64_t depth = w.size(1);  // fp32: K; bf16: ceil(K / 2) pairs
  const int64_t ldx = std::is_same_v<Wt, float> ? K : 2 * depth;
  const bool dp = RS_PANEL_DPBF16 && std::is_same_v<Wt, bf16_t> && std::is_same_v<Xt, bf16_t>;
  const bool as_is = ldx == K && (dp || std::is_same_v<Xt, float>);  // no copy of x needed
  std::vector<float> xf;
  std::vector<bf16_t> xb;
  if (!as_is) {
    if (dp) xb = padded<bf16_t>(x, ldx);
    else xf = padded<float>(x, ldx);
  }
  const auto* xraw = x.data_ptr();
  const Call<Wt, Xt> c{
      dp ? nullptr : (as_is ? static_cast<const float*>(xraw) : xf.data()),
      dp ? (as_is ? static_cast<const bf16_t*>(xraw) : xb.data()) : nullptr,
      x.size(0), depth, ldx, n, panels, reinterpret_cast<const Wt*>(w.data_ptr()),
      w.numel() / w.size(0), gated, bias ? bias->data_ptr<float>() : nullptr,
      res ? reinterpret_cast<const Xt*>(res->data_ptr()) : nullptr,
      reinterpret_cast<Xt*>(y.data_ptr())};
  run(c);
}

void check(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t panels,
           const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& res,
           bool gated) {
  const auto wt = w.scalar_type(), xt = x.scalar_type();
  TORCH_CHECK(x.dim() == 2, "x: (M, K)");
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16, "x: float32 or bfloat16");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  const int64_t K = x.size(1);
  const bool f32_ok = wt == at::kFloat && w.dim() == 3 && w.size(1) == K && w.size(2) == kR;
  const bool bf16_ok = wt == at::kBFloat16 && w.dim() == 4 && w.size(1) == (K + 1) / 2 &&
                       w.size(2) == kR && w.size(3) == 2;
  TORCH_CHECK(f32_ok || bf16_ok, "w: float32 (panels, K, ", kR,
              ") or bfloat16 (panels, ceil(K / 2), ", kR, ", 2)");
  TORCH_CHECK(w.size(0) == panels * (gated ? 2 : 1) && n > (panels - 1) * kR && n <= panels * kR,
              "w's panels do not cover n output channels");
  TORCH_CHECK(!gated || (!bias && !res), "the gated form takes no bias or residual");
  if (bias)
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias: (n,) float32");
  if (res)
    TORCH_CHECK(res->dim() == 2 && res->size(0) == x.size(0) && res->size(1) == n &&
                    res->scalar_type() == xt && res->is_contiguous(),
                "residual: (M, n) contiguous in x's dtype");
}

at::Tensor panel_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t n,
                        const c10::optional<at::Tensor>& bias,
                        const c10::optional<at::Tensor>& residual, bool gated) {
  const int64_t panels = w.dim() > 0 ? w.size(0) / (gated ? 2 : 1) : 0;
  check(x_in, w, n, panels, bias, residual, gated);
  at::Tensor y = at::empty({x_in.size(0), n}, x_in.options());
  if (y.numel() == 0) return y;
  const at::Tensor x = x_in.contiguous();
  const bool wf = w.scalar_type() == at::kFloat, xf = x.scalar_type() == at::kFloat;
  if (wf && xf) dispatch<float, float>(x, w, n, panels, bias, residual, gated, y);
  else if (wf) dispatch<float, bf16_t>(x, w, n, panels, bias, residual, gated, y);
  else if (xf) dispatch<bf16_t, float>(x, w, n, panels, bias, residual, gated, y);
  else dispatch<bf16_t, bf16_t>(x, w, n, panels, bias, residual, gated, y);
  return y;
}

int64_t panel_width() { return kR; }

}  // namespace

// A fragment in the tier's namespace (platform/kernels.py defines RADIXSERVE_OPS_NS per build).
#ifndef RADIXSERVE_OPS_NS
#define RADIXSERVE_OPS_NS radixserve
#endif
TORCH_LIBRARY_FRAGMENT(RADIXSERVE_OPS_NS, m) {
  m.def("panel_linear(Tensor x, Tensor w, int n, Tensor? bias, Tensor? residual, bool gated) "
        "-> Tensor");
  m.def("panel_width() -> int", &panel_width);  // no tensors: one kernel for every backend
}

TORCH_LIBRARY_IMPL(RADIXSERVE_OPS_NS, CPU, m) { m.impl("panel_linear", &panel_linear); }
