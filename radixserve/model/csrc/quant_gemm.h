// The quantized GEMM's packed layout, one call's operands and the plain C++ (portable) kernels
// that every tier compiles; quant_gemm_simd.h adds the AVX2 / AVX-512 decode blocks and
// quant_gemm.cpp the ops. Semantics (radixserve/model/quantization/cpu_kernel.py owns them):
//   y (M, N) = x (M, K) @ W.T,  W[n, k] = (code[n, k] - zero[n, g]) * scale[n, g],  g = k / group
// kind 0: int4 codes 0..15, kind 1: int8 codes 0..255, kind 2: W[n, k] = e4m3(code) * scale.
//
// Packed layout (made once at load): blocks of 16 output channels, NB = ceil(N / 16), N padded
// with zero codes and scales. int4: (NB, Kp / 2, 16) uint8, Kp = K rounded up to even (a zero
// code pads it): byte j of pair p holds channel j's codes of inputs 2p (low nibble) and 2p + 1
// (high nibble), so one 16-byte load widened to 16 lanes gives both inputs' 16 channels with
// one mask and one shift. int8 / fp8: (NB, K, 16) uint8. scale, zero: (NB, G, 16) float32.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace radixserve_quant {

constexpr int CB = 16;  // channels per packed block

enum Kind : int { kInt4 = 0, kInt8 = 1, kFp8 = 2 };

// One call's inputs as every kernel reads them.
struct Operands {
  const float* x;     // (M, Kp) float32, zero past K (so padded codes add nothing)
  const float* xsum;  // (M, G): x summed over each group (the zero points' term)
  int64_t M, K, Kp, G, group, N;
  const uint8_t* packed;
  const float* scale;
  const float* zero;  // nullptr for fp8

  int64_t block_bytes(int kind) const { return kind == kInt4 ? Kp / 2 * CB : K * CB; }
  // Inputs [k0, k1) of group g; the last group runs to Kp (int4's pad input has x = 0).
  int64_t group_end(int64_t g) const { return g + 1 == G ? Kp : std::min(Kp, (g + 1) * group); }
};

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

// One block's 16 raw code values of input k as floats (zero point and scale not applied).
template <int kind>
inline void codes16(const uint8_t* blk, int64_t k, float* v) {
  if constexpr (kind == kInt4) {
    const uint8_t* b = blk + (k / 2) * CB;
    const int shift = static_cast<int>(k & 1) * 4;
    for (int j = 0; j < CB; ++j) v[j] = static_cast<float>((b[j] >> shift) & 0xF);
  } else if constexpr (kind == kInt8) {
    const uint8_t* b = blk + k * CB;
    for (int j = 0; j < CB; ++j) v[j] = static_cast<float>(b[j]);
  } else {
    const uint8_t* b = blk + k * CB;
    for (int j = 0; j < CB; ++j) v[j] = fp8_e4m3_to_float(b[j]);
  }
}

// w (kc, 16) = the inputs [k0, k0 + kc) of one block, dequantized; s, z: its group's values.
template <int kind>
inline void dequant_chunk(const uint8_t* blk, int64_t k0, int64_t kc, const float* s,
                          const float* z, float* w) {
  for (int64_t i = 0; i < kc; ++i) {
    float* wi = w + i * CB;
    codes16<kind>(blk, k0 + i, wi);
    if constexpr (kind == kFp8) {
#pragma omp simd
      for (int j = 0; j < CB; ++j) wi[j] *= s[j];
    } else {
#pragma omp simd
      for (int j = 0; j < CB; ++j) wi[j] = (wi[j] - z[j]) * s[j];
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

// Few rows (decode), plain C++: block nb's 16 outputs of rows [r0, r0 + mr) into out (mr, 16).
// Per group, acc = x . codes (raw values), then y += scale * (acc - zero * sum(x over the
// group)): the zero point and scale cost once per group, not once per weight.
template <int kind, int mr>
void decode_block_portable(const Operands& o, int64_t nb, int64_t r0, float* out) {
  const uint8_t* blk = o.packed + nb * o.block_bytes(kind);
  float y[mr][CB] = {};
  for (int64_t g = 0; g < o.G; ++g) {
    float acc[mr][CB] = {};
    for (int64_t k = g * o.group, k1 = o.group_end(g); k < k1; ++k) {
      float v[CB];
      codes16<kind>(blk, k, v);
      for (int r = 0; r < mr; ++r) {
        const float xv = o.x[(r0 + r) * o.Kp + k];
#pragma omp simd
        for (int j = 0; j < CB; ++j) acc[r][j] += xv * v[j];
      }
    }
    const float* s = o.scale + (nb * o.G + g) * CB;
    for (int r = 0; r < mr; ++r) {
      if constexpr (kind == kFp8) {
#pragma omp simd
        for (int j = 0; j < CB; ++j) y[r][j] += s[j] * acc[r][j];
      } else {
        const float* z = o.zero + (nb * o.G + g) * CB;
        const float xs = o.xsum[(r0 + r) * o.G + g];
#pragma omp simd
        for (int j = 0; j < CB; ++j) y[r][j] += s[j] * (acc[r][j] - z[j] * xs);
      }
    }
  }
  for (int r = 0; r < mr; ++r) std::memcpy(out + r * CB, y[r], sizeof(y[r]));
}

}  // namespace radixserve_quant
