// y = xs * (xq @ q^T) * scale for int8 weight rows q (n, k) with one fp32 scale per row, the input rows
// quantized to int16 (x ~ xs * xq, one scale per row), exact int32 sums.
//
// The approximate pass of the greedy logit screen (selfdraft/greedy_screen.py): a vocabulary
// projection read as int8 is half the bytes of bf16, and a one-token decode step is bound by the
// bytes it reads (SmolLM2's 49,152 x 576 lm_head is ~23% of a step on the 2-core AVX2 CPU). Each
// weight row streams once, prefetched ahead like the bf16 kernel's one-stream path
// (bf16_linear.cpp), its int8 values widened to int16 in registers and multiplied into int32
// accumulators per input row (int8_rows); rows past four reuse the weight row from L1. Where the product
// kernel's AVX512-BF16 path is on, the same sums run in 512-bit registers (AVX512BW), with VPDPWSSD where
// the CPU has AVX512-VNNI (the same bits: exact integers; on a 2-core Emerald Rapids Gemma-3's 262,144 x
// 640 copy at one / four / ten rows 4.8 / 9.6 / 24.4 -> 4.4 / 7.7 / 17.5 ms). The input's quantization
// error enters the screen's bound (quantize_rows).
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

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// MT int16 input rows (1 to 4) against int8 weight row wr: y[i * n] = (dot(x[i, :], wr) in int32, exact) *
// scale * xs[i]. Weights widened to int16, 16 a multiply-add (vpmaddwd: pairs into int32), two
// accumulators per row (SmolLM2's 49,152 x 576 lm_head on the 2-core AVX2 EPYC, one row: 1.55 ms against
// 2.45 for fp32 inputs with four FMA chains, whose two widenings and a conversion per 8 weights were the
// bottleneck; Gemma-3's 262,144 x 640: 10.3 against 14.4 ms, ~16 GB/s, the bf16 product's stream rate).
template <int MT>
inline void int8_rows(const int16_t* x, const int8_t* wr, int64_t k, float scale, const float* xs, float* y, int64_t n) {
  static_assert(MT >= 1 && MT <= 4, "one to four input rows");
  __m256i acc[MT][2];
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
  int64_t t = 0;
  for (; t + 32 <= k; t += 32) {
    if ((t & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(wr + t) + kAhead, _MM_HINT_T0);  // never faults
    for (int a = 0; a < 2; ++a) {
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + t + 16 * a)));
      for (int i = 0; i < MT; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * k + t + 16 * a));
        acc[i][a] = _mm256_add_epi32(acc[i][a], _mm256_madd_epi16(wv, xv));
      }
    }
  }
  for (int i = 0; i < MT; ++i) {
    int32_t s = hsum_i32(_mm256_add_epi32(acc[i][0], acc[i][1]));
    for (int64_t r = t; r < k; ++r) s += int32_t(x[i * k + r]) * wr[r];
    y[i * n] = static_cast<float>(s) * (scale * xs[i]);
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

void check_bounded(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& bound,
                   const at::Tensor& qnorm) {
  check_int8(x, q, scale);
  for (const at::Tensor* t : {&bound, &qnorm})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == q.size(0) && t->is_contiguous(),
                "bound and qnorm must be contiguous float32 vectors with one entry per row of q");
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

// Input rows as int16: x_i ~ xs_i * xq_i, xq = round(x / xs) with xs = max|x_i| / level, and eps_i bounding
// what that changes in any product with a quantized weight row: |s q . x - s xs (q . xq)| computed as
// the kernel does is at most s ||q|| eps_i (selfdraft/greedy_screen.py). The level keeps every int32 sum
// exact: k * level * 127 < 2^31.
struct QuantizedRows {
  std::vector<int16_t> q;
  std::vector<float> scale, eps;
};

QuantizedRows quantize_rows(const float* x, int64_t m, int64_t k) {
  QuantizedRows out{std::vector<int16_t>(m * k), std::vector<float>(m), std::vector<float>(m)};
  const double level = std::min<double>(16383, std::floor(2147483647.0 / (127.0 * std::max<int64_t>(k, 1))));
  for (int64_t i = 0; i < m; ++i) {
    const float* xr = x + i * k;
    float amax = 0;
    bool finite = true;
    for (int64_t t = 0; t < k; ++t) {
      amax = std::max(amax, std::fabs(xr[t]));
      finite = finite && std::isfinite(xr[t]);
    }
    if (!finite) {  // the row's products are not finite: NaN, as fp32 products with it would be
      out.scale[i] = out.eps[i] = NAN;
      continue;
    }
    const float xs = amax > 0 ? static_cast<float>(amax / level) : 0.0f;
    double err = 0, qq = 0;
    for (int64_t t = 0; t < k; ++t) {
      const double v = xs > 0 ? std::nearbyint(double(xr[t]) / xs) : 0.0;
      const double c = std::max(-level, std::min(level, v));
      out.q[i * k + t] = static_cast<int16_t>(c);
      const double d = double(xr[t]) - double(xs) * c;  // exact: 24 + 15 bits
      err += d * d;
      qq += c * c;
    }
    out.scale[i] = xs;
    // ||delta|| plus the product's three fp32 roundings (int32 -> fp32, scale * xs, the product), each
    // at most 2^-24 of s xs |q . xq| <= s ||q|| xs ||xq||; raised for this sum's own rounding
    const double eps = (std::sqrt(err) + std::ldexp(1.0, -22) * xs * std::sqrt(qq)) * (1 + std::ldexp(1.0, -10));
    out.eps[i] = static_cast<float>(eps);
  }
  return out;
}

#if SELFDRAFT_HAVE_AVX512_BF16
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")
// int8_rows in 512-bit registers (AVX512BW): 32 weights a multiply-add, one accumulator per
// row; with AVX512-VNNI (VNNI) the multiply-add and the add are one VPDPWSSD. The sums are exact
// integers on every path (int32 sums of int16 products, wrapping alike), so all give the same bits;
// these read a weight row in half or a quarter of the instructions.
template <int MT, bool VNNI>
inline void int8_rows_avx512(const int16_t* x, const int8_t* wr, int64_t k, float scale, const float* xs, float* y,
                             int64_t n) {
  static_assert(MT >= 1 && MT <= 4, "one to four input rows");
  __m512i acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_si512();
  int64_t t = 0;
  for (; t + 32 <= k; t += 32) {
    if ((t & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(wr + t) + kAhead, _MM_HINT_T0);  // never faults
    const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + t)));
    for (int i = 0; i < MT; ++i) {
      const __m512i xv = _mm512_loadu_si512(x + i * k + t);
      acc[i] = VNNI ? _mm512_dpwssd_epi32(acc[i], wv, xv) : _mm512_add_epi32(acc[i], _mm512_madd_epi16(wv, xv));
    }
  }
  for (int i = 0; i < MT; ++i) {
    int32_t s = _mm512_reduce_add_epi32(acc[i]);
    for (int64_t r = t; r < k; ++r) s += int32_t(x[i * k + r]) * wr[r];
    y[i * n] = static_cast<float>(s) * (scale * xs[i]);
  }
}

