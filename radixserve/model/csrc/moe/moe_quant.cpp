// A mixture-of-experts layer's experts on CPU over quantized weights (a quantized checkpoint's
// W4A16 / W8A16 / FP8 experts, or --quantization fp8's), dequantized in registers:
//   out[t] = sum over t's top-k experts e in [first, first + E) of
//            w[t, e] * down_e(silu(gate_e(x[t])) * up_e(x[t]))
// with W[e, n, k] = (code - zero[e, n, g]) * scale[e, n, g] (FP8: e4m3(code) * scale), the
// dense quantized GEMM's semantics (quant_gemm.h) per expert. x (T, D) float32 or bfloat16
// (widened to fp32, never quantized); fp32 accumulation; out in x's dtype.
//
// Layout (radixserve/model/quantization/experts.py packs it at load): each expert's weights
// in quant_gemm.h's blocks of 16 output channels, stacked over the experts: gate_up codes
// (E, 2 * NBf, Kb, 16) with the gate's NBf blocks first and the up's after (block b and
// block NBf + b hold the same 16 intermediate channels), down codes (E, NBd, Kb', 16);
// scale and zero (E, NB, G, 16) float32 (zero empty for FP8).
//
// As moe_experts.cpp (float / int8 experts): the pairs are grouped by a counting sort
// (moe_grouping.h), then two parallel sweeps over (active expert, channel block) tasks, so
// that each thread streams its own weight bytes once for all of the expert's rows:
//   1. gate/up: per (expert, 16 intermediate channels): g and u for the expert's rows from
//      the gate block and the up block, h = silu(g) * u (bf16-rounded as HF when x is bf16);
//   2. down: per (expert, 16 hidden channels): y = w_pair * (h @ down_e.T);
//   3. per token: its pairs' rows summed in ascending expert order (moe_grouping.h).
// A block's rows run through the dense GEMM's helpers: up to kSmallRows rows (decode) the
// tier's decode blocks (quant_gemm_simd.h: codes widened in registers, zero point and scale
// applied once per group); more rows (prefill) dequantize the block's K chunks into an L1
// scratch (the tier's dequant_rows_simd, quant_gemm.h's dequant_chunk on portable) that
// every row tile multiplies (quant_gemm.h's micro).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../quant_gemm_simd.h"
#include "moe_grouping.h"
#include "moe_tiles.h"

namespace {

using namespace radixserve_quant;
using radixserve_bf16::bf16_t;

constexpr int64_t ROWS = 64;       // rows per pass over a block (their tile stays in L1)
constexpr int64_t KC = 128;        // inputs per dequantized chunk of the prefill route
constexpr int64_t kSmallRows = 4;  // at or below: the decode blocks

// One projection of the experts as the op got it, and the rows it multiplies.
struct Stack {
  const uint8_t* codes;
  const float* scale;
  const float* zero;  // nullptr for FP8
  int kind;
  int64_t K, Kp, G, group, NB;

