// What the causal prefill kernels share (prefill_attention.cpp: the fp32-FMA path for float and
// bf16 inputs, the op and its checks; prefill_attention_bf16.cpp: bf16 inputs as vdpbf16ps dot
// products on AVX512-BF16 CPUs): block sizes, the problem's Shape, where a key / value row
// lives (KVRows, converting an 8-bit pool's prefix rows as they are read), the online softmax
// of one row and the task order.
//
// torch's extension loader hashes the sources, not this header: bump EXT_BASE in
// attention/cpu_kernels.py when it changes.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16_access.h"
#include "fp8_access.h"
#include "vec_math.h"
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define RS_PREFILL_BF16_DOT 1
#else
#define RS_PREFILL_BF16_DOT 0
#endif

namespace radixserve_prefill {

#if defined(__AVX512F__)
using radixserve_vec::exp_ps;
#endif

// The machine is FMA-bound here (a 516-token prompt's attention is ~1.2M (query, key) pairs per
// layer x 128 FMAs), so the block sizes are chosen to waste little on masked pairs: with
// BK = BQ a diagonal block is half masked, and only the diagonal blocks are.
constexpr int64_t BQ = 32;   // queries per task (per query head)
constexpr int64_t BK = 32;   // keys per block on the diagonal (and the Q.K^T strip width)
// Keys every query of the task sees (the prefix, earlier query blocks) go in blocks of BIG: one
// softmax pass (max, rescale of o) per 128 keys instead of per 32.
constexpr int64_t BIG = 128;
constexpr int64_t RQK = 8;   // rows per micro-kernel: 8 x 32 accumulators = 16 zmm
constexpr float NEG = -1e30f;  // "minus infinity": the file builds with -ffast-math

// Online softmax of one row's W scores s (its first `vis` keys visible) against the running
// max m and sum l; writes the probabilities into s (zeros where masked) and returns the factor
// for o. Fixed-size loops: no remainders. exp's argument is clamped at -80 (e^-80 ~ 2e-35,
// nothing next to the row's max of 1): below the normal range a vector exp falls back to a
// slow scalar path per lane.
template <int64_t W>
inline float softmax_row(float* s, int64_t vis, float& m, float& l) {
#if defined(__AVX512F__)
  static_assert(W % 16 == 0, "key blocks are whole vectors");
  __m512 vmax = _mm512_set1_ps(m);
  for (int64_t j = 0; j < W; j += 16) {
    const __mmask16 seen = vis - j >= 16 ? 0xFFFF : vis > j ? (1u << (vis - j)) - 1 : 0;
    vmax = _mm512_mask_max_ps(vmax, seen, vmax, _mm512_loadu_ps(s + j));
  }
  const float mx = _mm512_reduce_max_ps(vmax);
  const __m512 vmx = _mm512_set1_ps(mx), floor = _mm512_set1_ps(-80.f);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < W; j += 16) {
    const __mmask16 seen = vis - j >= 16 ? 0xFFFF : vis > j ? (1u << (vis - j)) - 1 : 0;
    const __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), vmx), floor);
    const __m512 e = _mm512_maskz_mov_ps(seen, exp_ps(x));
    _mm512_storeu_ps(s + j, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  const float sum = _mm512_reduce_add_ps(vsum);
#else
  float mx = m;
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < W; ++j) mx = (j < vis && s[j] > mx) ? s[j] : mx;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < W; ++j) {
    const float x = s[j] - mx;
    const float e = std::exp(x > -80.f ? x : -80.f);
    s[j] = j < vis ? e : 0.f;
    sum += s[j];
  }
#endif
  const float dm = m - mx;
  const float alpha = std::exp(dm > -80.f ? dm : -80.f);
  l = l * alpha + sum;
  m = mx;
  return alpha;
}

struct Shape {
  int64_t m, p, hq, hkv, g, lpad;
  float scale;
  // An 8-bit pool's scales (Hkv,) for the prefix rows; null when the caches are in q's dtype.
  const float *k_scale, *v_scale;
  int64_t window = 0;   // > 0: query at key index i sees keys [i - window + 1, i] only
  float softcap = 0.f;  // > 0: scores s become softcap * tanh(s / softcap) before the softmax
};

// The first key block (a multiple of BK) a task whose first query is chunk token q0 reads:
// 0, or with a window the block holding that query's first visible key (later queries'
// windows start later; keys before are never touched).
inline int64_t first_key_block(const Shape& sh, int64_t q0) {
  if (sh.window <= 0) return 0;
  const int64_t lo = sh.p + q0 - sh.window + 1;
  return lo > 0 ? lo / BK * BK : 0;
}

