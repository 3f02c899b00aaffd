// y = (x @ q^T) * scale for int8 weight rows q (n, k) with one fp32 scale per row, fp32 accumulation.
//
// The approximate pass of the greedy logit screen (selfdraft/greedy_screen.py): a vocabulary
// projection read as int8 is half the bytes of bf16, and a one-token decode step is bound by the
// bytes it reads (SmolLM2's 49,152 x 576 lm_head is ~23% of a step on the 2-core AVX2 CPU). Each
// weight row streams once, prefetched ahead like the bf16 kernel's one-stream path
// (bf16_linear.cpp), its int8 values widened to fp32 in registers and multiplied into four fp32
// accumulator chains per input row (int8_rows); rows past three reuse the weight row from L1.
// int8_upper turns the same pass into upper bounds on every bf16 logit, for draws at a temperature
// (selfdraft/screened_draws.py). Built into one module with the other kernels (kernels.h) by
// selfdraft/kernels.py.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace selfdraft {
namespace {

constexpr int64_t kAhead = 1024;       // bytes prefetched ahead of the weight row being read
constexpr int64_t kRowsPerTask = 64;  // output features per parallel task

inline __m256 load_int8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// MT input rows (1 to 3) against int8 weight row wr: y[i * n] = scale * dot(x[i, :], wr). Each row
// sums into four accumulators (every fourth block of 8 into its own): one dependent chain of k / 8
// multiply-adds per row bounds the product by the FMA latency (SmolLM2's lm_head on the 2-core AVX2
// EPYC: one row 4.8 ms with one chain, 1.3-1.9 ms with four, ~1.1 ms to read its int8 bytes; two rows
// with two chains each 2.8-2.9 ms, with four 1.5-2.2 ms; three rows with one chain each 4.1-4.9 ms,
// with four 1.9-2.3 ms).
template <int MT>
inline void int8_rows(const float* x, const int8_t* wr, int64_t k, float scale, float* y, int64_t n) {
  static_assert(MT >= 1 && MT <= 3, "one to three input rows");
  constexpr int NA = 4;  // accumulators per row
  __m256 acc[MT][NA];
  for (int i = 0; i < MT; ++i)
    for (int a = 0; a < NA; ++a) acc[i][a] = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 * NA <= k; t += 8 * NA) {
    if ((t & 63) < 8 * NA) _mm_prefetch(reinterpret_cast<const char*>(wr + t) + kAhead, _MM_HINT_T0);  // never faults
    for (int a = 0; a < NA; ++a) {
      const __m256 wv = load_int8x8(wr + t + 8 * a);
      for (int i = 0; i < MT; ++i) acc[i][a] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * k + t + 8 * a), wv, acc[i][a]);
    }
  }
  for (int i = 0; i < MT; ++i) {
    for (int a = 1; a < NA; ++a) acc[i][0] = _mm256_add_ps(acc[i][0], acc[i][a]);
    float s = hsum(acc[i][0]);
    for (int64_t r = t; r < k; ++r) s += x[i * k + r] * static_cast<float>(wr[r]);
    y[i * n] = s * scale;
  }
}

}  // namespace

namespace {

void check_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(), "q must be a contiguous 2-D int8 tensor");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == q.size(0) && scale.is_contiguous(),
              "scale must be a contiguous float32 vector with one entry per row of q");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bfloat16 or float32");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == q.size(1), "x has ", x.dim() ? x.size(-1) : 0, " features, q expects ", q.size(1));
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && scale.device().is_cpu(), "the int8 products run on the CPU");
}

void check_bounded(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& bound) {
  check_int8(x, q, scale);
  TORCH_CHECK(bound.scalar_type() == at::kFloat && bound.dim() == 1 && bound.size(0) == q.size(0) && bound.is_contiguous(),
              "bound must be a contiguous float32 vector with one entry per row of q");
}

// ||x_i||_2 * allowance for each of the m rows of x (m, k), summed in double; finite turns false where one is not.
std::vector<float> row_norms(const float* x, int64_t m, int64_t k, double allowance, bool& finite) {
  std::vector<float> norm(m);
  for (int64_t i = 0; i < m; ++i) {
    double s = 0;
    for (int64_t t = 0; t < k; ++t) s += double(x[i * k + t]) * x[i * k + t];
    norm[i] = static_cast<float>(std::sqrt(s) * allowance);
    finite = finite && std::isfinite(norm[i]);
  }
  return norm;
}

