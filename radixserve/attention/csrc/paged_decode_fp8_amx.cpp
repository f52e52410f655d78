// Paged decode attention over an 8-bit KV pool for bf16 queries on CPUs with AMX-BF16 (head
// dims multiple of 64, at most 16 query heads per KV head): decode_fp8_amx, which
// paged_decode_fp8.cpp tries first. Without AMX (or where the kernel refuses this process the
// tile state) it declines and the AVX-512 path (paged_decode_fp8_avx512.cpp) runs instead.
//
// Per request: the rows are converted to bf16 in L1 by table lookups (exact, fp8_access.h);
// Q.K^T is one tile product per 16 keys and 32 dims (A: the keys' rows as stored, B: the
// group's queries transposed into pairs), written as scores (key, head); the softmax runs
// over keys with the heads in vector lanes, its bf16 probabilities transposed into rows per
// head; P.V is one tile product per 32 keys and 16 dims (A: the group's probabilities, B: the
// values as (key, next key) pairs). The tile unit does the multiply-adds, the vector units
// only the conversions and the softmax.
// P is rounded to bf16 after the fp32 softmax, as there.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bf16_access.h"
#include "decode_common.h"
#include "fp8_access.h"

#if RS_FP8_BF16_LUT && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define RS_FP8_AMX 1
#else
#define RS_FP8_AMX 0
#endif