// A row's W scores s of the block from key k0, its keys [0, vis) visible causally, for a query
// at key index `query`: soft-capped, the keys before its window masked, then folded into the
// online softmax (softmax_row). Returns false (s zeroed, m and l untouched) where nothing of the
// block is visible to it, else sets alpha, o's factor. The one place both prefill kernels apply
// the window and the cap.
template <int64_t W>
inline bool softmax_row_limited(const Shape& sh, float* s, int64_t k0, int64_t query,
                                int64_t vis, float& m, float& l, float& alpha) {
  const int64_t lo = sh.window > 0 ? std::max<int64_t>(0, query - sh.window + 1 - k0) : 0;
  if (vis <= lo) {
    std::fill(s, s + W, 0.f);
    return false;
  }
  if (sh.softcap > 0.f) {
    const float inv = 1.f / sh.softcap;
    for (int64_t j = 0; j < W; ++j) s[j] = sh.softcap * std::tanh(s[j] * inv);
  }
  std::fill(s, s + lo, NEG);  // e^-80 each in the row's sum (its max's term is 1): nothing
  alpha = softmax_row<W>(s, vis, m, l);
  std::fill(s, s + lo, 0.f);
  return true;
}

// One 8-bit row (d codes) -> T values: code value times the row's scale, rounded once to T (as
// kv_quant.dequantize to q's dtype does). T: float, at::BFloat16, or bf16 bits (uint16_t).
template <typename T>
void fp8_row(const uint8_t* src, int64_t d, float scale, bool e4m3, T* dst) {
  using radixserve_fp8::Format;
  using radixserve_fp8::to_float;
  for (int64_t e = 0; e < d; ++e) {
    const float x =
        (e4m3 ? to_float<Format::E4M3>(src[e]) : to_float<Format::E5M2>(src[e])) * scale;
    if constexpr (std::is_same_v<T, uint16_t>) {
      radixserve_bf16::st(dst, e, x);
    } else {
      dst[e] = static_cast<T>(x);
    }
  }
}

// Where key / value row t (of the P + M keys, then padding) of KV head h lives: the prefix in
// the pool through its slot, then the chunk's own k / v; nullptr for padding rows. An 8-bit
// pool's prefix rows are converted into the caller's buffers kb, vb (D values each).
template <typename T>
struct KVRows {
  const T *k, *v, *kc, *vc;
  int64_t sk0, sk1, sv0, sv1, skc, svc;
  const int32_t* slots;
  const uint8_t *kc8, *vc8;  // an 8-bit pool (then kc, vc are unused)
  const float *k_scale, *v_scale;
  bool e4m3;

  static KVRows of(const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
                   const at::Tensor& vc, const at::Tensor& slots, const Shape& sh) {
    auto p = [](const at::Tensor& t) { return static_cast<const T*>(t.data_ptr()); };
    auto b = [&sh](const at::Tensor& t) {
      return sh.k_scale ? static_cast<const uint8_t*>(t.data_ptr()) : nullptr;
    };
    return {p(k), p(v), sh.k_scale ? nullptr : p(kc), sh.k_scale ? nullptr : p(vc),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), kc.stride(0), vc.stride(0),
            slots.data_ptr<int32_t>(), b(kc), b(vc), sh.k_scale, sh.v_scale,
            kc.scalar_type() == at::kFloat8_e4m3fn};
  }

  std::pair<const T*, const T*> rows(int64_t t, int64_t h, int64_t d, const Shape& sh, T* kb,
                                     T* vb) const {
    if (t < sh.p && kc8 != nullptr) {
      fp8_row(kc8 + slots[t] * skc + h * d, d, k_scale[h], e4m3, kb);
      fp8_row(vc8 + slots[t] * svc + h * d, d, v_scale[h], e4m3, vb);
      return {kb, vb};
    }
    if (t < sh.p) return {kc + slots[t] * skc + h * d, vc + slots[t] * svc + h * d};
    if (t < sh.p + sh.m) return {k + (t - sh.p) * sk0 + h * sk1, v + (t - sh.p) * sv0 + h * sv1};
    return {nullptr, nullptr};
  }
};

// Tasks: (KV head, query block of BQ), fn(h, q0, nq, work) each. A query block's cost grows
// with its index (causal), and parallel_for hands each thread a contiguous range: the blocks
// go in the order last, first, second to last, second, ... so that every range mixes long and
// short ones. `work` is the thread's reusable scratch.
template <typename F>
void for_each_task(const Shape& sh, const F& fn) {
  const int64_t nqb = (sh.m + BQ - 1) / BQ;
  at::parallel_for(0, sh.hkv * nqb, 1, [&](int64_t tb, int64_t te) {
    std::vector<float> work;
    for (int64_t t = tb; t < te; ++t) {
      const int64_t u = t / sh.hkv, h = t % sh.hkv;
      const int64_t q0 = (u % 2 == 0 ? nqb - 1 - u / 2 : u / 2) * BQ;
      fn(h, q0, std::min(BQ, sh.m - q0), work);
    }
  });
}
#if RS_PREFILL_BF16_DOT
// prefill_attention_bf16.cpp (head dims 32, 64 and 128): out and lse as the op returns them.
template <int64_t D>
void run_dot(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
             const at::Tensor& vc, const at::Tensor& slots, const Shape& sh, at::Tensor& out,
             at::Tensor& lse);
extern template void run_dot<32>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const Shape&, at::Tensor&, at::Tensor&);
extern template void run_dot<64>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const Shape&, at::Tensor&, at::Tensor&);
extern template void run_dot<128>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const Shape&, at::Tensor&, at::Tensor&);
#endif

}  // namespace radixserve_prefill
