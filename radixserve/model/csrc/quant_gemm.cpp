// Weight-only GEMM on CPU over pre-quantized weights, dequantized in registers/L1 inside the
// GEMM (never a dequantized copy of the weight in memory): the ops quant_gemm and
// quant_dequantize. The layout and the semantics: quant_gemm.h; the packing and the reference:
// radixserve/model/quantization/cpu_kernel.py. fp32 accumulation; x float32 or bfloat16
// (widened to fp32, never quantized); y in x's dtype.
//
// Up to kSmallRows rows (decode): per block of 16 channels, row tiles of the tier's
// decode_block (quant_gemm_simd.h: AVX-512 / AVX2 intrinsics, plain loops on portable), the
// threads splitting the channel blocks so that each streams its own weight bytes. More rows:
// per task (a range of channel blocks), per 64-row block of x, per K chunk (at most KC inputs
// inside one group, so its scale and zero are constants), the chunk's 16 x KC weights are
// dequantized into an 8 KiB scratch that stays in L1, then every row tile of x multiplies it
// (plain C++ the compiler vectorizes). Prefill (QuantLinear, from 32 rows) instead multiplies
// panels of quant_dequantize's output with torch's GEMM.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant_gemm_simd.h"

namespace {

using namespace radixserve_quant;

constexpr int MR = 4;           // rows per micro tile of the scratch path: MR x 16 accumulators
constexpr int64_t MB = 64;      // rows per block of x
constexpr int64_t KC = 128;     // inputs per dequantized chunk (16 x 128 fp32: 8 KiB)
constexpr int64_t kSmallRows = 4;  // at or below: the decode blocks

using MicroFn = void (*)(const float*, int64_t, const float*, int64_t, float*);
constexpr MicroFn kMicro[MR] = {&micro<1>, &micro<2>, &micro<3>, &micro<4>};

template <int kind>
void run_small(const Operands& o, float* y) {
  constexpr int R = kDecodeRows;
  using BlockFn = void (*)(const Operands&, int64_t, int64_t, float*);
  static_assert(R == 2 || R == 4, "decode row tiles of 2 or 4");
  constexpr BlockFn fns[4] = {&decode_block<kind, 1>, &decode_block<kind, 2>,
                              &decode_block<kind, R == 4 ? 3 : 1>,
                              &decode_block<kind, R == 4 ? 4 : 2>};
  const int64_t NB = (o.N + CB - 1) / CB;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float tile[4 * CB];
    for (int64_t nb = b0; nb < b1; ++nb) {
      const int valid = static_cast<int>(std::min<int64_t>(CB, o.N - nb * CB));
      for (int64_t r0 = 0; r0 < o.M; r0 += R) {
        const int64_t mr = std::min<int64_t>(R, o.M - r0);
        fns[mr - 1](o, nb, r0, tile);
        for (int64_t r = 0; r < mr; ++r)
          std::memcpy(y + (r0 + r) * o.N + nb * CB, tile + r * CB, valid * sizeof(float));
      }
    }
  });
}

template <int kind>
void run_tiled(const Operands& o, float* y) {
  const int64_t NB = (o.N + CB - 1) / CB;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(KC * CB);
    std::vector<float> tile(MB * CB);
    for (int64_t nb = b0; nb < b1; ++nb) {
      const uint8_t* blk = o.packed + nb * o.block_bytes(kind);
      const float* sb = o.scale + nb * o.G * CB;
      const float* zb = o.zero == nullptr ? nullptr : o.zero + nb * o.G * CB;
      const int valid = static_cast<int>(std::min<int64_t>(CB, o.N - nb * CB));
      for (int64_t m0 = 0; m0 < o.M; m0 += MB) {
        const int64_t mb = std::min(MB, o.M - m0);
        std::fill(tile.begin(), tile.begin() + mb * CB, 0.0f);
        for (int64_t k0 = 0; k0 < o.K;) {
          const int64_t g = k0 / o.group;
          const int64_t kc = std::min({KC, (g + 1) * o.group - k0, o.K - k0});
          dequant_chunk<kind>(blk, k0, kc, sb + g * CB, zb == nullptr ? nullptr : zb + g * CB,
                              w.data());
          for (int64_t r = 0; r < mb; r += MR) {
            const int mr = static_cast<int>(std::min<int64_t>(MR, mb - r));
            kMicro[mr - 1](o.x + (m0 + r) * o.Kp + k0, o.Kp, w.data(), kc,
                           tile.data() + r * CB);
          }
          k0 += kc;
        }
        for (int64_t r = 0; r < mb; ++r)
          std::memcpy(y + (m0 + r) * o.N + nb * CB, tile.data() + r * CB,
                      valid * sizeof(float));
      }
    }
  });
}