  // Expert e's weights over `M` rows of x (ldx = Kp apart) with group sums xsum (M, G).
  Operands expert(int64_t e, const float* x, const float* xsum, int64_t M) const {
    const int64_t per = NB * (kind == kInt4 ? Kp / 2 : K) * CB;  // code bytes per expert
    return Operands{x, xsum, M, K, Kp, G, group, NB * CB, codes + e * per,
                    scale + e * NB * G * CB, zero == nullptr ? nullptr : zero + e * NB * G * CB};
  }
};

template <int kind>
void decode_rows(const Operands& o, int64_t nb, int64_t r0, int64_t n, float* out) {
  constexpr int R = kDecodeRows;
  for (int64_t r = 0; r < n; r += R) {
    const int64_t mr = std::min<int64_t>(R, n - r);
    float* dst = out + r * CB;
    if (mr == 1) decode_block<kind, 1>(o, nb, r0 + r, dst);
    else if (mr == 2) decode_block<kind, 2>(o, nb, r0 + r, dst);
    else if (mr == 3) decode_block<kind, R == 4 ? 3 : 1>(o, nb, r0 + r, dst);
    else decode_block<kind, R == 4 ? 4 : 2>(o, nb, r0 + r, dst);
  }
}

// out (n, 16) = rows [r0, r0 + n) of o's x times block nb's 16 channels (n <= ROWS).
template <int kind>
void block_rows(const Operands& o, int64_t nb, int64_t r0, int64_t n, float* scratch,
                float* out) {
  if (n <= kSmallRows) {
    decode_rows<kind>(o, nb, r0, n, out);
    return;
  }
  std::fill(out, out + n * CB, 0.f);
  [[maybe_unused]] const bool simd = simd_rows(kind, o);  // the tier's vector dequant
  const uint8_t* blk = o.packed + nb * o.block_bytes(kind);
  const float* sb = o.scale + nb * o.G * CB;
  const float* zb = o.zero == nullptr ? nullptr : o.zero + nb * o.G * CB;
  for (int64_t k0 = 0; k0 < o.K;) {
    const int64_t g = k0 / o.group;
    const int64_t kc = std::min({KC, (g + 1) * o.group - k0, o.K - k0});
    const float* zg = zb == nullptr ? nullptr : zb + g * CB;
#if RS_QUANT_AVX512 || RS_QUANT_AVX2
    if (simd) dequant_rows_simd<kind>(blk, k0, k0 + kc, sb + g * CB, zg, scratch, CB);
    else dequant_chunk<kind>(blk, k0, kc, sb + g * CB, zg, scratch);
#else
    dequant_chunk<kind>(blk, k0, kc, sb + g * CB, zg, scratch);
#endif
    for (int64_t r = 0; r < n; r += 4) {
      const int64_t mr = std::min<int64_t>(4, n - r);
      const float* xr = o.x + (r0 + r) * o.Kp + k0;
      float* acc = out + r * CB;
      if (mr == 1) micro<1>(xr, o.Kp, scratch, kc, acc);
      else if (mr == 2) micro<2>(xr, o.Kp, scratch, kc, acc);
      else if (mr == 3) micro<3>(xr, o.Kp, scratch, kc, acc);
      else micro<4>(xr, o.Kp, scratch, kc, acc);
    }
    k0 += kc;
  }
}

using BlockRows = void (*)(const Operands&, int64_t, int64_t, int64_t, float*, float*);
BlockRows block_rows_of(int kind) {
  return kind == kInt4 ? &block_rows<kInt4> : kind == kInt8 ? &block_rows<kInt8>
                                                            : &block_rows<kFp8>;
}

// Row p of a (P, ld) fp32 matrix: its sums over each group of `group` inputs (K of them).
void group_sums(const float* a, int64_t P, int64_t ld, int64_t K, int64_t group, int64_t G,
                float* sums) {
  at::parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.f;
        for (int64_t k = g * group, k1 = std::min(K, (g + 1) * group); k < k1; ++k)
          s += a[p * ld + k];
        sums[p * G + g] = s;
      }
  });
}

// xs (P, Kp) fp32 = the sorted pairs' token rows of x, widened, zero past D.
void gather_rows(const at::Tensor& x, const radixserve_moe::Grouping& g, int64_t Kp,
                 float* xs) {
  const int64_t P = g.offsets.back(), D = x.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* dst = xs + p * Kp;
      const int64_t t = g.token[p];
      if (bf16) {
        const bf16_t* src = reinterpret_cast<const bf16_t*>(x.data_ptr()) + t * D;
        for (int64_t k = 0; k < D; ++k) dst[k] = radixserve_bf16::ld(src, k);
      } else {
        std::memcpy(dst, x.data_ptr<float>() + t * D, D * sizeof(float));
      }
      for (int64_t k = D; k < Kp; ++k) dst[k] = 0.f;
    }
  });
}

