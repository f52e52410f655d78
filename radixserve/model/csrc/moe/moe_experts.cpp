// A mixture-of-experts layer's experts on CPU in one call, for any number of rows per expert:
//   out[t] = sum over t's top-k experts e in [first, first + E) of
//            w[t, e] * down_e(silu(gate_e(x[t])) * up_e(x[t]))
// summed in ascending expert order (HF's order). x (T, D) float32 or bfloat16; the weights
// stacked as the loader keeps them: gate_up (E, 2F, D) (gate rows, then up rows), down
// (E, D, F), in x's dtype, or int8 codes with one fp32 scale per (expert, output channel)
// (--quantization int8); out (T, D) in x's dtype; fp32 accumulation throughout.
//
// Registered as torch.ops.radixserve_<tier>.moe_experts; radixserve/model/moe_kernel.py loads
// it; layers/moe.py's torch path is its specification. Why native: a decode step at batch 16
// with top-4 reaches most experts with ~2 rows each, so the layer is a stream of every active
// expert's weights; one oneDNN GEMM pair per expert plus the Python loop, the sort and the
// scatter left it at about half the bandwidth. Here the pairs are grouped by a counting sort
// (no host read of the counts: the op takes the routing as tensors), and two parallel sweeps
// stream each active expert's weight rows once for all its rows: threads own disjoint
// (expert, channel block) tasks, so two cores read disjoint weight bytes.
//
//   1. gate/up: per task (expert, 32 intermediate channels): g, u for all the expert's rows,
//      h = silu(g) * u (rounded to bf16 as HF rounds each op when x is bf16) into h (P, F).
//   2. down: per task (expert, 64 hidden channels): y (P, D) fp32 = w_pair * (h @ down_e.T).
//   3. per token: the sum of its pairs' rows in ascending expert order, in x's dtype.
//
// The GEMMs (moe_tiles.h, moe_rows.h) are dot products along the weight rows (the stacked
// layout, no repacking): at up to 8 rows per expert (decode) each weight row streamed alone
// for all the rows (one sequential read per thread), above that a micro tile of 4 output
// channels x up to 4 rows, each weight vector loaded once per row tile. bf16 weights are widened by a
// shift; on AVX512-BF16 a bf16 layer multiplies bf16 pairs with vdpbf16ps (x and h kept in
// bf16: the products are exact).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "moe_grouping.h"
#include "moe_rows.h"

namespace {

using radixserve_bf16::bf16_t;
using radixserve_moe::combine;
using radixserve_moe::gemm_any;
using radixserve_moe::group_pairs;
using radixserve_moe::Grouping;
using radixserve_moe::silu_mul;

constexpr int64_t GU_BLOCK = 32;   // intermediate channels per gate/up task
constexpr int64_t DOWN_BLOCK = 64; // hidden channels per down task
constexpr int64_t ROW_CHUNK = 64;  // rows per pass over a task's weight block (L2-resident)

// h (P, F) = silu(x_rows @ gate_e.T) * (x_rows @ up_e.T) per expert e over its sorted pairs.
template <typename XT, typename WT>
void gate_up_phase(const XT* x, const Grouping& g, const WT* gate_up, const float* scale,
                   int64_t F, int64_t D, bool round, XT* h) {
  const int64_t nb = (F + GU_BLOCK - 1) / GU_BLOCK;
  const int64_t tasks = static_cast<int64_t>(g.active.size()) * nb;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    const XT* rows[ROW_CHUNK];
    float gb[ROW_CHUNK * GU_BLOCK], ub[ROW_CHUNK * GU_BLOCK];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = g.active[t / nb], c0 = (t % nb) * GU_BLOCK;
      const int64_t nch = std::min(GU_BLOCK, F - c0);
      const WT* gw = gate_up + (e * 2 * F + c0) * D;
      const WT* uw = gate_up + (e * 2 * F + F + c0) * D;
      const float* gs = scale == nullptr ? nullptr : scale + e * 2 * F + c0;
      const float* us = scale == nullptr ? nullptr : scale + e * 2 * F + F + c0;
      for (int64_t r0 = g.offsets[e]; r0 < g.offsets[e + 1]; r0 += ROW_CHUNK) {
        const int64_t n = std::min(ROW_CHUNK, g.offsets[e + 1] - r0);
        for (int64_t i = 0; i < n; ++i) rows[i] = x + g.token[r0 + i] * D;
        gemm_any(rows, n, gw, gs, nch, D, gb, GU_BLOCK);
        gemm_any(rows, n, uw, us, nch, D, ub, GU_BLOCK);
        for (int64_t i = 0; i < n; ++i)
          silu_mul(gb + i * GU_BLOCK, ub + i * GU_BLOCK, nch, round, h + (r0 + i) * F + c0);
      }
    }
  });
}