// x (M, K) float32 or bfloat16 -> (M, Kp) float32, zero padded; xsum (M, G): sums per group.
void widen_x(const at::Tensor& x, int64_t Kp, int64_t group, int64_t G, float* xp, float* xs) {
  const int64_t M = x.size(0), K = x.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float* xf = bf16 ? nullptr : x.data_ptr<float>();
  const uint16_t* xb = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr()) : nullptr;
  for (int64_t r = 0; r < M; ++r) {
    float* dst = xp + r * Kp;
    if (bf16) {
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) {
        const uint32_t bits = static_cast<uint32_t>(xb[r * K + k]) << 16;  // bf16 -> fp32
        std::memcpy(dst + k, &bits, 4);
      }
    } else {
      std::memcpy(dst, xf + r * K, K * sizeof(float));
    }
    for (int64_t k = K; k < Kp; ++k) dst[k] = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t k = g * group, k1 = std::min(K, (g + 1) * group); k < k1; ++k) s += dst[k];
      xs[r * G + g] = s;
    }
  }
}

at::Tensor quant_gemm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale,
                      const at::Tensor& zero, int64_t kind, int64_t n, int64_t group) {
  TORCH_CHECK(x_in.dim() == 2, "x must be (M, K)");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed: uint8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "scale: fp32");
  TORCH_CHECK(kind >= 0 && kind <= 2, "kind: 0 int4, 1 int8, 2 fp8");
  const at::Tensor x = x_in.scalar_type() == at::kBFloat16 ? x_in.contiguous()
                                                           : x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), Kp = kind == kInt4 ? K + (K & 1) : K;
  const int64_t NB = (n + CB - 1) / CB, G = (K + group - 1) / group;
  TORCH_CHECK(group > 0 && scale.numel() == NB * G * CB, "scale must be (ceil(N/16), G, 16)");
  TORCH_CHECK(packed.numel() == NB * (kind == kInt4 ? Kp / 2 : K) * CB,
              "packed has the wrong size");
  const bool has_zero = kind != kFp8;
  TORCH_CHECK(!has_zero || (zero.scalar_type() == at::kFloat && zero.is_contiguous() &&
                            zero.numel() == scale.numel()), "zero must be shaped as scale");
  at::Tensor y = at::empty({M, n}, x.options().dtype(at::kFloat));
  if (M == 0) return y.to(x_in.scalar_type());
  std::vector<float> xbuf(M * Kp + M * G);
  widen_x(x, Kp, group, G, xbuf.data(), xbuf.data() + M * Kp);
  const Operands o{xbuf.data(), xbuf.data() + M * Kp, M, K, Kp, G, group, n,
                   packed.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                   has_zero ? zero.data_ptr<float>() : nullptr};
  float* yp = y.data_ptr<float>();
  const bool small = M <= kSmallRows;
  if (kind == kInt4) (small ? run_small<kInt4> : run_tiled<kInt4>)(o, yp);
  else if (kind == kInt8) (small ? run_small<kInt8> : run_tiled<kInt8>)(o, yp);
  else (small ? run_small<kFp8> : run_tiled<kFp8>)(o, yp);
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