// h (P, ldh) = silu(x @ gate_e.T) * (x @ up_e.T) per expert e over its sorted rows.
void gate_up_phase(const Stack& w, const radixserve_moe::Grouping& g, const float* xs,
                   const float* xsum, int64_t F, bool round, float* h, int64_t ldh) {
  const int64_t nbf = w.NB / 2;
  const int64_t tasks = static_cast<int64_t>(g.active.size()) * nbf;
  const BlockRows rows_fn = block_rows_of(w.kind);
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(KC * CB), gt(ROWS * CB), ut(ROWS * CB);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = g.active[t / nbf], b = t % nbf, off = g.offsets[e];
      const int64_t n_e = g.offsets[e + 1] - off, nch = std::min<int64_t>(CB, F - b * CB);
      const Operands o = w.expert(e, xs + off * w.Kp, xsum + off * w.G, n_e);
      for (int64_t r0 = 0; r0 < n_e; r0 += ROWS) {
        const int64_t n = std::min(ROWS, n_e - r0);
        rows_fn(o, b, r0, n, scratch.data(), gt.data());
        rows_fn(o, nbf + b, r0, n, scratch.data(), ut.data());
        for (int64_t i = 0; i < n; ++i)
          radixserve_moe::silu_mul(gt.data() + i * CB, ut.data() + i * CB, nch, round,
                                   h + (off + r0 + i) * ldh + b * CB);
      }
    }
  });
}

// y (P, D) fp32 = weight_p * (h_p @ down_e.T) per expert e over its sorted rows.
void down_phase(const Stack& w, const radixserve_moe::Grouping& g, const float* h,
                const float* hsum, int64_t D, float* y) {
  const int64_t tasks = static_cast<int64_t>(g.active.size()) * w.NB;
  const BlockRows rows_fn = block_rows_of(w.kind);
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(KC * CB), tile(ROWS * CB);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = g.active[t / w.NB], nb = t % w.NB, off = g.offsets[e];
      const int64_t n_e = g.offsets[e + 1] - off, nch = std::min<int64_t>(CB, D - nb * CB);
      const Operands o = w.expert(e, h + off * w.Kp, hsum + off * w.G, n_e);
      for (int64_t r0 = 0; r0 < n_e; r0 += ROWS) {
        const int64_t n = std::min(ROWS, n_e - r0);
        rows_fn(o, nb, r0, n, scratch.data(), tile.data());
        for (int64_t i = 0; i < n; ++i) {
          const float wt = g.weight[off + r0 + i];
          float* yr = y + (off + r0 + i) * D + nb * CB;
          for (int64_t j = 0; j < nch; ++j) yr[j] = tile[i * CB + j] * wt;
        }
      }
    }
  });
}

Stack check_stack(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                  int64_t kind, int64_t K, int64_t group, int64_t NB, int64_t E,
                  const char* what) {
  TORCH_CHECK(kind >= 0 && kind <= 2, what, ": kind 0 int4, 1 int8, 2 fp8");
  TORCH_CHECK(group > 0, what, ": group > 0");
  const int64_t Kp = kind == kInt4 ? K + (K & 1) : K, G = (K + group - 1) / group;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 4 &&
              codes.size(0) == E && codes.size(1) == NB &&
              codes.size(2) == (kind == kInt4 ? Kp / 2 : K) && codes.size(3) == CB,
              what, ": codes must be (E, NB, Kp / 2 or K, 16) uint8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
              scale.numel() == E * NB * G * CB, what, ": scale must be (E, NB, G, 16) fp32");
  const bool has_zero = kind != kFp8;
  TORCH_CHECK(!has_zero || (zero.scalar_type() == at::kFloat && zero.is_contiguous() &&
                            zero.numel() == scale.numel()), what, ": zero shaped as scale");
  return Stack{codes.data_ptr<uint8_t>(), scale.data_ptr<float>(),
               has_zero ? zero.data_ptr<float>() : nullptr, static_cast<int>(kind), K, Kp, G,
               group, NB};
}

