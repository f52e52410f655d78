// Weight-only GEMM on CPU over pre-quantized weights, dequantized in registers/L1 inside the
// GEMM (never a dequantized copy of the weight in memory):
//   y (M, N) = x (M, K) @ W.T,  W[n, k] = (code[n, k] - zero[n, g]) * scale[n, g],  g = k / group
// for kind 0 (int4 codes 0..15), kind 1 (int8 codes 0..255); kind 2: W[n, k] = fp8_e4m3(code)
// * scale[n, g] (no zero). fp32 accumulation; x float32 or bfloat16 (widened to fp32, never
// quantized); y in x's dtype.
//
// Registered as torch.ops.radixserve.quant_gemm; radixserve/model/quantization/cpu_kernel.py
// packs the weight and owns the reference semantics.
//
// Packed layout (made once at load): blocks of 16 output channels, NB = ceil(N / 16), N padded
// with zero codes: int4 (NB, K, 8) uint8, byte j of input k holding channel j (low nibble) and
// channel j + 8 (high nibble); int8 / fp8 (NB, K, 16) uint8. scale and zero: (NB, G, 16) fp32.
// Per task (a range of channel blocks), per 64-row block of x, per K chunk (at most KC inputs
// inside one group, so its scale and zero are constants): the chunk's 16 x KC weights are
// dequantized into a 8 KiB scratch that stays in L1, then every row tile of x multiplies it.
// The inner loops are plain C++ that the compiler vectorizes for the build's ISA (AVX-512,
// AVX2 or anything else): no intrinsics, so one source builds on every tier.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int CB = 16;       // channels per packed block
constexpr int MR = 4;        // rows per micro tile: MR x 16 fp32 accumulators
constexpr int64_t MB = 64;   // rows per block of x
constexpr int64_t KC = 128;  // inputs per dequantized chunk (16 x 128 fp32: 8 KiB)
constexpr int64_t SMALL_M = 4;  // at or below: the scratch-free path (decode)

inline float fp8_e4m3_to_float(uint8_t b) {
  // e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits. A normal number's exponent and
  // mantissa shifted into fp32's fields, the bias moved by 127 - 7 = 120; a subnormal is
  // mantissa * 2^-9. (0x7f / 0xff, the NaNs, never occur in a valid weight.)
  const uint32_t em = b & 0x7Fu;
  float mag;
  if (em >= 8) {
    const uint32_t bits = (em << 20) + (120u << 23);
    std::memcpy(&mag, &bits, 4);
  } else {
    mag = static_cast<float>(em) * 0x1p-9f;
  }
  return (b & 0x80u) ? -mag : mag;
}

// w (kc, 16) = the chunk [k0, k0 + kc) of one block, dequantized; s, z: its group's 16 values.
template <int kind>
inline void dequant_chunk(const uint8_t* blk, int64_t k0, int64_t kc, const float* s,
                          const float* z, float* w) {
  for (int64_t i = 0; i < kc; ++i) {
    float* wi = w + i * CB;
    if constexpr (kind == 0) {
      const uint8_t* b = blk + (k0 + i) * (CB / 2);
#pragma omp simd
      for (int j = 0; j < CB / 2; ++j) {
        wi[j] = (static_cast<float>(b[j] & 0xF) - z[j]) * s[j];
        wi[j + CB / 2] = (static_cast<float>(b[j] >> 4) - z[j + CB / 2]) * s[j + CB / 2];
      }
    } else if constexpr (kind == 1) {
      const uint8_t* b = blk + (k0 + i) * CB;
#pragma omp simd
      for (int j = 0; j < CB; ++j) wi[j] = (static_cast<float>(b[j]) - z[j]) * s[j];
    } else {
      const uint8_t* b = blk + (k0 + i) * CB;
#pragma omp simd
      for (int j = 0; j < CB; ++j) wi[j] = fp8_e4m3_to_float(b[j]) * s[j];
    }
  }
}

