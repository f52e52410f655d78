// The routing half of the CPU MoE ops (moe_experts.cpp, moe_quant.cpp): the (token, expert)
// pairs grouped by local expert with a counting sort, and the per-token sum of the pairs'
// rows in ascending expert order. Shared by the float / int8 op and the quantized one.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../../../attention/csrc/bf16_access.h"

namespace radixserve_moe {

// The pairs grouped by local expert (a counting sort, stable: token order within an expert).
struct Grouping {
  std::vector<int64_t> offsets;   // (E + 1): expert e's sorted pairs are [offsets[e], offsets[e+1])
  std::vector<int64_t> token;     // (P) the token of each sorted pair
  std::vector<float> weight;      // (P) its top-k weight
  std::vector<int64_t> position;  // (T * k) each pair's sorted position, -1 where not local
  std::vector<int64_t> active;    // the local experts with at least one pair, ascending
};

inline Grouping group_pairs(const int64_t* ids, const float* w, int64_t pairs, int64_t k,
                            int64_t first, int64_t E) {
  Grouping g;
  g.offsets.assign(E + 1, 0);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t e = ids[i] - first;
    if (e >= 0 && e < E) ++g.offsets[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) {
    if (g.offsets[e + 1] > 0) g.active.push_back(e);
    g.offsets[e + 1] += g.offsets[e];
  }
  std::vector<int64_t> next(g.offsets.begin(), g.offsets.end() - 1);
  g.token.resize(g.offsets[E]);
  g.weight.resize(g.offsets[E]);
  g.position.assign(pairs, -1);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t e = ids[i] - first;
    if (e < 0 || e >= E) continue;
    const int64_t p = next[e]++;
    g.token[p] = i / k;
    g.weight[p] = w[i];
    g.position[i] = p;
  }
  return g;
}

// out[t] = the sum of t's pairs' rows of y, in ascending expert order (HF adds the experts'
// outputs one expert after another), rounded once to OT.
template <typename OT>
void combine(const float* y, const Grouping& g, int64_t T, int64_t k, int64_t D, OT* out) {
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(D);
    std::vector<int64_t> pos;
    for (int64_t t = t0; t < t1; ++t) {
      pos.clear();
      for (int64_t s = 0; s < k; ++s)
        if (g.position[t * k + s] >= 0) pos.push_back(g.position[t * k + s]);
      std::sort(pos.begin(), pos.end());  // sorted positions run in expert order
      std::fill(acc.begin(), acc.end(), 0.f);
      for (const int64_t p : pos) {
        const float* yr = y + p * D;
#pragma omp simd
        for (int64_t j = 0; j < D; ++j) acc[j] += yr[j];
      }
      OT* o = out + t * D;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) radixserve_bf16::st(o, j, acc[j]);
    }
  });
}

}  // namespace radixserve_moe
