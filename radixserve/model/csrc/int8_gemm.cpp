// Weight-only int8 GEMM on CPU for a few to some dozens of rows (batched decode):
//   y (M, N) = x (M, K) @ (q (N, K) int8 * scale (N,)).T,  fp32 accumulation, y in x's dtype.
//
// Registered as torch.ops.radixserve.int8_weight_gemm; radixserve/model/int8_kernel.py builds it
// and owns the reference semantics (int8_weight_gemm_reference there).
//
// The weight stays in its plain (N, K) layout (the one torch._int_mm and _weight_int8pack_mm
// also read: one copy in memory). Per call: x is rounded once to bf16 (M, Kp), Kp = K rounded
// up to 32, zero padded. Per tile of NT output channels: their int8 rows are widened once to
// bf16 in a small scratch (NT, Kp) (int8 -> fp32 -> bf16 is exact for |q| <= 127), then every
// MT-row tile of x is dotted with them along K (row-dot form: x and the weights are both
// contiguous in K, so no interleaving is needed): one fp32 accumulator vector per (row,
// channel), vdpbf16ps adding 32 products per instruction, reduced horizontally at the end and
// multiplied by the channel's scale. The widened tile is reused by all M rows.
//
// Without AVX512-BF16 (e.g. AVX2-only machines) the same tiling runs on an fp32 scratch with
// loops the compiler auto-vectorizes; results then differ from the bf16 path only in that x is
// not rounded to bf16 (more accurate, slower).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define RS_HAVE_BF16_DOT 1
#else
#define RS_HAVE_BF16_DOT 0
#endif

namespace {

constexpr int64_t KB = 32;  // K padding: one vdpbf16ps step (32 bf16 values)
constexpr int MT = 6;       // rows per micro tile (6 x 4 accumulators + 4 + 1: 29 zmm)
constexpr int NT = 4;       // output channels per micro tile (and per widened scratch)
constexpr int64_t MB = 96;  // rows per L2 block (a multiple of MT)

inline uint16_t bf16_bits(float f) {
  return c10::BFloat16(f).x;  // round to nearest even, as torch's .to(bfloat16)
}

#if RS_HAVE_BF16_DOT
using wtype = uint16_t;  // bf16 bits

// q (K int8) -> dst (Kp bf16), zero padded.
inline void widen_row(const int8_t* q, int64_t K, int64_t Kp, uint16_t* dst) {
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k))));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k + 16))));
    _mm512_storeu_si512(dst + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  for (; k < K; ++k) dst[k] = bf16_bits(static_cast<float>(q[k]));
  for (; k < Kp; ++k) dst[k] = 0;
}

// [sum(a), sum(b), sum(c), sum(d)]: four horizontal sums at once (a transposing add tree).
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // per 128-bit lane: ab = [a0+a2, b0+b2, a1+a3, b1+b3], cd likewise
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));  // [a,b,c,d] x4
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// out[r, c] = scale[c] * sum_k x[r, k] * w[c, k] for r < mt, c < nt; x rows and w rows Kp
// apart, out rows ldo apart.
template <int mt, int nt>
inline void micro(const uint16_t* x, const uint16_t* w, int64_t Kp, const float* scale,
                  float* out, int64_t ldo) {
  __m512 acc[mt][NT];
  for (int r = 0; r < mt; ++r)
    for (int c = 0; c < NT; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < Kp; k += KB) {
    __m512bh wv[nt];
    for (int c = 0; c < nt; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * Kp + k);
    for (int r = 0; r < mt; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * Kp + k);
      for (int c = 0; c < nt; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < mt; ++r) {
    const __m128 sums = reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);  // zeros past nt
    if constexpr (nt == NT) {
      _mm_storeu_ps(out + r * ldo, _mm_mul_ps(sums, _mm_loadu_ps(scale)));
    } else {
      alignas(16) float tmp[NT];
      _mm_store_ps(tmp, sums);
      for (int c = 0; c < nt; ++c) out[r * ldo + c] = tmp[c] * scale[c];
    }
  }
}
#else
using wtype = float;

inline void widen_row(const int8_t* q, int64_t K, int64_t Kp, float* dst) {
#pragma omp simd
  for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<float>(q[k]);
  for (int64_t k = K; k < Kp; ++k) dst[k] = 0.f;
}