// y (m, n) = (x @ q^T) * scale for features [n0, n1), weight rows outermost: input rows in passes of at most
// three (two and two for four), later passes reading the weight row from L1.
void int8_features(const float* x, int64_t m, const int8_t* q, const float* scale, int64_t n0, int64_t n1, int64_t k,
                   float* y, int64_t n) {
  for (int64_t j = n0; j < n1; ++j) {
    const int8_t* wr = q + j * k;
    for (int64_t i = 0; i < m;) {  // passes of three rows (two and two for four left)
      const int64_t left = m - i, r = left == 4 ? 2 : std::min<int64_t>(3, left);
      if (r == 3) int8_rows<3>(x + i * k, wr, k, scale[j], y + i * n + j, n);
      if (r == 2) int8_rows<2>(x + i * k, wr, k, scale[j], y + i * n + j, n);
      if (r == 1) int8_rows<1>(x + i * k, wr, k, scale[j], y + i * n + j, n);
      i += r;
    }
  }
}

}  // namespace

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  check_int8(x, q, scale);
  const int64_t k = q.size(1), n = q.size(0), m = k == 0 ? 0 : x.numel() / k;
  const at::Tensor x32 = x.to(at::kFloat).reshape({m, k}).contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, x.options().dtype(at::kFloat));
  at::parallel_for(0, (n + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t b0, int64_t b1) {
    int8_features(x32.data_ptr<float>(), m, q.data_ptr<int8_t>(), scale.data_ptr<float>(), b0 * kRowsPerTask,
                  std::min(n, b1 * kRowsPerTask), k, y.data_ptr<float>(), n);
  });
  return y;
}

at::Tensor int8_screen(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& bound,
                       double norm_allowance, double margin) {
  check_bounded(x, q, scale, bound);
  const int64_t k = q.size(1), n = q.size(0), m = k == 0 ? 0 : x.numel() / k;
  const at::Tensor x32 = x.to(at::kFloat).reshape({m, k}).contiguous();
  const float* xp = x32.data_ptr<float>();
  bool finite = true;
  const std::vector<float> norm = row_norms(xp, m, k, norm_allowance, finite);
  const at::Tensor none = at::empty({0}, x.options().dtype(at::kLong));
  if (!finite || m == 0) return none;
  at::Tensor upper = at::empty({m, n}, x.options().dtype(at::kFloat));  // a + B
  float* up = upper.data_ptr<float>();
  const float* bp = bound.data_ptr<float>();
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  std::vector<float> lower(tasks * m, -INFINITY), top(tasks * m, 0.0f);  // per task and row: max(a - B), max(|a| + B)
  std::vector<char> task_finite(tasks, 1);
  at::parallel_for(0, tasks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kRowsPerTask, n1 = std::min(n, n0 + kRowsPerTask);
      int8_features(xp, m, q.data_ptr<int8_t>(), scale.data_ptr<float>(), n0, n1, k, up, n);
      for (int64_t i = 0; i < m; ++i) {  // a -> a + B, with the row's max(a - B) and max(|a| + B)
        const __m256 nv = _mm256_set1_ps(norm[i]), sign = _mm256_set1_ps(-0.0f);
        __m256 lo = _mm256_set1_ps(-INFINITY), hi = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        int64_t j = n0;
        for (; j + 8 <= n1; j += 8) {
          const __m256 a = _mm256_loadu_ps(up + i * n + j), spread = _mm256_mul_ps(nv, _mm256_loadu_ps(bp + j));
          const __m256 u = _mm256_add_ps(a, spread);
          lo = _mm256_max_ps(lo, _mm256_sub_ps(a, spread));
          hi = _mm256_max_ps(hi, _mm256_add_ps(_mm256_andnot_ps(sign, a), spread));
          sum = _mm256_add_ps(sum, u);  // not finite where any a or B is not (max() drops NaN)
          _mm256_storeu_ps(up + i * n + j, u);
        }
        float l8[8], h8[8];
        _mm256_storeu_ps(l8, lo);
        _mm256_storeu_ps(h8, hi);
        float l = -INFINITY, h = 0.0f, total = hsum(sum);
        for (int e = 0; e < 8; ++e) l = std::max(l, l8[e]), h = std::max(h, h8[e]);
        for (; j < n1; ++j) {
          const float a = up[i * n + j], spread = norm[i] * bp[j];
          l = std::max(l, a - spread);
          h = std::max(h, std::fabs(a) + spread);
          up[i * n + j] = a + spread;
          total += a + spread;
        }
        lower[b * m + i] = std::max(lower[b * m + i], l);
        top[b * m + i] = std::max(top[b * m + i], h);
        if (!std::isfinite(total)) task_finite[b] = 0;
      }
    }
  });
  std::vector<float> threshold(m);
  for (int64_t i = 0; i < m; ++i) {
    float lo = -INFINITY, hi = 0.0f;
    for (int64_t b = 0; b < tasks; ++b) {
      lo = std::max(lo, lower[b * m + i]);
      hi = std::max(hi, top[b * m + i]);
      finite = finite && task_finite[b];
    }
    threshold[i] = static_cast<float>(lo - margin * hi);
    finite = finite && std::isfinite(threshold[i]);
  }
  if (!finite) return none;
  std::vector<int64_t> keep;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < m; ++i)
      if (up[i * n + j] >= threshold[i]) {
        keep.push_back(j);
        break;
      }
  at::Tensor out = at::empty({static_cast<int64_t>(keep.size())}, x.options().dtype(at::kLong));
  std::copy(keep.begin(), keep.end(), out.data_ptr<int64_t>());
  return out;
}