// acc (mr, 16) += x (mr rows, ldx apart, kc inputs) @ w (kc, 16)
template <int mr>
inline void micro(const float* x, int64_t ldx, const float* w, int64_t kc, float* acc_out) {
  float acc[mr][CB] = {};
  for (int64_t i = 0; i < kc; ++i) {
    const float* wi = w + i * CB;
    for (int r = 0; r < mr; ++r) {
      const float xv = x[r * ldx + i];
#pragma omp simd
      for (int j = 0; j < CB; ++j) acc[r][j] += xv * wi[j];
    }
  }
  for (int r = 0; r < mr; ++r)
#pragma omp simd
    for (int j = 0; j < CB; ++j) acc_out[r * CB + j] += acc[r][j];
}

using MicroFn = void (*)(const float*, int64_t, const float*, int64_t, float*);
constexpr MicroFn kMicro[MR] = {&micro<1>, &micro<2>, &micro<3>, &micro<4>};

// One block's 16 raw code values of input k as floats (zero point and scale not applied).
template <int kind>
inline void codes16(const uint8_t* blk, int64_t k, float* v) {
  if constexpr (kind == 0) {
    const uint8_t* b = blk + k * (CB / 2);
#pragma omp simd
    for (int j = 0; j < CB / 2; ++j) {
      v[j] = static_cast<float>(b[j] & 0xF);
      v[j + CB / 2] = static_cast<float>(b[j] >> 4);
    }
  } else if constexpr (kind == 1) {
    const uint8_t* b = blk + k * CB;
#pragma omp simd
    for (int j = 0; j < CB; ++j) v[j] = static_cast<float>(b[j]);
  } else {
    const uint8_t* b = blk + k * CB;
#pragma omp simd
    for (int j = 0; j < CB; ++j) v[j] = fp8_e4m3_to_float(b[j]);
  }
}

// Few rows (decode): no scratch. Per group, acc = x . codes (raw values, in registers), then
// y += scale * (acc - zero * sum(x over the group)): the zero point and scale cost once per
// group, not once per weight.
template <int kind, int mr>
void small_block(const float* x, int64_t K, const uint8_t* blk, const float* sb,
                 const float* zb, int64_t group, float* out /* (mr, 16) */) {
  float y[mr][CB] = {};
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, ++g) {
    const int64_t k1 = std::min(K, k0 + group);
    float acc[mr][CB] = {};
    float xsum[mr] = {};
    for (int64_t k = k0; k < k1; ++k) {
      float v[CB];
      codes16<kind>(blk, k, v);
      for (int r = 0; r < mr; ++r) {
        const float xv = x[r * K + k];
        xsum[r] += xv;
#pragma omp simd
        for (int j = 0; j < CB; ++j) acc[r][j] += xv * v[j];
      }
    }
    const float* s = sb + g * CB;
    for (int r = 0; r < mr; ++r) {
      if constexpr (kind == 2) {
#pragma omp simd
        for (int j = 0; j < CB; ++j) y[r][j] += s[j] * acc[r][j];
      } else {
        const float* z = zb + g * CB;
#pragma omp simd
        for (int j = 0; j < CB; ++j) y[r][j] += s[j] * (acc[r][j] - z[j] * xsum[r]);
      }
    }
  }
  for (int r = 0; r < mr; ++r) std::memcpy(out + r * CB, y[r], sizeof(y[r]));
}