namespace radixserve_decode {

#if RS_FP8_AMX
namespace {

using namespace radixserve_fp8;  // NOLINT: the 8-bit format's vocabulary
using radixserve_bf16::bf16_t;

constexpr int64_t BK = 16;  // keys per Q.K^T product (A's rows)
constexpr int64_t BV = 32;  // keys per P.V product (A's columns, in pairs)

// Linux hands out the AMX tile state on request, once per process; "1" in
// RADIXSERVE_NO_AMX keeps the AVX-512 path (to compare, or test, the two).
bool amx_usable() {
  static const bool ok = [] {
    const char* off = std::getenv("RADIXSERVE_NO_AMX");
    if (off != nullptr && std::strcmp(off, "1") == 0) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// Tiles: 0-3 P.V accumulators (group x 16 dims), 4 P (group x 32 keys), 5 K (16 keys x 32
// dims) or V (16 key pairs x 16 dims), 6 q^T (16 dim pairs x group), 7 scores (16 x group).
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void configure_tiles(int64_t group) {
  TileConfig c{};
  c.palette = 1;
  const auto gr = static_cast<uint8_t>(group);
  const auto gb = static_cast<uint16_t>(4 * group);
  for (int t = 0; t < 5; ++t) c.rows[t] = gr, c.colsb[t] = 64;
  c.rows[5] = 16, c.colsb[5] = 64;
  c.rows[6] = 16, c.colsb[6] = gb;
  c.rows[7] = 16, c.colsb[7] = gb;
  _tile_loadconfig(&c);
}

inline int64_t score_stride(const Geometry& g) { return (g.hq + 15) / 16 * 16; }

// One request's work areas in the thread's scratch, 64-byte aligned.
struct Areas {
  float* sc;     // (lenk, hs): scores by key, then exps (hs: hq rounded up to 16, so that
                 // every key's row is its own cache line: no load waits on the last store)
  uint16_t* pb;  // (hq, lenp): probabilities in bf16, zero past len
  uint16_t* qt;  // (hkv, D / 32, 16, group, 2): q^T in pairs, Bf16Lut::words' dim order
  float* acc;    // (hq, D): P.V in Bf16Lut::pairs' dim order
  uint16_t* buf; // BK rows of K in bf16, or BV / 2 rows of V pairs (64 dims: 256 bytes)

  // sizes in bytes, each area rounded up to whole cache lines
  Areas(std::vector<float>& work, const Geometry& g, int64_t lenk, int64_t lenp) {
    const int64_t sizes[] = {lenk * score_stride(g) * 4, g.hq * lenp * 2, g.hq * g.d * 2,
                             g.hq * g.d * 4, std::max<int64_t>(BK * g.hkv * g.d * 2, BV / 2 * 256)};
    int64_t total = 64;
    for (int64_t s : sizes) total += (s + 63) / 64 * 64;
    work.resize(total / 4);
    auto p = reinterpret_cast<uintptr_t>(work.data());
    p = (p + 63) & ~uintptr_t(63);
    void* out[5];
    for (int i = 0; i < 5; ++i) {
      out[i] = reinterpret_cast<void*>(p);
      p += (sizes[i] + 63) / 64 * 64;
    }
    sc = static_cast<float*>(out[0]);
    pb = static_cast<uint16_t*>(out[1]);
    qt = static_cast<uint16_t*>(out[2]);
    acc = static_cast<float*>(out[3]);
    buf = static_cast<uint16_t*>(out[4]);
  }
};

// qt[kv][c][i][h] = (q_h[dim 2i], q_h[dim 2i + 1]) of 32-dim chunk c in Bf16Lut::words' order.
void transpose_q(const bf16_t* q, const Geometry& g, uint16_t* qt) {
  const int64_t group = g.hq / g.hkv, chunks = g.d / 32;
  for (int64_t kv = 0; kv < g.hkv; ++kv)
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t f = 0; f < 32; ++f) {
        const int64_t dim = (c / 2) * 64 + perm64((c % 2) * 32 + f);
        uint16_t* dst = qt + ((kv * chunks + c) * 16 + f / 2) * group * 2 + f % 2;
        for (int64_t h = 0; h < group; ++h) dst[2 * h] = q[(kv * group + h) * g.d + dim];
      }
}

template <Format F>
void scores(const Bf16Lut<F>& lut, const uint8_t* k, const Geometry& g, const int32_t* slots,
            int64_t len, const Areas& a) {
  const int64_t row = g.hkv * g.d, group = g.hq / g.hkv, chunks = g.d / 32, hs = score_stride(g);
  for (int64_t t0 = 0; t0 < len; t0 += BK) {
    const int64_t n = std::min(BK, len - t0);  // rows past n: stale, their scores unread
    prefetch_rows(k, g.sk, slots, t0 + BK, std::min(t0 + 2 * BK, len), row);
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* src = k + slots[t0 + j] * g.sk;
      for (int64_t c = 0; c < row; c += 64) {
        __m512i w0, w1;
        lut.words(_mm512_loadu_si512(src + c), w0, w1);
        _mm512_store_si512(a.buf + j * row + c, w0);
        _mm512_store_si512(a.buf + j * row + c + 32, w1);
      }
    }
    for (int64_t kv = 0; kv < g.hkv; ++kv) {
      _tile_zero(7);
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(5, a.buf + kv * g.d + 32 * c, row * 2);
        _tile_loadd(6, a.qt + (kv * chunks + c) * 16 * group * 2, group * 4);
        _tile_dpbf16ps(7, 5, 6);
      }
      _tile_stored(7, a.sc + t0 * hs + kv * group, hs * 4);
    }
  }
}

// The softmax of every head over its len keys, heads in lanes (16 at a time); lse per head,
// the probabilities in bf16 into pb's rows (zeros past len, to lenp).
void softmax_heads(const Geometry& g, const float* k_scale, int64_t len, int64_t lenp,
                   const Areas& a, float* lse) {
  const int64_t group = g.hq / g.hkv, hs = score_stride(g);
  for (int64_t h0 = 0; h0 < g.hq; h0 += 16) {
    const int64_t m = std::min<int64_t>(16, g.hq - h0);
    const __mmask16 lanes = static_cast<__mmask16>((1u << m) - 1);
    float hscale[16] = {};
    for (int64_t l = 0; l < m; ++l) hscale[l] = g.scale * k_scale[(h0 + l) / group];
    const __m512 scale = _mm512_loadu_ps(hscale);
    float* s = a.sc + h0;
    __m512 vmax = _mm512_set1_ps(-1e30f);
    for (int64_t t = 0; t < len; ++t)
      vmax = _mm512_max_ps(vmax, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, s + t * hs), scale));
    __m512 vsum = _mm512_setzero_ps();
    const __m512 floor = _mm512_set1_ps(-80.f);
    for (int64_t t = 0; t < len; ++t) {
      const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(lanes, s + t * hs), scale, vmax);
      const __m512 e = radixserve_vec::exp_ps(_mm512_max_ps(x, floor));
      _mm512_mask_storeu_ps(s + t * hs, lanes, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    float mx[16], sm[16];
    _mm512_storeu_ps(mx, vmax);
    _mm512_storeu_ps(sm, vsum);
    for (int64_t l = 0; l < m; ++l) lse[h0 + l] = mx[l] + std::log(sm[l]);
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), vsum);
    for (int64_t t0 = 0; t0 < lenp; t0 += 16) {
      __m512 r[16];
      for (int64_t j = 0; j < 16; ++j)
        r[j] = t0 + j < len
                   ? _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, s + (t0 + j) * hs), inv)
                   : _mm512_setzero_ps();
      radixserve_vec::transpose16(r);
      for (int64_t l = 0; l < m; ++l)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.pb + (h0 + l) * lenp + t0),
                            (__m256i)_mm512_cvtneps_pbh(r[l]));
    }
  }
}

