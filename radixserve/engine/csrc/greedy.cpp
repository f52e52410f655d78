// Greedy sampling on CPU: the first index of each row's maximum, in one native pass per row
// instead of torch's reductions (a (B, vocab) fp32 logits tensor: amax over blocks, the max
// of the blocks, a gather, a compare and an argmax; five ops and four temporaries).
//
// Registered as torch.ops.radixserve.greedy_argmax; radixserve/engine/sampler.py loads it and
// owns its specification (torch.max(dim=-1).indices, which the tests compare with).
//
// greedy_argmax: logits (B, V) float32 with V contiguous -> (B,) int64: the smallest index i
// with logits[b, i] equal to the row's maximum; a row holding a NaN gives its first NaN's
// index (torch's max propagates NaN). Built without -ffast-math: the NaN tests must stay.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// The first index of a NaN in row[0, n), or n.
int64_t first_nan(const float* row, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(row + i);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (nan) return i + __builtin_ctz(nan);
  }
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(row + i);
    const int nan = _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    if (nan) return i + __builtin_ctz(nan);
  }
#endif
  for (; i < n; ++i)
    if (std::isnan(row[i])) return i;
  return n;
}

// The row's maximum, and whether the row holds a NaN (then the maximum means nothing).
float row_max(const float* row, int64_t n, bool* saw_nan) {
  int64_t i = 0;
  float m = row[0];
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 vm = _mm512_loadu_ps(row);
    // max_ps drops a NaN in its first operand: every vector's NaNs are collected apart
    __mmask16 nan = _mm512_cmp_ps_mask(vm, vm, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(row + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vm = _mm512_max_ps(vm, v);
    }
    *saw_nan = nan != 0;
    m = _mm512_reduce_max_ps(vm);
  }
#elif defined(__AVX2__)
  if (n >= 8) {
    __m256 vm = _mm256_loadu_ps(row);
    __m256 nan = _mm256_cmp_ps(vm, vm, _CMP_UNORD_Q);  // max_ps drops a first operand's NaN
    for (i = 8; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(row + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      vm = _mm256_max_ps(vm, v);
    }
    *saw_nan = _mm256_movemask_ps(nan) != 0;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vm);
    m = lanes[0];
    for (int l = 1; l < 8; ++l) m = lanes[l] > m ? lanes[l] : m;
  }
#endif
  for (; i < n; ++i) {
    if (std::isnan(row[i])) *saw_nan = true;
    m = row[i] > m ? row[i] : m;
  }
  if (std::isnan(m)) *saw_nan = true;
  return m;
}

// The first index of `m` in row[0, n) (m is the row's NaN-free maximum: it is there).
int64_t first_equal(const float* row, int64_t n, float m) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), vm, _CMP_EQ_OQ);
    if (eq) return i + __builtin_ctz(eq);
  }
#elif defined(__AVX2__)
  const __m256 vm = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) {
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), vm, _CMP_EQ_OQ));
    if (eq) return i + __builtin_ctz(eq);
  }
#endif
  for (; i < n; ++i)
    if (row[i] == m) return i;
  return n;  // unreachable for a NaN-free maximum
}

int64_t argmax_row(const float* row, int64_t n) {
  bool saw_nan = false;
  const float m = row_max(row, n, &saw_nan);
  if (saw_nan) return first_nan(row, n);
  return first_equal(row, n, m);
}

at::Tensor greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.size(1) >= 1 && logits.stride(1) == 1,
              "logits: a CPU float32 (B, V) tensor with V >= 1 contiguous");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* base = logits.data_ptr<float>();
  int64_t* idx = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) idx[r] = argmax_row(base + r * stride, n);
  });
  return out;
}

}  // namespace

// Each tier's build names its own op namespace (radixserve_<tier>: platform/kernels.py), so
// several tiers load side by side in one process.
#ifndef RADIXSERVE_OPS_NS
#define RADIXSERVE_OPS_NS radixserve
#endif
TORCH_LIBRARY_FRAGMENT(RADIXSERVE_OPS_NS, m) { m.def("greedy_argmax(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(RADIXSERVE_OPS_NS, CPU, m) { m.impl("greedy_argmax", &greedy_argmax); }