template <int kind>
void run_small(const float* x, int64_t M, int64_t K, const uint8_t* packed, const float* scale,
               const float* zero, int64_t G, int64_t group, float* y, int64_t N) {
  const int64_t NB = (N + CB - 1) / CB;
  const int64_t blk_bytes = kind == 0 ? K * CB / 2 : K * CB;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    float tile[MR * CB];
    for (int64_t nb = b0; nb < b1; ++nb) {
      const uint8_t* blk = packed + nb * blk_bytes;
      const float* sb = scale + nb * G * CB;
      const float* zb = zero == nullptr ? nullptr : zero + nb * G * CB;
      const int valid = static_cast<int>(std::min<int64_t>(CB, N - nb * CB));
      for (int64_t r0 = 0; r0 < M; r0 += MR) {
        const int64_t mr = std::min<int64_t>(MR, M - r0);
        const float* xr = x + r0 * K;
        if (mr == 1) small_block<kind, 1>(xr, K, blk, sb, zb, group, tile);
        else if (mr == 2) small_block<kind, 2>(xr, K, blk, sb, zb, group, tile);
        else if (mr == 3) small_block<kind, 3>(xr, K, blk, sb, zb, group, tile);
        else small_block<kind, 4>(xr, K, blk, sb, zb, group, tile);
        for (int64_t r = 0; r < mr; ++r)
          std::memcpy(y + (r0 + r) * N + nb * CB, tile + r * CB, valid * sizeof(float));
      }
    }
  });
}

template <int kind>
void run(const float* x, int64_t M, int64_t K, const uint8_t* packed, const float* scale,
         const float* zero, int64_t G, int64_t group, float* y, int64_t N) {
  const int64_t NB = (N + CB - 1) / CB;
  const int64_t blk_bytes = kind == 0 ? K * CB / 2 : K * CB;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(KC * CB);
    std::vector<float> tile(MB * CB);
    for (int64_t nb = b0; nb < b1; ++nb) {
      const uint8_t* blk = packed + nb * blk_bytes;
      const float* sb = scale + nb * G * CB;
      const float* zb = zero == nullptr ? nullptr : zero + nb * G * CB;
      const int valid = static_cast<int>(std::min<int64_t>(CB, N - nb * CB));
      for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t mb = std::min(MB, M - m0);
        std::fill(tile.begin(), tile.begin() + mb * CB, 0.0f);
        for (int64_t k0 = 0; k0 < K;) {
          const int64_t g = k0 / group;
          const int64_t kc = std::min({KC, (g + 1) * group - k0, K - k0});
          dequant_chunk<kind>(blk, k0, kc, sb + g * CB, zb == nullptr ? nullptr : zb + g * CB,
                              w.data());
          for (int64_t r = 0; r < mb; r += MR) {
            const int mr = static_cast<int>(std::min<int64_t>(MR, mb - r));
            kMicro[mr - 1](x + (m0 + r) * K + k0, K, w.data(), kc, tile.data() + r * CB);
          }
          k0 += kc;
        }
        for (int64_t r = 0; r < mb; ++r)
          std::memcpy(y + (m0 + r) * N + nb * CB, tile.data() + r * CB, valid * sizeof(float));
      }
    }
  });
}

at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                      const at::Tensor& zero, int64_t kind, int64_t n, int64_t group) {
  TORCH_CHECK(x.dim() == 2, "x must be (M, K)");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed: uint8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "scale: fp32");
  TORCH_CHECK(kind >= 0 && kind <= 2, "kind: 0 int4, 1 int8, 2 fp8");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t NB = (n + CB - 1) / CB, G = (K + group - 1) / group;
  TORCH_CHECK(group > 0 && scale.numel() == NB * G * CB, "scale must be (ceil(N/16), G, 16)");
  TORCH_CHECK(packed.numel() == NB * K * (kind == 0 ? CB / 2 : CB), "packed has the wrong size");
  const bool has_zero = kind != 2;
  TORCH_CHECK(!has_zero || (zero.scalar_type() == at::kFloat && zero.is_contiguous() &&
                            zero.numel() == scale.numel()), "zero must be shaped as scale");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, n}, x.options().dtype(at::kFloat));
  if (M == 0) return y.to(x.scalar_type());
  const float* z = has_zero ? zero.data_ptr<float>() : nullptr;
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const float* xp = xf.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool small = M <= SMALL_M;
  if (kind == 0)
    (small ? run_small<0> : run<0>)(xp, M, K, p, sp, z, G, group, yp, n);
  else if (kind == 1)
    (small ? run_small<1> : run<1>)(xp, M, K, p, sp, z, G, group, yp, n);
  else
    (small ? run_small<2> : run<2>)(xp, M, K, p, sp, z, G, group, yp, n);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// Output channels [n0, n1) of the weight, dequantized: (n1 - n0, K) in `dtype`. For large
