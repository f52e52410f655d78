// Weight-only int8 GEMM on CPU over a pre-packed weight, for any row count:
//   y (M, N) = x (M, K) @ (q (N, K) int8 * scale (N,)).T,  fp32 accumulation, y in x's dtype.
//
// Registered as torch.ops.radixserve.int8_packed_gemm; radixserve/model/int8_kernel.py packs
// the weight (pack_int8_weight) and owns the reference semantics.
//
// Packed layout, made once at load time: (NB, Kp / 2, 16, 2) int8, NB = ceil(N / 16), Kp = K
// rounded up to even, zero padded: block b holds channels 16b..16b+15, and for every pair of
// inputs (2p, 2p+1) their 16 x 2 weights side by side. That is vdpbf16ps's operand order: one
// zmm of bf16 pairs times a broadcast pair of x gives 16 channels' partial dot products, so
// the kernel is the classic outer-product GEMM (accumulators are output tiles; no horizontal
// sums, x never repacked). Per task: a panel of NR blocks (NR * 16 channels) is widened once
// to bf16 (exact for |q| <= 127) into a scratch that every MR-row tile of x then reuses; the
// channel scale is applied when a tile is stored.
//
// Without AVX512-BF16 the same panels are widened to fp32, de-interleaved (Kp, NR * 16), and
// a plain broadcast-FMA loop the compiler vectorizes does the rest (x not rounded to bf16).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define RS_PACKED_BF16 1
#else
#define RS_PACKED_BF16 0
#endif

namespace {

constexpr int CB = 16;       // channels per packed block (one zmm of fp32 outputs)
constexpr int MR = 8;        // rows per micro tile: MR x NR accumulators (24) + NR + 1 zmm
constexpr int NR = 3;        // blocks per panel
constexpr int64_t MB = 128;  // rows per L2 block (a multiple of MR)
enum Mode { kRead, kWiden, kWidenStore };  // where a micro tile's weights come from

#if RS_PACKED_BF16
using wtype = uint16_t;  // bf16 bits; the panel is (Kp / 2, NR, 32): pairs of 16 channels

inline __m512bh widen32(const int8_t* q) {  // 32 int8 -> 32 bf16 (exact), order kept
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// out[r, 16c + j] = scale * sum_k x[r, k] w[k, 16c + j] for r < mr, c < nr; x rows Kp apart
// (bf16), out rows ldo apart; `valid` channels of the last block are stored (the rest is
// padding). Weights: kRead takes them from the widened panel `w`; kWiden widens them in
// registers straight from the packed int8 blocks `q` (`pairs` * 32 bytes apart); kWidenStore
// also writes them to `w` for the next row tiles (the first tile of several).
// `pf`: bytes to prefetch while computing (the next panel's int8, so that its widening does
// not wait on memory), 128 per pair step.
template <int mr, int nr, int mode>
inline void micro(const uint16_t* x, uint16_t* w, const int8_t* q, int64_t Kp,
                  const float* scale, float* out, int64_t ldo, int valid, const int8_t* pf,
                  int64_t pf_bytes) {
  __m512 acc[mr][nr];
  for (int r = 0; r < mr; ++r)
    for (int c = 0; c < nr; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t pairs = Kp / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    if (p * 128 < pf_bytes) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + p * 128), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pf + p * 128 + 64), _MM_HINT_T0);
    }
    __m512bh wv[nr];
    for (int c = 0; c < nr; ++c) {
      if constexpr (mode == kRead) {
        wv[c] = (__m512bh)_mm512_loadu_si512(w + (p * NR + c) * 32);
      } else {
        wv[c] = widen32(q + (c * pairs + p) * 32);
        if constexpr (mode == kWidenStore) _mm512_storeu_si512(w + (p * NR + c) * 32, (__m512i)wv[c]);
      }
    }
    for (int r = 0; r < mr; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * Kp + 2 * p, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < nr; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  for (int c = 0; c < nr; ++c) {
    const int n = c + 1 < nr ? CB : valid;
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(mask, scale + c * CB);
    for (int r = 0; r < mr; ++r)
      _mm512_mask_storeu_ps(out + r * ldo + c * CB, mask, _mm512_mul_ps(acc[r][c], s));
  }
}
#else
using wtype = float;  // the panel is (Kp, NR * 16): plain rows of channels

