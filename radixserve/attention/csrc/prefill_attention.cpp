// Causal prefill attention on CPU: one request's chunk of new tokens attends to its cached
// prefix (read in place from the paged KV pool through its slots) and causally to itself.
//
// Registered as torch.ops.radixserve.prefill_attention; radixserve/attention/cpu_kernels.py
// builds it (with paged_decode.cpp, one extension) and owns the reference semantics
// (prefill_attention_reference there).
//
// Shapes: q (M, Hq, D), k/v (M, Hkv, D): the chunk's tokens, any token/head strides with D
// contiguous; k_cache/v_cache (S, Hkv, D) with (Hkv, D) rows contiguous; prefix_slots (P,)
// int32 (P may be 0). Key index space: [0, P) the prefix, [P, P + M) the chunk; query i sees
// keys [0, P + i]. Query head h reads KV head h / (Hq / Hkv). Returns out (M, Hq, D) in q's
// dtype and lse (M, Hq) float32 (scores scaled, natural log).
//
// Scheme (flash attention, fp32 accumulation): per KV head, K is converted once into a
// transposed fp32 matrix Kt (D, Lpad) and V into (Lpad, D); tasks are (KV head, block of BQ
// queries), each holding its G query heads x BQ queries as rows, walking key blocks of BK with
// an online softmax. Key blocks entirely after the block's last query are never touched; only
// the diagonal blocks look at the mask. Q.K^T is a broadcast-FMA over BK keys (Kt's rows are
// contiguous in keys), P.V a broadcast-FMA over D, 4 rows at a time so gcc keeps the
// accumulators in registers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define RS_PREFILL_BF16_DOT 1
#else
#define RS_PREFILL_BF16_DOT 0
#endif

namespace {

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

inline float to_f(float x) { return x; }
inline float to_f(at::BFloat16 x) { return static_cast<float>(x); }

// s[r][j] = sum_d q[r][d] * kt[d][j] for RQK rows and BK keys; s's rows W apart.
template <int64_t D, int64_t W>
inline void qk_rows(const float* q, const float* kt, int64_t lk, float* s) {
  float acc[RQK][BK] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float* kr = kt + d * lk;
    for (int64_t r = 0; r < RQK; ++r) {
      const float a = q[r * D + d];
#pragma omp simd
      for (int64_t j = 0; j < BK; ++j) acc[r][j] += a * kr[j];
    }
  }
  for (int64_t r = 0; r < RQK; ++r)
    for (int64_t j = 0; j < BK; ++j) s[r * W + j] = acc[r][j];
}

// o[r][:] += sum_{j < W} p[r][j] * v[j][:] for RQK rows (p is zero past a row's visible
// keys, V's rows past the last key are zeros: a fixed trip count the compiler unrolls), in
// column strips of 32: 8 x 32 accumulators = 16 zmm, the same shape as qk_rows.
template <int64_t D, int64_t W>
inline void pv_rows(const float* p, const float* v, float* o) {
  constexpr int64_t C = D < 32 ? D : 32;
  for (int64_t c = 0; c < D; c += C) {
    float acc[RQK][C];
    for (int64_t r = 0; r < RQK; ++r)
      for (int64_t e = 0; e < C; ++e) acc[r][e] = o[r * D + c + e];
    for (int64_t j = 0; j < W; ++j) {
      const float* vr = v + j * D + c;
      for (int64_t r = 0; r < RQK; ++r) {
        const float a = p[r * W + j];
#pragma omp simd
        for (int64_t e = 0; e < C; ++e) acc[r][e] += a * vr[e];
      }
    }
    for (int64_t r = 0; r < RQK; ++r)
      for (int64_t e = 0; e < C; ++e) o[r * D + c + e] = acc[r][e];
  }
}