at::Tensor moe_experts_quant(const at::Tensor& x_in, const at::Tensor& topk_weights,
                             const at::Tensor& topk_ids, const at::Tensor& gu_codes,
                             const at::Tensor& gu_scale, const at::Tensor& gu_zero,
                             int64_t gu_kind, int64_t gu_group, const at::Tensor& dn_codes,
                             const at::Tensor& dn_scale, const at::Tensor& dn_zero,
                             int64_t dn_kind, int64_t dn_group, int64_t F,
                             int64_t first_expert) {
  TORCH_CHECK(x_in.dim() == 2, "x must be (T, D)");
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "x: float32 or bfloat16");
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), D = x.size(1), E = gu_codes.size(0);
  const int64_t nbf = (F + CB - 1) / CB, nbd = (D + CB - 1) / CB;
  const Stack gu = check_stack(gu_codes, gu_scale, gu_zero, gu_kind, D, gu_group, 2 * nbf, E,
                               "gate_up");
  const Stack dn = check_stack(dn_codes, dn_scale, dn_zero, dn_kind, F, dn_group, nbd, E,
                               "down");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T &&
              topk_ids.scalar_type() == at::kLong, "topk_ids: (T, k) int64");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "topk_weights: (T, k) as topk_ids");
  const int64_t k = topk_ids.size(1);
  const at::Tensor ids = topk_ids.contiguous();
  const at::Tensor w = topk_weights.to(at::kFloat).contiguous();
  const auto g = radixserve_moe::group_pairs(ids.data_ptr<int64_t>(), w.data_ptr<float>(),
                                             T * k, k, first_expert, E);
  const int64_t P = g.offsets[E];
  at::Tensor out = at::empty({T, D}, x.options());
  if (P == 0) return out.zero_();
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor xs = at::empty({P, gu.Kp}, f32), xsum = at::empty({P, gu.G}, f32);
  gather_rows(x, g, gu.Kp, xs.data_ptr<float>());
  group_sums(xs.data_ptr<float>(), P, gu.Kp, D, gu.group, gu.G, xsum.data_ptr<float>());
  at::Tensor h = at::zeros({P, dn.Kp}, f32), hsum = at::empty({P, dn.G}, f32);
  const bool bf16 = dtype == at::kBFloat16;
  gate_up_phase(gu, g, xs.data_ptr<float>(), xsum.data_ptr<float>(), F, bf16,
                h.data_ptr<float>(), dn.Kp);
  group_sums(h.data_ptr<float>(), P, dn.Kp, F, dn.group, dn.G, hsum.data_ptr<float>());
  at::Tensor y = at::empty({P, D}, f32);
  down_phase(dn, g, h.data_ptr<float>(), hsum.data_ptr<float>(), D, y.data_ptr<float>());
  if (bf16) radixserve_moe::combine(y.data_ptr<float>(), g, T, k, D,
                                    reinterpret_cast<bf16_t*>(out.data_ptr()));
  else radixserve_moe::combine(y.data_ptr<float>(), g, T, k, D, out.data_ptr<float>());
  return out;
}

}  // namespace

#ifndef RADIXSERVE_OPS_NS
#define RADIXSERVE_OPS_NS radixserve
#endif
TORCH_LIBRARY_FRAGMENT(RADIXSERVE_OPS_NS, m) {
  m.def("moe_experts_quant(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor gu_codes, "
        "Tensor gu_scale, Tensor gu_zero, int gu_kind, int gu_group, Tensor dn_codes, "
        "Tensor dn_scale, Tensor dn_zero, int dn_kind, int dn_group, int inter, "
        "int first_expert) -> Tensor");
}

TORCH_LIBRARY_IMPL(RADIXSERVE_OPS_NS, CPU, m) { m.impl("moe_experts_quant", &moe_experts_quant); }
