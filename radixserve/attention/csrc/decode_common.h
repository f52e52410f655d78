// What the paged decode kernels share (paged_decode.cpp: the op, its checks and the
// model-dtype pools; paged_decode_fp8.cpp: 8-bit pools): the problem's geometry, the batch's
// pointers, and the softmax of one head's scores.
//
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "bf16_access.h"
#include "fp8_access.h"
#include "vec_math.h"

namespace radixserve_decode {

struct Geometry {
  int64_t hq, hkv, d, sk, sv;  // query heads, KV heads, head_dim, slot strides of the caches
  float scale;
  float softcap = 0.f;  // > 0: scores s become softcap * tanh(s / softcap) before the softmax
};

// Software prefetch of a slot's row (all its KV heads) kPrefetchAhead keys before the walk
// reads it. A request's decode slots are scattered over the pool (one slot per token, taken
// step by step while the whole batch takes its own), so no hardware prefetcher sees the next
// row coming and the walk waits on memory latency once per key; GCC's builtin emits
// prefetcht0 on x86 (every tier) and nothing where there is none. At most the row's first
// kPrefetchBytes: past them a row is long enough for the hardware's own stream prefetch.
constexpr int64_t kPrefetchAhead = 8;
constexpr int64_t kPrefetchBytes = 512;

inline void prefetch_row(const void* base, int64_t slot, int64_t stride_bytes,
                         int64_t row_bytes) {
  const char* p = static_cast<const char*>(base) + slot * stride_bytes;
  const int64_t n = row_bytes < kPrefetchBytes ? row_bytes : kPrefetchBytes;
  for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 3);
}

// Request b attends to slots[rows[b] * lmax + starts[b] ...] for lens[b] - starts[b] keys.
struct Batch {
  int64_t size, lmax;
  const int32_t* slots;
  const int64_t *rows, *starts, *lens;

  const int32_t* slots_of(int64_t b) const { return slots + rows[b] * lmax + starts[b]; }
  int64_t len_of(int64_t b) const { return lens[b] - starts[b]; }
};

// A call over an 8-bit pool as pointers: q and out in T (float or bf16 bits), the pool's
// bytes, its scales (Hkv,); request b's q, out and lse rows.
template <typename T>
struct Fp8Call {
  const T* q;
  const uint8_t *k, *v;
  const float *k_scale, *v_scale;
  T* out;
  float* lse;
  int64_t hq, hd;

  Fp8Call(const at::Tensor& q_, const at::Tensor& k_cache, const at::Tensor& v_cache,
          const at::Tensor& ks, const at::Tensor& vs, at::Tensor& out_, at::Tensor& lse_)
      : q(static_cast<const T*>(q_.data_ptr())),
        k(static_cast<const uint8_t*>(k_cache.data_ptr())),
        v(static_cast<const uint8_t*>(v_cache.data_ptr())),
        k_scale(ks.data_ptr<float>()),
        v_scale(vs.data_ptr<float>()),
        out(static_cast<T*>(out_.data_ptr())),
        lse(lse_.data_ptr<float>()),
        hq(q_.size(1)),
        hd(q_.size(1) * q_.size(2)) {}

  const T* q_of(int64_t b) const { return q + b * hd; }
  T* out_of(int64_t b) const { return out + b * hd; }
  float* lse_of(int64_t b) const { return lse + b * hq; }
};

// decode(b, work) for every request b, one task each (a task streams its request's K and V
// rows once for all its heads); work: the thread's reusable scratch.
template <typename Fn>
void each_request(const Batch& batch, const Fn& decode) {
  at::parallel_for(0, batch.size, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work;
    for (int64_t b = begin; b < end; ++b) decode(b, work);
  });
}

// out (hq, D) in bf16 from P.V accumulators in Bf16Lut::pairs' dim order, times v_scale.
inline void store_from_pairs(const float* acc, const float* v_scale, const Geometry& g,
                             uint16_t* out) {
  const int64_t group = g.hq / g.hkv;
  for (int64_t h = 0; h < g.hq; ++h)
    for (int64_t i = 0; i < g.d; ++i)
      radixserve_bf16::st(out, h * g.d + (i & ~63) + radixserve_fp8::pair64(i & 63),
                          acc[h * g.d + i] * v_scale[h / group]);
}

// fn(std::integral_constant<Format, F>{}) with F the 8-bit pool's format.
template <typename Fn>
void with_format(at::ScalarType pool, Fn&& fn) {
  using radixserve_fp8::Format;
  if (pool == at::kFloat8_e4m3fn) {
    fn(std::integral_constant<Format, Format::E4M3>{});
  } else {
    fn(std::integral_constant<Format, Format::E5M2>{});
  }
}