template <bool VNNI>
void int8_features_avx512(const int16_t* xq, const float* xs, int64_t m, const int8_t* q, const float* scale, int64_t n0,
                          int64_t n1, int64_t k, float* y, int64_t n) {
  for (int64_t j = n0; j < n1; ++j) {
    const int8_t* wr = q + j * k;
    for (int64_t i = 0; i < m;) {  // passes of up to four rows
      const int64_t r = std::min<int64_t>(4, m - i);
      if (r == 4) int8_rows_avx512<4, VNNI>(xq + i * k, wr, k, scale[j], xs + i, y + i * n + j, n);
      if (r == 3) int8_rows_avx512<3, VNNI>(xq + i * k, wr, k, scale[j], xs + i, y + i * n + j, n);
      if (r == 2) int8_rows_avx512<2, VNNI>(xq + i * k, wr, k, scale[j], xs + i, y + i * n + j, n);
      if (r == 1) int8_rows_avx512<1, VNNI>(xq + i * k, wr, k, scale[j], xs + i, y + i * n + j, n);
      i += r;
    }
  }
}
#pragma GCC pop_options
#endif

// Which form the int8 passes take: 0 the AVX2 one; 1 512-bit (AVX512BW), 2 512-bit with VNNI. The 512-bit
// forms go with the product kernel's AVX512-BF16 path (a CPU with it has AVX512BW): they run where that
// path is on, and set_avx512_bf16 switches both, for comparisons.
int int8_avx512() {
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  if (!avx512_bf16_enabled()) return 0;
  return vnni ? 2 : 1;
}