inline void widen_block(const int8_t* q, int64_t pairs, float* dst) {
  for (int64_t p = 0; p < pairs; ++p)
    for (int j = 0; j < CB; ++j) {
      dst[(2 * p) * NR * CB + j] = static_cast<float>(q[p * 32 + 2 * j]);
      dst[(2 * p + 1) * NR * CB + j] = static_cast<float>(q[p * 32 + 2 * j + 1]);
    }
}

template <int mr, int nr, int mode>  // the panel is always widened first here: kRead only
inline void micro(const float* x, float* w, const int8_t*, int64_t Kp, const float* scale,
                  float* out, int64_t ldo, int valid, const int8_t*, int64_t) {
  float acc[mr][nr * CB] = {};
  for (int64_t k = 0; k < Kp; ++k)
    for (int r = 0; r < mr; ++r) {
      const float xv = x[r * Kp + k];
#pragma omp simd
      for (int j = 0; j < nr * CB; ++j) acc[r][j] += xv * w[k * NR * CB + j];
    }
  const int n = (nr - 1) * CB + valid;
  for (int r = 0; r < mr; ++r)
    for (int j = 0; j < n; ++j) out[r * ldo + j] = acc[r][j] * scale[j];
}
#endif

using MicroFn = void (*)(const wtype*, wtype*, const int8_t*, int64_t, const float*, float*,
                        int64_t, int, const int8_t*, int64_t);

template <int mode, int mr, int... ns>
constexpr std::array<MicroFn, sizeof...(ns)> micro_row(std::integer_sequence<int, ns...>) {
  return {&micro<mr, ns + 1, mode>...};
}

// table[mr - 1][nr - 1]: the micro kernel for an mr x nr tile (edges included).
template <int mode, int... ms>
constexpr std::array<std::array<MicroFn, NR>, sizeof...(ms)> micro_table(
    std::integer_sequence<int, ms...>) {
  return {micro_row<mode, ms + 1>(std::make_integer_sequence<int, NR>{})...};
}

const std::array<std::array<std::array<MicroFn, NR>, MR>, 3> kTables = {
    micro_table<kRead>(std::make_integer_sequence<int, MR>{}),
    micro_table<kWiden>(std::make_integer_sequence<int, MR>{}),
    micro_table<kWidenStore>(std::make_integer_sequence<int, MR>{})};

// x (M, K) -> (M, Kp) of wtype, zero padded; rows in parallel (large prefill chunks).
template <typename T>
std::unique_ptr<wtype[]> convert_x(const T* x, int64_t M, int64_t K, int64_t Kp) {
  std::unique_ptr<wtype[]> out(new wtype[static_cast<size_t>(M * Kp)]);  // written below
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      wtype* dst = out.get() + m * Kp;
      const T* src = x + m * K;
      if (Kp > K) dst[K] = wtype{};  // the pad column (odd K): its weights are zero too
      if constexpr (RS_PACKED_BF16 && std::is_same_v<T, at::BFloat16>) {
        std::memcpy(dst, src, static_cast<size_t>(K) * 2);
      } else {
        for (int64_t k = 0; k < K; ++k) {
          const float v = static_cast<float>(src[k]);
#if RS_PACKED_BF16
          dst[k] = c10::BFloat16(v).x;  // round to nearest even, as torch's .to(bfloat16)
#else
          dst[k] = v;
#endif
        }
      }
    }
  });
  return out;
}