// row counts the caller multiplies panels of it with the float GEMM (one panel in memory at a
// time, never the whole weight).
template <typename T>
void dequantize_into(const uint8_t* p, const float* sp, const float* zp, int64_t kind,
                     int64_t n, int64_t k, int64_t group, int64_t n0, int64_t n1, T* op) {
  const int64_t G = (k + group - 1) / group;
  const int64_t blk_bytes = kind == 0 ? k * CB / 2 : k * CB;
  at::parallel_for(n0 / CB, (n1 + CB - 1) / CB, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(KC * CB);
    for (int64_t nb = b0; nb < b1; ++nb) {
      const int64_t rows = std::min<int64_t>(CB, n1 - nb * CB);
      for (int64_t k0 = 0; k0 < k;) {
        const int64_t g = k0 / group;
        const int64_t kc = std::min({KC, (g + 1) * group - k0, k - k0});
        const float* s = sp + (nb * G + g) * CB;
        const float* z = zp == nullptr ? nullptr : zp + (nb * G + g) * CB;
        if (kind == 0) dequant_chunk<0>(p + nb * blk_bytes, k0, kc, s, z, w.data());
        else if (kind == 1) dequant_chunk<1>(p + nb * blk_bytes, k0, kc, s, z, w.data());
        else dequant_chunk<2>(p + nb * blk_bytes, k0, kc, s, z, w.data());
        // (K, n1 - n0) rows: each input's 16 channels are contiguous in both.
        for (int64_t i = 0; i < kc; ++i) {
          T* dst = op + (k0 + i) * (n1 - n0) + (nb * CB - n0);
          for (int64_t j = 0; j < rows; ++j) dst[j] = static_cast<T>(w[i * CB + j]);
        }
        k0 += kc;
      }
    }
  });
}

// Output channels [n0, n1) of the weight, dequantized and transposed: (K, n1 - n0) in
// `dtype` (float32 or bfloat16), written straight in that dtype. For large row counts the caller multiplies
// panels of it with the float GEMM (one panel in memory at a time, never the whole weight).
at::Tensor quant_dequantize(const at::Tensor& packed, const at::Tensor& scale,
                            const at::Tensor& zero, int64_t kind, int64_t n, int64_t k,
                            int64_t group, int64_t n0, int64_t n1, at::ScalarType dtype) {
  TORCH_CHECK(n0 % CB == 0 && 0 <= n0 && n0 < n1 && n1 <= n, "rows: multiples of 16 in [0, n)");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype: float32 or bfloat16");
  const int64_t NB = (n + CB - 1) / CB, G = (k + group - 1) / group;
  TORCH_CHECK(scale.numel() == NB * G * CB, "scale must be (ceil(N/16), G, 16)");
  TORCH_CHECK(packed.numel() == NB * k * (kind == 0 ? CB / 2 : CB), "packed has the wrong size");
  at::Tensor out = at::empty({k, n1 - n0}, scale.options().dtype(dtype));
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const float* zp = kind == 2 ? nullptr : zero.data_ptr<float>();
  if (dtype == at::kFloat)
    dequantize_into(p, scale.data_ptr<float>(), zp, kind, n, k, group, n0, n1,
                    out.data_ptr<float>());
  else
    dequantize_into(p, scale.data_ptr<float>(), zp, kind, n, k, group, n0, n1,
                    out.data_ptr<at::BFloat16>());
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