// Logit soft-capping (Gemma 2) of len scaled scores in place; softcap <= 0: none.
inline void cap_scores(float* s, int64_t len, float softcap) {
  if (softcap <= 0.f) return;
  const float inv = 1.f / softcap;
  for (int64_t t = 0; t < len; ++t) s[t] = softcap * std::tanh(s[t] * inv);
}

// Softmax of one head's scores in place (normalized: out needs no division); returns the lse.
// exp's argument is clamped at -80 (e^-80 ~ 2e-35 next to the max's 1: nothing in fp32).
// softcap > 0: the scores are soft-capped first (every decode kernel's one place for it).
inline float softmax(float* s, int64_t len, float softcap = 0.f) {
  cap_scores(s, len, softcap);
#if defined(__AVX512F__)
  // len >= 1 (checked); no infinities: the files build with -ffast-math
  auto tail = [len](int64_t t) -> __mmask16 {
    return len - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - t)) - 1);
  };
  __m512 vmax = _mm512_set1_ps(s[0]);
  for (int64_t t = 0; t < len; t += 16)
    vmax = _mm512_mask_max_ps(vmax, tail(t), vmax, _mm512_maskz_loadu_ps(tail(t), s + t));
  const float m = _mm512_reduce_max_ps(vmax);
  const __m512 vm = _mm512_set1_ps(m), floor = _mm512_set1_ps(-80.f);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 k = tail(t);
    const __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), vm), floor);
    const __m512 e = _mm512_maskz_mov_ps(k, radixserve_vec::exp_ps(x));
    _mm512_mask_storeu_ps(s + t, k, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  const float sum = _mm512_reduce_add_ps(vsum);
#elif RS_VEC_AVX2
  // the avx2 tier: 8 lanes, the tail (len % 8 scores) in scalar code
  using radixserve_vec::exp256;
  const int64_t whole = len & ~int64_t{7};
  __m256 vmax = _mm256_set1_ps(s[0]);
  for (int64_t t = 0; t < whole; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + t));
  float m = radixserve_vec::hmax8(vmax);
  for (int64_t t = whole; t < len; ++t) m = s[t] > m ? s[t] : m;
  const __m256 vm = _mm256_set1_ps(m), floor = _mm256_set1_ps(-80.f);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t t = 0; t < whole; t += 8) {
    const __m256 e = exp256(_mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm), floor));
    _mm256_storeu_ps(s + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = radixserve_vec::hsum8(vsum);
  for (int64_t t = whole; t < len; ++t) {
    const float x = s[t] - m;
    s[t] = std::exp(x > -80.f ? x : -80.f);
    sum += s[t];
  }
#else
  float m = s[0];  // len >= 1 (checked); no infinities: the files build with -ffast-math
#pragma omp simd reduction(max : m)
  for (int64_t t = 1; t < len; ++t) m = s[t] > m ? s[t] : m;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    const float x = s[t] - m;
    s[t] = std::exp(x > -80.f ? x : -80.f);
    sum += s[t];
  }
#endif
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t t = 0; t < len; ++t) s[t] *= inv;
  return m + std::log(sum);
}

// paged_decode_fp8.cpp: the batch over an 8-bit pool (k_cache / v_cache float8_e4m3fn or
// float8_e5m2, scales (Hkv,) float32), q and out float32 or bfloat16; lse (B, Hq) float32.
void decode_fp8(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& k_scale, const at::Tensor& v_scale, const Geometry& g,
                const Batch& batch, at::Tensor& out, at::Tensor& lse);

// paged_decode_fp8_amx.cpp: decode_fp8 for bf16 q on AMX-BF16 CPUs, head dims multiple of 64,
// at most 16 query heads per KV head; false (nothing done) where it does not apply.
bool decode_fp8_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& k_scale, const at::Tensor& v_scale, const Geometry& g,
                    const Batch& batch, at::Tensor& out, at::Tensor& lse);

// paged_decode_fp8_bf16.cpp: decode_fp8 for bf16 q on AVX512-BF16 + VBMI CPUs, head dims 64,
// 128 and 256; false (nothing done) where it does not apply.
bool decode_fp8_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& k_scale, const at::Tensor& v_scale, const Geometry& g,
                     const Batch& batch, at::Tensor& out, at::Tensor& lse);

// paged_decode_fp8_avx512.cpp: decode_fp8 on AVX-512 CPUs (fp32 or bf16 q), head dims 32, 64,
// 128 and 256; false (nothing done) where it does not apply.
bool decode_fp8_avx512(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& k_scale, const at::Tensor& v_scale, const Geometry& g,
                       const Batch& batch, at::Tensor& out, at::Tensor& lse);

}  // namespace radixserve_decode