at::Tensor int8_upper(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& bound,
                      double norm_allowance, double rounding) {
  check_bounded(x, q, scale, bound);
  const int64_t k = q.size(1), n = q.size(0), m = k == 0 ? 0 : x.numel() / k;
  const at::Tensor x32 = x.to(at::kFloat).reshape({m, k}).contiguous();
  const float* xp = x32.data_ptr<float>();
  bool finite = true;
  const std::vector<float> norm = row_norms(xp, m, k, norm_allowance, finite);
  const at::Tensor none = at::empty({0}, x.options().dtype(at::kFloat));
  if (!finite || m == 0) return none;
  at::Tensor upper = at::empty({m, n}, x.options().dtype(at::kFloat));
  float* up = upper.data_ptr<float>();
  const float* bp = bound.data_ptr<float>();
  const float r = static_cast<float>(rounding);
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  std::vector<char> task_finite(tasks, 1);
  at::parallel_for(0, tasks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kRowsPerTask, n1 = std::min(n, n0 + kRowsPerTask);
      int8_features(xp, m, q.data_ptr<int8_t>(), scale.data_ptr<float>(), n0, n1, k, up, n);
      for (int64_t i = 0; i < m; ++i) {  // a -> a + B + r (|a| + B)
        const __m256 nv = _mm256_set1_ps(norm[i]), rv = _mm256_set1_ps(r), sign = _mm256_set1_ps(-0.0f);
        __m256 sum = _mm256_setzero_ps();
        int64_t j = n0;
        for (; j + 8 <= n1; j += 8) {
          const __m256 a = _mm256_loadu_ps(up + i * n + j), spread = _mm256_mul_ps(nv, _mm256_loadu_ps(bp + j));
          const __m256 u = _mm256_fmadd_ps(rv, _mm256_add_ps(_mm256_andnot_ps(sign, a), spread), _mm256_add_ps(a, spread));
          sum = _mm256_add_ps(sum, u);  // not finite where any a or B is not
          _mm256_storeu_ps(up + i * n + j, u);
        }
        float total = hsum(sum);
        for (; j < n1; ++j) {
          const float a = up[i * n + j], spread = norm[i] * bp[j];
          up[i * n + j] = std::fma(r, std::fabs(a) + spread, a + spread);
          total += up[i * n + j];
        }
        if (!std::isfinite(total)) task_finite[b] = 0;
      }
    }
  });
  for (int64_t b = 0; b < tasks; ++b) finite = finite && task_finite[b];
  return finite ? upper : none;
}

}  // namespace selfdraft