// y (m, n) = xs * (xq @ q^T) * scale for features [n0, n1), weight rows outermost: input rows in passes of
// at most four, later passes reading the weight row from L1.
void int8_features(const QuantizedRows& x, int64_t m, const int8_t* q, const float* scale, int64_t n0, int64_t n1,
                   int64_t k, float* y, int64_t n) {
  const int16_t* xq = x.q.data();
  const float* xs = x.scale.data();
#if SELFDRAFT_HAVE_AVX512_BF16
  switch (int8_avx512()) {
    case 2: return int8_features_avx512<true>(xq, xs, m, q, scale, n0, n1, k, y, n);
    case 1: return int8_features_avx512<false>(xq, xs, m, q, scale, n0, n1, k, y, n);
    default: break;
  }
#endif
  for (int64_t j = n0; j < n1; ++j) {
    const int8_t* wr = q + j * k;
    for (int64_t i = 0; i < m;) {  // passes of up to four rows
      const int64_t r = std::min<int64_t>(4, m - i);
      if (r == 4) int8_rows<4>(xq + i * k, wr, k, scale[j], xs + i, y + i * n + j, n);
      if (r == 3) int8_rows<3>(xq + i * k, wr, k, scale[j], xs + i, y + i * n + j, n);
      if (r == 2) int8_rows<2>(xq + i * k, wr, k, scale[j], xs + i, y + i * n + j, n);
      if (r == 1) int8_rows<1>(xq + i * k, wr, k, scale[j], xs + i, y + i * n + j, n);
      i += r;
    }
  }
}

// B_j = ||x_i|| * bound_j + eps_i * qnorm_j, how far a_j may lie from the kernel's fp32 sum for the bf16
// product (selfdraft/greedy_screen.py): eight features, then one, for both bounded passes.
inline __m256 spread8(__m256 norm, __m256 eps, const float* bound, const float* qnorm) {
  return _mm256_fmadd_ps(eps, _mm256_loadu_ps(qnorm), _mm256_mul_ps(norm, _mm256_loadu_ps(bound)));
}

inline float spread1(float norm, float eps, float bound, float qnorm) { return std::fma(eps, qnorm, norm * bound); }

// The input side of a bounded pass (int8_screen, int8_upper): the rows as fp32, their norms times the
// allowance, their int16 view; ok is false where there are no rows or something is not finite.
struct BoundedInput {
  int64_t m, k, n;
  at::Tensor x32;
  std::vector<float> norm;
  QuantizedRows xq;
  bool ok;
};

BoundedInput bounded_input(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& bound,
                           const at::Tensor& qnorm, double norm_allowance) {
  check_bounded(x, q, scale, bound, qnorm);
  BoundedInput in;
  in.k = q.size(1);
  in.n = q.size(0);
  in.m = in.k == 0 ? 0 : x.numel() / in.k;
  in.x32 = x.to(at::kFloat).reshape({in.m, in.k}).contiguous();
  bool finite = true;
  in.norm = row_norms(in.x32.data_ptr<float>(), in.m, in.k, norm_allowance, finite);
  in.ok = finite && in.m > 0;
  if (in.ok) in.xq = quantize_rows(in.x32.data_ptr<float>(), in.m, in.k);
  return in;
}

}  // namespace

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  check_int8(x, q, scale);
  const int64_t k = q.size(1), n = q.size(0), m = k == 0 ? 0 : x.numel() / k;
  const at::Tensor x32 = x.to(at::kFloat).reshape({m, k}).contiguous();
  const QuantizedRows xq = quantize_rows(x32.data_ptr<float>(), m, k);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, x.options().dtype(at::kFloat));
  at::parallel_for(0, (n + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t b0, int64_t b1) {
    int8_features(xq, m, q.data_ptr<int8_t>(), scale.data_ptr<float>(), b0 * kRowsPerTask, std::min(n, b1 * kRowsPerTask),
                  k, y.data_ptr<float>(), n);
  });
  return y;
}

