// Causal prefill attention for bf16 inputs on CPUs with AVX512-BF16 (the op, its checks and the
// fp32-FMA path are prefill_attention.cpp's; shared pieces in prefill_common.h). Built into the
// same extension; without AVX512-BF16 this file compiles to nothing.
#include "prefill_common.h"

#if RS_PREFILL_BF16_DOT
namespace radixserve_prefill {
namespace {

// bf16 inputs on a CPU with AVX512-BF16: Q.K^T and P.V as vdpbf16ps (32 bf16 products into 16
// fp32 lanes per instruction, twice the fp32 FMA's work), fp32 accumulation. Operands go in
// pairs along the reduction: Q's rows as they are (a row's (d, d+1) values are one 32-bit
// word, broadcast), K as Kp (Hkv, D/2, Lpad) words (key j's (d, d+1) at [d/2][j]), V as Vp
// (Hkv, Lpad/2, D) words (keys (j, j+1)'s value e at [j/2][e]); P is rounded to bf16 after the
// fp32 softmax (its row sums stay fp32), as flash attention does on GPUs. Q and K are used
// exactly (bf16 already), the scale is applied to the fp32 scores.
using word = uint32_t;

template <int64_t D>
void convert_kv_pairs(const KVRows<uint16_t>& src, const Shape& sh, word* kp, uint16_t* vp) {
  at::parallel_for(0, sh.hkv, 1, [&](int64_t hb, int64_t he) {
    for (int64_t h = hb; h < he; ++h) {
      word* kh = kp + h * (D / 2) * sh.lpad;
      uint16_t* vh = vp + h * sh.lpad * D;  // (Lpad/2, D, 2) halves
      uint16_t kb[D], vb[D];  // an 8-bit prefix row, converted
      for (int64_t t = 0; t < sh.lpad; ++t) {
        const auto [kr, vr] = src.rows(t, h, D, sh, kb, vb);
        for (int64_t dp = 0; dp < D / 2; ++dp)
          kh[dp * sh.lpad + t] = kr ? (word(kr[2 * dp]) | word(kr[2 * dp + 1]) << 16) : 0u;
        uint16_t* vdst = vh + (t / 2) * D * 2 + t % 2;
        for (int64_t e = 0; e < D; ++e) vdst[2 * e] = vr ? vr[e] : uint16_t(0);
      }
    }
  });
}

// s[r][j] = scale * sum_d q[r][d] * k[j][d] for RQK rows and BK keys (two zmm of keys).
template <int64_t D, int64_t W>
inline void qk_rows_dot(const word* q, const word* kp, int64_t lk, float scale, float* s) {
  __m512 acc[RQK][2];
  for (int64_t r = 0; r < RQK; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t dp = 0; dp < D / 2; ++dp) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + dp * lk);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + dp * lk + 16);
    for (int64_t r = 0; r < RQK; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * (D / 2) + dp]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, k1);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < RQK; ++r) {
    _mm512_storeu_ps(s + r * W, _mm512_mul_ps(acc[r][0], sc));
    _mm512_storeu_ps(s + r * W + 16, _mm512_mul_ps(acc[r][1], sc));
  }
}

// o[r][:] += sum_{j < W} p[r][j] * v[j][:] for RQK rows; p as bf16 rows of W (pairs = words).
template <int64_t D, int64_t W>
inline void pv_rows_dot(const word* p, const word* vp, float* o) {
  for (int64_t c = 0; c < D; c += 32) {
    __m512 acc[RQK][2];
    for (int64_t r = 0; r < RQK; ++r) {
      acc[r][0] = _mm512_loadu_ps(o + r * D + c);
      acc[r][1] = _mm512_loadu_ps(o + r * D + c + 16);
    }
    for (int64_t jp = 0; jp < W / 2; ++jp) {
      const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vp + jp * D + c);
      const __m512bh v1 = (__m512bh)_mm512_loadu_si512(vp + jp * D + c + 16);
      for (int64_t r = 0; r < RQK; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[r * (W / 2) + jp]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, v0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, v1);
      }
    }
    for (int64_t r = 0; r < RQK; ++r) {
      _mm512_storeu_ps(o + r * D + c, acc[r][0]);
      _mm512_storeu_ps(o + r * D + c + 16, acc[r][1]);
    }
  }
}

