// The first maximum of each row of bf16 values: what torch.argmax(-1) answers (ties to the first
// index, a NaN counts as the largest value so the first NaN wins, an all -inf row gives 0).
//
// Greedy steps take the argmax of every verified row over the whole vocabulary (selfdraft/sampling.py
// argmax). PyTorch's CPU argmax over bf16 is not vectorized, and widening to fp32 first still costs a
// copy and a second pass: twelve Gemma-3-270M rows of 262,144 logits ~3.8 ms, one ~0.5 ms (2-core AVX2
// EPYC), while reading them once is ~0.1 ms. Here each row is read once: eight lanes keep their own
// running maximum and the index where it first appeared (a strictly greater value replaces both), the
// lanes are reduced at the end to the largest value's smallest index, and a row with a NaN in it is
// rescanned for the first NaN. Built into one module with the other kernels (kernels.h).
#include "kernels.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

namespace selfdraft {
namespace {

int64_t row_argmax(const uint16_t* p, int64_t n) {
  const __m256i step = _mm256_set1_epi32(8);
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256i best_at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);  // lanes left at -inf keep their first index
  __m256i at = best_at;
  __m256 unordered = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = load_bf16x8(p + j);
    const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, gt);
    best_at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_at), _mm256_castsi256_ps(at), gt));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    at = _mm256_add_epi32(at, step);
  }
  if (_mm256_movemask_ps(unordered)) {
    for (int64_t i = 0; i < j; ++i)
      if (std::isnan(bf16_to_float(p[i]))) return i;
  }
  alignas(32) float lane_best[8];
  alignas(32) int32_t lane_at[8];
  _mm256_store_ps(lane_best, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane_at), best_at);
  float top = -std::numeric_limits<float>::infinity();
  int64_t top_at = 0;
  bool found = false;
  for (int l = 0; l < 8 && j > 0; ++l) {
    if (!found || lane_best[l] > top || (lane_best[l] == top && lane_at[l] < top_at)) {
      top = lane_best[l], top_at = lane_at[l], found = true;
    }
  }
  for (int64_t i = j; i < n; ++i) {  // the tail: later than every lane's index, so only a larger value wins
    const float v = bf16_to_float(p[i]);
    if (std::isnan(v)) return i;
    if (!found || v > top) top = v, top_at = i, found = true;
  }
  return top_at;
}

}  // namespace

at::Tensor bf16_argmax(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "bf16_argmax takes contiguous bf16 CPU rows (m, n), got ", x.scalar_type(), " ", x.sizes());
  const int64_t m = x.size(0), n = x.size(1);
  TORCH_CHECK(n > 0 && n < std::numeric_limits<int32_t>::max(), "bf16_argmax: row length ", n, " out of range");
  at::Tensor out = at::empty({m}, x.options().dtype(at::kLong));
  const uint16_t* p = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = row_argmax(p + r * n, n);
  });
  return out;
}

}  // namespace selfdraft