at::Tensor int8_packed_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                            int64_t N) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && scale.dim() == 1, "bad ranks");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && scale.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "packed must be contiguous int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "scale: fp32");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), Kp = 2 * packed.size(1);
  TORCH_CHECK(packed.size(2) == CB && packed.size(3) == 2, "packed: (NB, Kp / 2, 16, 2)");
  TORCH_CHECK(Kp == (K + 1) / 2 * 2 && NB == (N + CB - 1) / CB && scale.size(0) == N,
              "shape mismatch");
  const at::Tensor xc = x.contiguous();
  at::Tensor yf = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return yf.to(x.scalar_type());
  const std::unique_ptr<wtype[]> xw = x.scalar_type() == at::kFloat
                                          ? convert_x(xc.data_ptr<float>(), M, K, Kp)
                                          : convert_x(xc.data_ptr<at::BFloat16>(), M, K, Kp);
  const int8_t* qp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = yf.data_ptr<float>();
  const int64_t pairs = Kp / 2, panels = (NB + NR - 1) / NR;
  const int64_t panel_bytes = pairs * 32 * NR;
  // A widened panel is kept only for several row tiles (or the fp32 path, which always
  // widens first); every element read is written by that panel's widening first.
  const bool keeps_panel = !RS_PACKED_BF16 || M > MR;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<wtype[]> wbuf(keeps_panel ? new wtype[static_cast<size_t>(Kp * NR * CB)]
                                              : nullptr);
    // Rows in blocks of MB: a block of x stays in L2 while the task's panels pass over it;
    // each panel is widened again per block (amortized over MB rows).
    for (int64_t b0 = 0; b0 < M; b0 += MB) {
      const int64_t b1 = std::min<int64_t>(M, b0 + MB);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t blk0 = t * NR;
        const int nr = static_cast<int>(std::min<int64_t>(NR, NB - blk0));
        const int8_t* q = qp + blk0 * pairs * 32;
#if !RS_PACKED_BF16
        for (int c = 0; c < nr; ++c) widen_block(q + c * pairs * 32, pairs, wbuf.get() + c * CB);
#endif
        const int64_t n0 = blk0 * CB;
        const int valid = static_cast<int>(std::min<int64_t>(CB, N - (blk0 + nr - 1) * CB));
        // The first row tile widens the panel (keeping it for the others, if any) and
        // prefetches the task's next panel (none after the last).
        const int64_t pf_bytes = t + 1 < end ? panel_bytes : 0;
        for (int64_t m0 = b0; m0 < b1; m0 += MR) {
          const int mr = static_cast<int>(std::min<int64_t>(MR, b1 - m0));
          const int mode = !RS_PACKED_BF16 || m0 > b0 ? kRead : m0 + MR < b1 ? kWidenStore
                                                                             : kWiden;
          kTables[mode][mr - 1][nr - 1](xw.get() + m0 * Kp, wbuf.get(), q, Kp, sp + n0,
                                        yp + m0 * N + n0, N, valid, q + panel_bytes,
                                        m0 == b0 ? pf_bytes : 0);
        }
      }
    }
  });
  return x.scalar_type() == at::kFloat ? yf : yf.to(x.scalar_type());
}

bool int8_packed_gemm_uses_bf16() { return RS_PACKED_BF16; }

}  // namespace

// Each tier's build names its own op namespace (radixserve_<tier>: platform/kernels.py), so
// several tiers load side by side in one process.
#ifndef RADIXSERVE_OPS_NS
#define RADIXSERVE_OPS_NS radixserve
#endif
TORCH_LIBRARY_FRAGMENT(RADIXSERVE_OPS_NS, m) {
  m.def("int8_packed_gemm(Tensor x, Tensor packed, Tensor scale, int n) -> Tensor");
  m.def("int8_packed_gemm_uses_bf16() -> bool", &int8_packed_gemm_uses_bf16);
}

TORCH_LIBRARY_IMPL(RADIXSERVE_OPS_NS, CPU, m) { m.impl("int8_packed_gemm", &int8_packed_gemm); }
