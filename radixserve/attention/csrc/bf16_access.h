// Element access in fp32 for float and bf16 arrays, written so that loops over it vectorize:
// bf16 goes through its bits (fp32's upper half) because at::BFloat16's scalar conversions
// keep gcc from vectorizing. Rounding to bf16 is to nearest even, NaN to the quiet NaN, as
// at::BFloat16's (a file built with -ffast-math may drop the NaN test).
//
// Shared by attention/csrc/paged_decode.cpp and model/csrc/norm_rope.cpp. The builds' names
// carry a digest of this header (platform/native_build.py): no version to bump.
#pragma once

#include <cstdint>

namespace radixserve_bf16 {

using bf16_t = uint16_t;

inline float ld(const float* p, int64_t i) { return p[i]; }
inline float ld(const bf16_t* p, int64_t i) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(p[i]) << 16);
}
inline void st(float* p, int64_t i, float v) { p[i] = v; }
inline void st(bf16_t* p, int64_t i, float v) {
  const uint32_t u = __builtin_bit_cast(uint32_t, v);
  p[i] = static_cast<bf16_t>(v != v ? 0x7FC0u : (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace radixserve_bf16