// Online softmax of one row's W scores s (its first `vis` keys visible) against the running
// max m and sum l; writes the probabilities into s (zeros where masked) and returns the factor
// for o. Fixed-size loops: no remainders. exp's argument is clamped at -80 (e^-80 ~ 2e-35,
// nothing next to the row's max of 1): below the normal range the vector exp falls back to a
// slow scalar path per lane.
template <int64_t W>
inline float softmax_row(float* s, int64_t vis, float& m, float& l) {
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
  const float dm = m - mx;
  const float alpha = std::exp(dm > -80.f ? dm : -80.f);
  l = l * alpha + sum;
  m = mx;
  return alpha;
}

struct Shape {
  int64_t m, p, hq, hkv, g, lpad;
  float scale;
};

// Where key / value row t (of the P + M keys, then padding) of KV head h lives: the prefix in
// the pool through its slot, then the chunk's own k / v; nullptr for padding rows.
template <typename T>
struct KVRows {
  const T *k, *v, *kc, *vc;
  int64_t sk0, sk1, sv0, sv1, skc, svc;
  const int32_t* slots;

  static KVRows of(const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
                   const at::Tensor& vc, const at::Tensor& slots) {
    auto p = [](const at::Tensor& t) { return static_cast<const T*>(t.data_ptr()); };
    return {p(k), p(v), p(kc), p(vc), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            kc.stride(0), vc.stride(0), slots.data_ptr<int32_t>()};
  }