// float -> bfloat16 bits, rounded to nearest even (weights are finite: no NaN case), in a
// form the compiler vectorizes (c10's conversion, with its NaN branch, it does not).
inline uint16_t to_bf16_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// Output channels [n0, n1) of the weight, dequantized: (K, n1 - n0) float32 or bf16 bits.
template <typename T>
void dequantize_into(const Operands& o, int kind, int64_t n0, int64_t n1, T* op) {
  const bool simd = simd_rows(kind, o);
  at::parallel_for(n0 / CB, (n1 + CB - 1) / CB, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(KC * CB);
    alignas(64) uint16_t bf[CB];
    for (int64_t nb = b0; nb < b1; ++nb) {
      const uint8_t* blk = o.packed + nb * o.block_bytes(kind);
      const int64_t rows = std::min<int64_t>(CB, n1 - nb * CB);
      for (int64_t k0 = 0; k0 < o.K;) {
        const int64_t g = k0 / o.group;
        const int64_t kc = std::min({KC, (g + 1) * o.group - k0, o.K - k0});
        const float* s = o.scale + (nb * o.G + g) * CB;
        const float* z = o.zero == nullptr ? nullptr : o.zero + (nb * o.G + g) * CB;
        T* dst = op + k0 * (n1 - n0) + (nb * CB - n0);
#if RS_QUANT_AVX512 || RS_QUANT_AVX2
        if (rows == CB && simd) {  // the tier's intrinsics, straight into the panel
          const int64_t ld = n1 - n0;
          if (kind == kInt4) dequant_rows_simd<kInt4>(blk, k0, k0 + kc, s, z, dst, ld);
          else if (kind == kInt8) dequant_rows_simd<kInt8>(blk, k0, k0 + kc, s, z, dst, ld);
          else dequant_rows_simd<kFp8>(blk, k0, k0 + kc, s, z, dst, ld);
          k0 += kc;
          continue;
        }
#endif
        if (kind == kInt4) dequant_chunk<kInt4>(blk, k0, kc, s, z, w.data());
        else if (kind == kInt8) dequant_chunk<kInt8>(blk, k0, kc, s, z, w.data());
        else dequant_chunk<kFp8>(blk, k0, kc, s, z, w.data());
        // (K, n1 - n0) rows: each input's 16 channels are contiguous in both.
        for (int64_t i = 0; i < kc; ++i) {
          const float* wi = w.data() + i * CB;
          if constexpr (std::is_same_v<T, float>) {
            std::memcpy(dst + i * (n1 - n0), wi, rows * sizeof(float));
          } else {
#pragma omp simd
            for (int j = 0; j < CB; ++j) bf[j] = to_bf16_bits(wi[j]);
            std::memcpy(dst + i * (n1 - n0), bf, rows * sizeof(uint16_t));
          }
        }
        k0 += kc;
      }
    }
  });
}

// Output channels [n0, n1) of the weight, dequantized and transposed: (K, n1 - n0) in
// `dtype` (float32 or bfloat16), written straight in that dtype. For large row counts the
// caller multiplies panels of it with the float GEMM (one panel at a time, never the whole
// weight).
at::Tensor quant_dequantize(const at::Tensor& packed, const at::Tensor& scale,
                            const at::Tensor& zero, int64_t kind, int64_t n, int64_t k,
                            int64_t group, int64_t n0, int64_t n1, at::ScalarType dtype) {
  TORCH_CHECK(n0 % CB == 0 && 0 <= n0 && n0 < n1 && n1 <= n, "rows: multiples of 16 in [0, n)");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype: float32 or bfloat16");
  const int64_t NB = (n + CB - 1) / CB, G = (k + group - 1) / group;
  TORCH_CHECK(scale.numel() == NB * G * CB, "scale must be (ceil(N/16), G, 16)");
  TORCH_CHECK(packed.numel() == NB * (kind == kInt4 ? (k + (k & 1)) / 2 : k) * CB,
              "packed has the wrong size");
  at::Tensor out = at::empty({k, n1 - n0}, scale.options().dtype(dtype));
  const Operands o{nullptr, nullptr, 0, k, kind == kInt4 ? k + (k & 1) : k, G, group, n,
                   packed.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                   kind == kFp8 ? nullptr : zero.data_ptr<float>()};
  if (dtype == at::kFloat)
    dequantize_into(o, static_cast<int>(kind), n0, n1, out.data_ptr<float>());
  else
    dequantize_into(o, static_cast<int>(kind), n0, n1,
                    reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

}  // namespace

// A fragment in the tier's namespace (platform/kernels.py defines RADIXSERVE_OPS_NS per build).
#ifndef RADIXSERVE_OPS_NS
#define RADIXSERVE_OPS_NS radixserve
#endif
TORCH_LIBRARY_FRAGMENT(RADIXSERVE_OPS_NS, m) {
  m.def("quant_gemm(Tensor x, Tensor packed, Tensor scale, Tensor zero, int kind, int n, "
        "int group) -> Tensor");
  m.def("quant_dequantize(Tensor packed, Tensor scale, Tensor zero, int kind, int n, int k, "
        "int group, int n0, int n1, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(RADIXSERVE_OPS_NS, CPU, m) {
  m.impl("quant_gemm", &quant_gemm);
  m.impl("quant_dequantize", &quant_dequantize);
}