at::Tensor int8_screen(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& bound,
                       const at::Tensor& qnorm, double norm_allowance, double margin) {
  const BoundedInput in = bounded_input(x, q, scale, bound, qnorm, norm_allowance);
  const at::Tensor none = at::empty({0}, x.options().dtype(at::kLong));
  if (!in.ok) return none;
  const int64_t m = in.m, k = in.k, n = in.n;
  const std::vector<float>& norm = in.norm;
  const QuantizedRows& xq = in.xq;
  bool finite = true;
  at::Tensor upper = at::empty({m, n}, x.options().dtype(at::kFloat));  // a + B
  float* up = upper.data_ptr<float>();
  const float* bp = bound.data_ptr<float>();
  const float* mp = qnorm.data_ptr<float>();
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  std::vector<float> lower(tasks * m, -INFINITY), top(tasks * m, 0.0f);  // per task and row: max(a - B), max(|a| + B)
  std::vector<char> task_finite(tasks, 1);
  at::parallel_for(0, tasks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kRowsPerTask, n1 = std::min(n, n0 + kRowsPerTask);
      int8_features(xq, m, q.data_ptr<int8_t>(), scale.data_ptr<float>(), n0, n1, k, up, n);
      for (int64_t i = 0; i < m; ++i) {  // a -> a + B, with the row's max(a - B) and max(|a| + B)
        const __m256 nv = _mm256_set1_ps(norm[i]), ev = _mm256_set1_ps(xq.eps[i]), sign = _mm256_set1_ps(-0.0f);
        __m256 lo = _mm256_set1_ps(-INFINITY), hi = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        int64_t j = n0;
        for (; j + 8 <= n1; j += 8) {
          const __m256 a = _mm256_loadu_ps(up + i * n + j), spread = spread8(nv, ev, bp + j, mp + j);
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
          const float a = up[i * n + j], spread = spread1(norm[i], xq.eps[i], bp[j], mp[j]);
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
                      const at::Tensor& qnorm, double norm_allowance, double rounding) {
  const BoundedInput in = bounded_input(x, q, scale, bound, qnorm, norm_allowance);
  const at::Tensor none = at::empty({0}, x.options().dtype(at::kFloat));
  if (!in.ok) return none;
  const int64_t m = in.m, k = in.k, n = in.n;
  const std::vector<float>& norm = in.norm;
  const QuantizedRows& xq = in.xq;
  bool finite = true;
  at::Tensor upper = at::empty({m, n}, x.options().dtype(at::kFloat));
  float* up = upper.data_ptr<float>();
  const float* bp = bound.data_ptr<float>();
  const float* mp = qnorm.data_ptr<float>();
  const float r = static_cast<float>(rounding);
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  std::vector<char> task_finite(tasks, 1);
  at::parallel_for(0, tasks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kRowsPerTask, n1 = std::min(n, n0 + kRowsPerTask);
      int8_features(xq, m, q.data_ptr<int8_t>(), scale.data_ptr<float>(), n0, n1, k, up, n);
      for (int64_t i = 0; i < m; ++i) {  // a -> a + B + r (|a| + B)
        const __m256 nv = _mm256_set1_ps(norm[i]), ev = _mm256_set1_ps(xq.eps[i]), rv = _mm256_set1_ps(r), sign = _mm256_set1_ps(-0.0f);
        __m256 sum = _mm256_setzero_ps();
        int64_t j = n0;
        for (; j + 8 <= n1; j += 8) {
          const __m256 a = _mm256_loadu_ps(up + i * n + j), spread = spread8(nv, ev, bp + j, mp + j);
          const __m256 u = _mm256_fmadd_ps(rv, _mm256_add_ps(_mm256_andnot_ps(sign, a), spread), _mm256_add_ps(a, spread));
          sum = _mm256_add_ps(sum, u);  // not finite where any a or B is not
          _mm256_storeu_ps(up + i * n + j, u);
        }
        float total = hsum(sum);
        for (; j < n1; ++j) {
          const float a = up[i * n + j], spread = spread1(norm[i], xq.eps[i], bp[j], mp[j]);
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