  std::pair<const T*, const T*> rows(int64_t t, int64_t h, int64_t d, const Shape& sh) const {
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

// One block of W keys from k0 for the task's rows: scores, online softmax, P.V into o.
template <int64_t D, int64_t W>
void key_block(const float* qf, const float* kt, const float* vf, const Shape& sh, int64_t q0,
               int64_t used, int64_t rows, int64_t k0, float* s, float* o, float* mrow,
               float* lrow) {
  const int64_t kn = std::min(W, sh.p + q0 + (used + sh.g - 1) / sh.g - k0);
  for (int64_t r = 0; r < rows; r += RQK)
    for (int64_t c = 0; c < W; c += BK)
      qk_rows<D, W>(qf + r * D, kt + k0 + c, sh.lpad, s + r * W + c);
  for (int64_t r = 0; r < rows; ++r) {
    // visible keys of this row in the block: up to key p + q0 + i inclusive
    const int64_t vis = r < used ? std::min(kn, sh.p + q0 + r / sh.g + 1 - k0) : 0;
    float* sr = s + r * W;
    if (vis <= 0) {  // nothing visible (padding rows, or a diagonal block past the query)
      std::fill(sr, sr + W, 0.f);
      continue;
    }
    const float alpha = softmax_row<W>(sr, vis, mrow[r], lrow[r]);
    if (alpha != 1.f) {
      float* orow = o + r * D;
#pragma omp simd
      for (int64_t e = 0; e < D; ++e) orow[e] *= alpha;
    }
  }
  for (int64_t r = 0; r < rows; r += RQK) pv_rows<D, W>(s + r * W, vf + k0 * D, o + r * D);
}

// One task: KV head h, queries [q0, q0 + nq). Rows r = i * g + gi (gi: head in the group),
// padded to a multiple of RQK with zero queries that see nothing.
template <int64_t D, typename T>
void attend_task(const T* q, int64_t sq0, int64_t sq1, const float* kt, const float* vf,
                 const Shape& sh, int64_t h, int64_t q0, int64_t nq, T* out, float* lse,
                 std::vector<float>& work) {
  const int64_t used = nq * sh.g, rows = (used + RQK - 1) / RQK * RQK;
  work.resize(rows * (2 * D + BIG + 2));
  float* qf = work.data();
  float* o = qf + rows * D;
  float* s = o + rows * D;
  float* mrow = s + rows * BIG;
  float* lrow = mrow + rows;
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = qf + r * D;
    if (r < used) {
      const T* src = q + (q0 + r / sh.g) * sq0 + (h * sh.g + r % sh.g) * sq1;
      for (int64_t e = 0; e < D; ++e) dst[e] = to_f(src[e]) * sh.scale;
    } else {
      for (int64_t e = 0; e < D; ++e) dst[e] = 0.f;
    }
  }
  std::fill(o, o + rows * D, 0.f);
  std::fill(mrow, mrow + rows, NEG);
  std::fill(lrow, lrow + rows, 0.f);
  const int64_t full = sh.p + q0;       // keys every query of the task sees
  const int64_t kend = sh.p + q0 + nq;  // keys the block's last query sees
  int64_t k0 = 0;
  for (; k0 + BIG <= full; k0 += BIG)
    key_block<D, BIG>(qf, kt, vf, sh, q0, used, rows, k0, s, o, mrow, lrow);
  for (; k0 < kend; k0 += BK) key_block<D, BK>(qf, kt, vf, sh, q0, used, rows, k0, s, o, mrow, lrow);
  for (int64_t r = 0; r < used; ++r) {
    const int64_t i = r / sh.g, head = h * sh.g + r % sh.g;
    const float inv = 1.f / lrow[r];
    T* dst = out + ((q0 + i) * sh.hq + head) * D;
    for (int64_t e = 0; e < D; ++e) dst[e] = static_cast<T>(o[r * D + e] * inv);
    lse[(q0 + i) * sh.hq + head] = mrow[r] + std::log(lrow[r]);
  }
}

// Kt (Hkv, D, Lpad) and V (Hkv, Lpad, D) in fp32: the prefix from the pool, then the chunk.
template <int64_t D, typename T>
void convert_kv(const KVRows<T>& src, const Shape& sh, float* kt, float* vf) {
  at::parallel_for(0, sh.hkv, 1, [&](int64_t hb, int64_t he) {
    for (int64_t h = hb; h < he; ++h) {
      float* kth = kt + h * D * sh.lpad;
      float* vh = vf + h * sh.lpad * D;
      for (int64_t t = 0; t < sh.lpad; ++t) {
        const auto [kr, vr] = src.rows(t, h, D, sh);
        for (int64_t e = 0; e < D; ++e) {
          kth[e * sh.lpad + t] = kr ? to_f(kr[e]) : 0.f;
          vh[t * D + e] = vr ? to_f(vr[e]) : 0.f;
        }
      }
    }
  });
}

template <int64_t D, typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
         const at::Tensor& vc, const at::Tensor& slots, const Shape& sh, at::Tensor& out,
         at::Tensor& lse) {
  std::vector<float> kt(sh.hkv * D * sh.lpad), vf(sh.hkv * sh.lpad * D);
  convert_kv<D, T>(KVRows<T>::of(k, v, kc, vc, slots), sh, kt.data(), vf.data());
  const T* qp = static_cast<const T*>(q.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  float* lp = lse.data_ptr<float>();
  for_each_task(sh, [&](int64_t h, int64_t q0, int64_t nq, std::vector<float>& work) {
    attend_task<D, T>(qp, q.stride(0), q.stride(1), kt.data() + h * D * sh.lpad,
                      vf.data() + h * sh.lpad * D, sh, h, q0, nq, op, lp, work);
  });
}

#if RS_PREFILL_BF16_DOT
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
      for (int64_t t = 0; t < sh.lpad; ++t) {
        const auto [kr, vr] = src.rows(t, h, D, sh);
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
    const int64_t vis = r < used ? std::min(kn, sh.p + q0 + r / sh.g + 1 - k0) : 0;
    float* sr = s + r * W;
    if (vis <= 0) {
      std::fill(sr, sr + W, 0.f);
    } else {
      const float alpha = softmax_row<W>(sr, vis, mrow[r], lrow[r]);
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
  int64_t k0 = 0;
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

template <int64_t D>
void run_dot(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
             const at::Tensor& vc, const at::Tensor& slots, const Shape& sh, at::Tensor& out,
             at::Tensor& lse) {
  std::vector<word> kp(sh.hkv * (D / 2) * sh.lpad), vp(sh.hkv * (sh.lpad / 2) * D);
  convert_kv_pairs<D>(KVRows<uint16_t>::of(k, v, kc, vc, slots), sh, kp.data(),
                      reinterpret_cast<uint16_t*>(vp.data()));
  const uint16_t* qp = static_cast<const uint16_t*>(q.data_ptr());
  uint16_t* op = static_cast<uint16_t*>(out.data_ptr());
  float* lp = lse.data_ptr<float>();
  for_each_task(sh, [&](int64_t h, int64_t q0, int64_t nq, std::vector<float>& work) {
    attend_task_dot<D>(qp, q.stride(0), q.stride(1), kp.data() + h * (D / 2) * sh.lpad,
                       vp.data() + h * (sh.lpad / 2) * D, sh, h, q0, nq, op, lp, work);
  });
}
#endif

template <int64_t D>
void dispatch_dtype(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& slots,
                    const Shape& sh, at::Tensor& out, at::Tensor& lse) {
  if (q.scalar_type() == at::kFloat) {
    run<D, float>(q, k, v, kc, vc, slots, sh, out, lse);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
#if RS_PREFILL_BF16_DOT
    return run_dot<D>(q, k, v, kc, vc, slots, sh, out, lse);  // head dims 32/64/128 only
#endif
    run<D, at::BFloat16>(q, k, v, kc, vc, slots, sh, out, lse);
  }
}

std::tuple<at::Tensor, at::Tensor> prefill_attention(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& prefix_slots, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 3 &&
                  v_cache.dim() == 3, "bad ranks");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && k_cache.device().is_cpu(),
              "CPU tensors only");
  for (const at::Tensor* t : {&k, &v, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "q, k, v and the caches must share a dtype");
  const int64_t m = q.size(0), hq = q.size(1), d = q.size(2), hkv = k.size(1);
  TORCH_CHECK(m >= 1 && k.size(0) == m && v.size(0) == m, "q, k, v: the same token count");
  TORCH_CHECK(hkv >= 1 && hq % hkv == 0 && v.size(1) == hkv && k.size(2) == d && v.size(2) == d &&
                  k_cache.size(1) == hkv && v_cache.size(1) == hkv && k_cache.size(2) == d &&
                  v_cache.size(2) == d, "head counts / head_dim mismatch");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "D must be contiguous");
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1 && k_cache.stride(1) == d &&
                  v_cache.stride(1) == d, "k_cache / v_cache rows must be (Hkv, D) contiguous");
  TORCH_CHECK(prefix_slots.dim() == 1 && prefix_slots.scalar_type() == at::kInt,
              "prefix_slots: 1-D int32");
  const at::Tensor slots = prefix_slots.contiguous();
  const int64_t p = slots.numel();
  const int32_t* sp = slots.data_ptr<int32_t>();
  for (int64_t t = 0; t < p; ++t)
    TORCH_CHECK(0 <= sp[t] && sp[t] < k_cache.size(0) && sp[t] < v_cache.size(0), "bad slot");
  const Shape sh{m, p, hq, hkv, hq / hkv, (p + m + BK - 1) / BK * BK, static_cast<float>(scale)};
  at::Tensor out = at::empty({m, hq, d}, q.options());
  at::Tensor lse = at::empty({m, hq}, q.options().dtype(at::kFloat));
  switch (d) {
    case 64: dispatch_dtype<64>(q, k, v, k_cache, v_cache, slots, sh, out, lse); break;
    case 128: dispatch_dtype<128>(q, k, v, k_cache, v_cache, slots, sh, out, lse); break;
    case 32: dispatch_dtype<32>(q, k, v, k_cache, v_cache, slots, sh, out, lse); break;
    default: TORCH_CHECK(false, "head_dim must be 32, 64 or 128");
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def(
      "prefill_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, "
      "Tensor prefix_slots, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
