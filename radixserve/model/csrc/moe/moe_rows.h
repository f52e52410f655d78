// The CPU MoE kernel's GEMM for a few rows per expert (a decode step): each weight row read
// front to back alone, so a thread's weight reads are one sequential stream, and `gemm_any`,
// which picks it or moe_tiles.h's micro tiles by the expert's row count. A build's name
// carries a digest of this header.
//
// Why: the micro tile reads 4 weight rows side by side (4 streams 1-2 KB apart, each only a
// row long), which the hardware prefetchers keep losing; at ~2 rows per expert the step is a
// pure stream of weights, and one row at a time (with the L2 prefetch ahead) read it ~1.25x
// faster on Zen 4 in 2 MB pages (bench/README.md, "Mixture of experts on CPU"). With many
// rows (prefill) the tile's 16 accumulators per weight load matter more: the tile runs.
// Each output is two vector accumulators (alternate steps) summed once; AVX-512 only:
// other tiers run the tile at every row count.
#pragma once

#include "moe_tiles.h"

namespace radixserve_moe {

constexpr int64_t STREAM_MAX_ROWS = 8;       // rows per expert at or below which rows stream
constexpr int64_t STREAM_PF_BYTES = 16384;   // prefetch distance along the stream

#if defined(__AVX512F__)
// out[r] = sum_k x[r][k] * w[k], r < mr: fp32 x, weights float / bf16 / int8 widened.
template <int mr, typename WT>
void dot_row(const float* const* x, const WT* w, int64_t K, int64_t pf, float* out) {
  __m512 a0[mr], a1[mr];
  for (int r = 0; r < mr; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {  // two steps, one per accumulator: no register indexing
    prefetch(w + k + pf);
    prefetch(w + k + 16 + pf);
    const __m512 w0 = load16(w + k), w1 = load16(w + k + 16);
    for (int r = 0; r < mr; ++r) {
      a0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x[r] + k), w0, a0[r]);
      a1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x[r] + k + 16), w1, a1[r]);
    }
  }
  for (; k < K; k += 16) {  // a last step, masked where K is not a multiple of 16
    const __mmask16 m = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
    const __m512 wv = load16(w + k, m);
    for (int r = 0; r < mr; ++r)
      a0[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x[r] + k), wv, a0[r]);
  }
  for (int r = 0; r < mr; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
}
#endif

#if defined(__AVX512BF16__)
// The same for bf16 x and bf16 weights: 32 bf16 pairs per vdpbf16ps.
template <int mr>
void dot_row(const bf16_t* const* x, const bf16_t* w, int64_t K, int64_t pf, float* out) {
  __m512 a0[mr], a1[mr];
  for (int r = 0; r < mr; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {  // two steps, one per accumulator
    prefetch(w + k + pf);
    prefetch(w + k + 32 + pf);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
    for (int r = 0; r < mr; ++r) {
      a0[r] = _mm512_dpbf16_ps(a0[r], (__m512bh)_mm512_loadu_si512(x[r] + k), w0);
      a1[r] = _mm512_dpbf16_ps(a1[r], (__m512bh)_mm512_loadu_si512(x[r] + k + 32), w1);
    }
  }
  for (; k < K; k += 32) {  // a last step or two, masked where K is not a multiple of 32
    const __mmask32 m = K - k >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << (K - k)) - 1);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + k);
    for (int r = 0; r < mr; ++r)
      a0[r] = _mm512_dpbf16_ps(a0[r], (__m512bh)_mm512_maskz_loadu_epi16(m, x[r] + k), wv);
  }
  for (int r = 0; r < mr; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
}
#endif

#if defined(__AVX512F__)
// gemm_rows' contract, each weight row streamed alone for all nrows (<= 2 * MR per pass
// over the row: the row stays in L1 for the second).
template <typename XT, typename WT>
void gemm_stream(const XT* const* rows, int64_t nrows, const WT* w, const float* scale,
                 int64_t nch, int64_t K, float* out, int64_t ldo) {
  const int64_t pf = STREAM_PF_BYTES / static_cast<int64_t>(sizeof(WT));
  float sums[MR];
  for (int64_t c = 0; c < nch; ++c) {
    const WT* wr = w + c * K;
    for (int64_t r0 = 0; r0 < nrows; r0 += MR) {
      const int mr = static_cast<int>(std::min<int64_t>(MR, nrows - r0));
      const int64_t d = r0 == 0 ? pf : 0;  // the first pass streams; later ones hit L1
      if (mr == 1) dot_row<1>(rows + r0, wr, K, d, sums);
      else if (mr == 2) dot_row<2>(rows + r0, wr, K, d, sums);
      else if (mr == 3) dot_row<3>(rows + r0, wr, K, d, sums);
      else dot_row<4>(rows + r0, wr, K, d, sums);
      const float sc = scale == nullptr ? 1.f : scale[c];  // x 1 is exact
      for (int r = 0; r < mr; ++r) out[(r0 + r) * ldo + c] = sums[r] * sc;
    }
  }
}
#endif

// out (nrows, nch) at stride ldo = rows @ W[0:nch].T (gemm_rows' contract): rows streamed
// one weight row at a time at a decode step's few rows per expert, else the micro tiles.
template <typename XT, typename WT>
void gemm_any(const XT* const* rows, int64_t nrows, const WT* w, const float* scale,
              int64_t nch, int64_t K, float* out, int64_t ldo) {
#if defined(__AVX512F__)
  if (nrows <= STREAM_MAX_ROWS) {
    gemm_stream(rows, nrows, w, scale, nch, K, out, ldo);
    return;
  }
#endif
  gemm_rows(rows, nrows, w, scale, nch, K, out, ldo);
}

}  // namespace radixserve_moe