template <int mt, int nt>
inline void micro(const float* x, const float* w, int64_t Kp, const float* scale, float* out,
                  int64_t ldo) {
  for (int r = 0; r < mt; ++r)
    for (int c = 0; c < nt; ++c) {
      float s = 0.f;
      const float* xr = x + r * Kp;
      const float* wc = w + c * Kp;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < Kp; ++k) s += xr[k] * wc[k];
      out[r * ldo + c] = s * scale[c];
    }
}
#endif

using MicroFn = void (*)(const wtype*, const wtype*, int64_t, const float*, float*, int64_t);

template <int mt, int... ns>
constexpr std::array<MicroFn, sizeof...(ns)> micro_row(std::integer_sequence<int, ns...>) {
  return {&micro<mt, ns + 1>...};
}

// kTable[mt - 1][nt - 1]: the micro kernel for an mt x nt tile (edges included).
template <int... ms>
constexpr std::array<std::array<MicroFn, NT>, sizeof...(ms)> micro_table(
    std::integer_sequence<int, ms...>) {
  return {micro_row<ms + 1>(std::make_integer_sequence<int, NT>{})...};
}

const auto kTable = micro_table(std::make_integer_sequence<int, MT>{});

// x (M, K) of T -> (M, Kp) of wtype, zero padded.
template <typename T>
std::vector<wtype> convert_x(const T* x, int64_t M, int64_t K, int64_t Kp) {
  std::vector<wtype> out(static_cast<size_t>(M * Kp), wtype{});
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      const float v = static_cast<float>(x[m * K + k]);
#if RS_HAVE_BF16_DOT
      out[m * Kp + k] = bf16_bits(v);
#else
      out[m * Kp + k] = v;
#endif
    }
  return out;
}

at::Tensor int8_weight_gemm(const at::Tensor& x, const at::Tensor& qweight,
                            const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && scale.dim() == 1, "bad ranks");
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu() && scale.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(qweight.scalar_type() == at::kChar, "qweight must be int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat, "scale must be float32");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K && scale.size(0) == N, "shape mismatch");
  const at::Tensor xc = x.contiguous(), qc = qweight.contiguous(), sc = scale.contiguous();
  at::Tensor yf = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return yf.to(x.scalar_type());
  const int64_t Kp = (K + KB - 1) / KB * KB;
  const std::vector<wtype> xw = x.scalar_type() == at::kFloat
                                    ? convert_x(xc.data_ptr<float>(), M, K, Kp)
                                    : convert_x(xc.data_ptr<at::BFloat16>(), M, K, Kp);
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* yp = yf.data_ptr<float>();
  const int64_t tiles = (N + NT - 1) / NT;
  // grain: enough channels per task that a task's widening and loop overhead is amortized
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    std::vector<wtype> wbuf(static_cast<size_t>(NT * Kp));
    // Rows in blocks of MB: a block of x (MB x Kp) stays in L2 while the task's channel tiles
    // pass over it; each tile is widened again per block (amortized over MB rows).
    for (int64_t b0 = 0; b0 < M; b0 += MB) {
      const int64_t b1 = std::min<int64_t>(M, b0 + MB);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * NT;
        const int nt = static_cast<int>(std::min<int64_t>(NT, N - n0));
        for (int c = 0; c < nt; ++c) widen_row(qp + (n0 + c) * K, K, Kp, wbuf.data() + c * Kp);
        for (int64_t m0 = b0; m0 < b1; m0 += MT) {
          const int mt = static_cast<int>(std::min<int64_t>(MT, b1 - m0));
          kTable[mt - 1][nt - 1](xw.data() + m0 * Kp, wbuf.data(), Kp, sp + n0,
                                 yp + m0 * N + n0, N);
        }
      }
    }
  });
  return x.scalar_type() == at::kFloat ? yf : yf.to(x.scalar_type());
}

bool int8_weight_gemm_uses_bf16() { return RS_HAVE_BF16_DOT; }

}  // namespace

// A fragment: the namespace's TORCH_LIBRARY is paged_decode.cpp's (a namespace has one).
TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("int8_weight_gemm(Tensor x, Tensor qweight, Tensor scale) -> Tensor");
  m.def("int8_weight_gemm_uses_bf16() -> bool", &int8_weight_gemm_uses_bf16);
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("int8_weight_gemm", &int8_weight_gemm); }