template <int64_t D, int64_t W>
void key_block_dot(const word* qb, const word* kp, const word* vp, const Shape& sh, int64_t q0,
                   int64_t used, int64_t rows, int64_t k0, float* s, word* pb, float* o,
                   float* mrow, float* lrow) {
  const int64_t kn = std::min(W, sh.p + q0 + (used + sh.g - 1) / sh.g - k0);
  for (int64_t r = 0; r < rows; r += RQK)
    for (int64_t c = 0; c < W; c += BK)
      qk_rows_dot<D, W>(qb + r * (D / 2), kp + k0 + c, sh.lpad, sh.scale, s + r * W + c);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t query = sh.p + q0 + r / sh.g;
    const int64_t vis = r < used ? std::min(kn, query + 1 - k0) : 0;
    float* sr = s + r * W;
    float alpha = 1.f;
    if (softmax_row_limited<W>(sh, sr, k0, query, vis, mrow[r], lrow[r], alpha)) {
      if (alpha != 1.f) {
        float* orow = o + r * D;
#pragma omp simd
        for (int64_t e = 0; e < D; ++e) orow[e] *= alpha;
      }
    }
    word* pr = pb + r * (W / 2);
    for (int64_t j = 0; j < W; j += 32)  // 32 probabilities -> 32 bf16, in order
      _mm512_storeu_si512(pr + j / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sr + j + 16),
                                                                  _mm512_loadu_ps(sr + j)));
  }
  for (int64_t r = 0; r < rows; r += RQK)
    pv_rows_dot<D, W>(pb + r * (W / 2), vp + (k0 / 2) * D, o + r * D);
}

template <int64_t D>
void attend_task_dot(const uint16_t* q, int64_t sq0, int64_t sq1, const word* kp, const word* vp,
                     const Shape& sh, int64_t h, int64_t q0, int64_t nq, uint16_t* out,
                     float* lse, std::vector<float>& work) {
  const int64_t used = nq * sh.g, rows = (used + RQK - 1) / RQK * RQK;
  // floats: o (rows, D), s (rows, BIG), m, l; then words: q (rows, D/2), p (rows, BIG/2)
  work.resize(rows * (D + BIG + 2) + rows * (D / 2 + BIG / 2));
  float* o = work.data();
  float* s = o + rows * D;
  float* mrow = s + rows * BIG;
  float* lrow = mrow + rows;
  word* qb = reinterpret_cast<word*>(lrow + rows);
  word* pb = qb + rows * (D / 2);
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* dst = reinterpret_cast<uint16_t*>(qb + r * (D / 2));
    const uint16_t* src = r < used ? q + (q0 + r / sh.g) * sq0 + (h * sh.g + r % sh.g) * sq1
                                   : nullptr;
    for (int64_t e = 0; e < D; ++e) dst[e] = src ? src[e] : uint16_t(0);
  }
  std::fill(o, o + rows * D, 0.f);
  std::fill(mrow, mrow + rows, NEG);
  std::fill(lrow, lrow + rows, 0.f);
  const int64_t full = sh.p + q0, kend = sh.p + q0 + nq;
  int64_t k0 = first_key_block(sh, q0);
  for (; k0 + BIG <= full; k0 += BIG)
    key_block_dot<D, BIG>(qb, kp, vp, sh, q0, used, rows, k0, s, pb, o, mrow, lrow);
  for (; k0 < kend; k0 += BK)
    key_block_dot<D, BK>(qb, kp, vp, sh, q0, used, rows, k0, s, pb, o, mrow, lrow);
  for (int64_t r = 0; r < used; ++r) {
    const int64_t i = r / sh.g, head = h * sh.g + r % sh.g;
    const float inv = 1.f / lrow[r];
    at::BFloat16* dst = reinterpret_cast<at::BFloat16*>(out) + ((q0 + i) * sh.hq + head) * D;
    for (int64_t e = 0; e < D; ++e) dst[e] = static_cast<at::BFloat16>(o[r * D + e] * inv);
    lse[(q0 + i) * sh.hq + head] = mrow[r] + std::log(lrow[r]);
  }
}

}  // namespace

template <int64_t D>
void run_dot(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
             const at::Tensor& vc, const at::Tensor& slots, const Shape& sh, at::Tensor& out,
             at::Tensor& lse) {
  std::vector<word> kp(sh.hkv * (D / 2) * sh.lpad), vp(sh.hkv * (sh.lpad / 2) * D);
  convert_kv_pairs<D>(KVRows<uint16_t>::of(k, v, kc, vc, slots, sh), sh, kp.data(),
                      reinterpret_cast<uint16_t*>(vp.data()));
  const uint16_t* qp = static_cast<const uint16_t*>(q.data_ptr());
  uint16_t* op = static_cast<uint16_t*>(out.data_ptr());
  float* lp = lse.data_ptr<float>();
  for_each_task(sh, [&](int64_t h, int64_t q0, int64_t nq, std::vector<float>& work) {
    attend_task_dot<D>(qp, q.stride(0), q.stride(1), kp.data() + h * (D / 2) * sh.lpad,
                       vp.data() + h * (sh.lpad / 2) * D, sh, h, q0, nq, op, lp, work);
  });
}

template void run_dot<32>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&, const Shape&,
                          at::Tensor&, at::Tensor&);
template void run_dot<64>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&, const Shape&,
                          at::Tensor&, at::Tensor&);
template void run_dot<128>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, const Shape&,
                           at::Tensor&, at::Tensor&);

}  // namespace radixserve_prefill
#endif