// y (P, D) fp32 = weight_p * (h_p @ down_e.T) per expert e over its sorted pairs.
template <typename HT, typename WT>
void down_phase(const HT* h, const Grouping& g, const WT* down, const float* scale, int64_t F,
                int64_t D, float* y) {
  const int64_t nb = (D + DOWN_BLOCK - 1) / DOWN_BLOCK;
  const int64_t tasks = static_cast<int64_t>(g.active.size()) * nb;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    const HT* rows[ROW_CHUNK];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = g.active[t / nb], c0 = (t % nb) * DOWN_BLOCK;
      const int64_t nch = std::min(DOWN_BLOCK, D - c0);
      const WT* dw = down + (e * D + c0) * F;
      const float* ds = scale == nullptr ? nullptr : scale + e * D + c0;
      for (int64_t r0 = g.offsets[e]; r0 < g.offsets[e + 1]; r0 += ROW_CHUNK) {
        const int64_t n = std::min(ROW_CHUNK, g.offsets[e + 1] - r0);
        for (int64_t i = 0; i < n; ++i) rows[i] = h + (r0 + i) * F;
        gemm_any(rows, n, dw, ds, nch, F, y + r0 * D + c0, D);
        for (int64_t i = 0; i < n; ++i) {
          float* yr = y + (r0 + i) * D + c0;
          const float w = g.weight[r0 + i];
#pragma omp simd
          for (int64_t j = 0; j < nch; ++j) yr[j] *= w;
        }
      }
    }
  });
}

// The stacked expert weights as the op got them: float or bf16 in x's dtype, or int8 codes
// with one fp32 scale per (expert, output channel).
struct Experts {
  const void* gate_up;
  const void* down;
  const float* gate_up_scale;  // (E, 2F) or nullptr
  const float* down_scale;     // (E, D) or nullptr
  int64_t F, D;
};

template <typename XT, typename WT>
void run_experts(const XT* x, const Grouping& g, const Experts& w, bool round, XT* h,
                 float* y) {
  gate_up_phase<XT, WT>(x, g, static_cast<const WT*>(w.gate_up), w.gate_up_scale, w.F, w.D,
                        round, h);
  down_phase<XT, WT>(h, g, static_cast<const WT*>(w.down), w.down_scale, w.F, w.D, y);
}