// P.V of KV head kv's group over its 64 dims from `dim0`, into acc.
template <Format F>
void values(const Bf16Lut<F>& lut, const uint8_t* v, const Geometry& g, const int32_t* slots,
            int64_t len, int64_t lenp, int64_t kv, int64_t dim0, const Areas& a) {
  const int64_t group = g.hq / g.hkv, col = kv * g.d + dim0;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t t0 = 0; t0 < len; t0 += BV) {
    prefetch_rows(v + col, g.sv, slots, t0 + BV, std::min(t0 + 2 * BV, len), 64);
    for (int64_t jp = 0; jp < BV / 2; ++jp) {
      const int64_t t = t0 + 2 * jp;
      __m512i p[4] = {};  // past len: zero pairs (the probabilities there are 0 too)
      if (t < len)
        lut.pairs(_mm512_loadu_si512(v + slots[t] * g.sv + col),
                  t + 1 < len ? _mm512_loadu_si512(v + slots[t + 1] * g.sv + col)
                              : _mm512_setzero_si512(), p);
      for (int c = 0; c < 4; ++c) _mm512_store_si512(a.buf + jp * 128 + 32 * c, p[c]);
    }
    _tile_loadd(4, a.pb + kv * group * lenp + t0, lenp * 2);
    _tile_loadd(5, a.buf, 256);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, a.buf + 32, 256);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, a.buf + 64, 256);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, a.buf + 96, 256);
    _tile_dpbf16ps(3, 4, 5);
  }
  float* dst = a.acc + kv * group * g.d + dim0;
  _tile_stored(0, dst, g.d * 4);
  _tile_stored(1, dst + 16, g.d * 4);
  _tile_stored(2, dst + 32, g.d * 4);
  _tile_stored(3, dst + 48, g.d * 4);
}

template <Format F>
void decode_one(const Fp8Call<bf16_t>& c, const Geometry& g, const Batch& batch, int64_t b,
                std::vector<float>& work) {
  const Bf16Lut<F> lut;
  const int64_t len = batch.len_of(b), lenp = (len + BV - 1) / BV * BV;
  const int32_t* slots = batch.slots_of(b);
  const Areas a(work, g, (len + BK - 1) / BK * BK, lenp);
  configure_tiles(g.hq / g.hkv);
  transpose_q(c.q_of(b), g, a.qt);
  scores<F>(lut, c.k, g, slots, len, a);
  softmax_heads(g, c.k_scale, len, lenp, a, c.lse_of(b));
  for (int64_t kv = 0; kv < g.hkv; ++kv)
    for (int64_t dim0 = 0; dim0 < g.d; dim0 += 64)
      values<F>(lut, c.v, g, slots, len, lenp, kv, dim0, a);
  _tile_release();
  store_from_pairs(a.acc, c.v_scale, g, c.out_of(b));
}

}  // namespace
#endif

bool decode_fp8_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& k_scale, const at::Tensor& v_scale, const Geometry& g,
                    const Batch& batch, at::Tensor& out, at::Tensor& lse) {
#if RS_FP8_AMX
  // Soft-capped scores take decode_fp8's other paths (their softmax caps; this one's is fused).
  if (q.scalar_type() != at::kBFloat16 || g.d % 64 != 0 || g.hq / g.hkv > 16 ||
      g.softcap > 0.f || !amx_usable())
    return false;
  const Fp8Call<bf16_t> c(q, k_cache, v_cache, k_scale, v_scale, out, lse);
  with_format(k_cache.scalar_type(), [&](auto ftag) {
    each_request(batch, [&](int64_t b, std::vector<float>& work) {
      decode_one<decltype(ftag)::value>(c, g, batch, b, work);
    });
  });
  return true;
#else
  return false;  // no AMX-BF16 at build time
#endif
}

}  // namespace radixserve_decode