void check_scale(const c10::optional<at::Tensor>& scale, int64_t E, int64_t N,
                 const char* what) {
  TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat &&
              scale->is_contiguous() && scale->dim() == 2 && scale->size(0) == E &&
              scale->size(1) == N, what);
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_weights,
                       const at::Tensor& topk_ids, const at::Tensor& gate_up,
                       const at::Tensor& down, int64_t first_expert,
                       const c10::optional<at::Tensor>& gate_up_scale,
                       const c10::optional<at::Tensor>& down_scale) {
  TORCH_CHECK(x.dim() == 2, "x must be (T, D)");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "x: float32 or bfloat16");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3, "gate_up (E, 2F, D), down (E, D, F)");
  const bool int8 = gate_up.scalar_type() == at::kChar;
  TORCH_CHECK(down.scalar_type() == gate_up.scalar_type() &&
              (int8 || gate_up.scalar_type() == dtype),
              "the expert weights must be in x's dtype (or both int8 with scales)");
  TORCH_CHECK(gate_up.is_contiguous() && down.is_contiguous(), "stacked weights: contiguous");
  const int64_t T = x.size(0), D = x.size(1), E = gate_up.size(0), F = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(2) == D && gate_up.size(1) == 2 * F, "gate_up must be (E, 2F, D)");
  TORCH_CHECK(down.size(0) == E && down.size(1) == D && down.size(2) == F,
              "down must be (E, D, F)");
  if (int8) {
    check_scale(gate_up_scale, E, 2 * F, "int8 gate_up needs gate_up_scale (E, 2F) fp32");
    check_scale(down_scale, E, D, "int8 down needs down_scale (E, D) fp32");
  }
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T &&
              topk_ids.scalar_type() == at::kLong, "topk_ids: (T, k) int64");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "topk_weights: (T, k) as topk_ids");
  const int64_t k = topk_ids.size(1);
  const at::Tensor ids = topk_ids.contiguous();
  const at::Tensor w = topk_weights.to(at::kFloat).contiguous();
  const at::Tensor xc = x.contiguous();
  const Grouping g = group_pairs(ids.data_ptr<int64_t>(), w.data_ptr<float>(), T * k, k,
                                 first_expert, E);
  const int64_t P = g.offsets[E];
  at::Tensor out = at::empty({T, D}, x.options());
  if (P == 0) return out.zero_();
  const Experts experts{gate_up.data_ptr(), down.data_ptr(),
                        int8 ? gate_up_scale->data_ptr<float>() : nullptr,
                        int8 ? down_scale->data_ptr<float>() : nullptr, F, D};
  at::Tensor y = at::empty({P, D}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const bool bf16 = dtype == at::kBFloat16;
#if defined(__AVX512BF16__)
  if (bf16 && !int8) {  // bf16 pairs multiplied by vdpbf16ps: x and h stay bf16
    at::Tensor h = at::empty({P, F}, x.options());
    run_experts<bf16_t, bf16_t>(reinterpret_cast<const bf16_t*>(xc.data_ptr()), g, experts,
                                true, reinterpret_cast<bf16_t*>(h.data_ptr()), yp);
    combine(yp, g, T, k, D, reinterpret_cast<bf16_t*>(out.data_ptr()));
    return out;
  }
#endif
  // fp32 rows for the FMA path: x widened once; h holds a bf16 layer's rounded values in fp32
  const at::Tensor xf = xc.to(at::kFloat);
  at::Tensor h = at::empty({P, F}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  if (int8) run_experts<float, int8_t>(xp, g, experts, bf16, hp, yp);
  else if (bf16) run_experts<float, bf16_t>(xp, g, experts, true, hp, yp);
  else run_experts<float, float>(xp, g, experts, false, hp, yp);
  if (bf16) combine(yp, g, T, k, D, reinterpret_cast<bf16_t*>(out.data_ptr()));
  else combine(yp, g, T, k, D, out.data_ptr<float>());
  return out;
}

}  // namespace

// A fragment in the tier's namespace (platform/kernels.py defines RADIXSERVE_OPS_NS per build).
#ifndef RADIXSERVE_OPS_NS
#define RADIXSERVE_OPS_NS radixserve
#endif
TORCH_LIBRARY_FRAGMENT(RADIXSERVE_OPS_NS, m) {
  m.def("moe_experts(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor gate_up, "
        "Tensor down, int first_expert, Tensor? gate_up_scale=None, Tensor? down_scale=None) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(RADIXSERVE_OPS_NS, CPU, m) { m.impl("moe_experts", &moe_experts); }
