// y = x @ w^T (+ bias) for a bfloat16 weight on x86 CPUs with AVX2 + FMA but no native bf16 arithmetic.
//
// PyTorch's eager bf16 GEMM without oneDNN bf16 costs about one one-row product per input row, so a
// forward over a few tree tokens costs several one-token forwards. Here each weight element is
// widened to fp32 in registers (a bf16 value is the top half of an fp32) and multiplied into fp32
// accumulators for a tile of input rows at once: the weight streams from memory once per tile of
// output rows, stays in L1 while every input row uses it, and nothing is converted in memory.
// Accumulation is fp32; the result is rounded to the input's dtype (as the bf16 kernel rounds its
// fp32 accumulator). Built into one module with the other kernels (kernels.h) by selfdraft/kernels.py.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <vector>

namespace selfdraft {
namespace {

// Output of one (row, feature) pair: the fp32 sum plus bias, stored as fp32 or rounded to bf16.
template <typename Out>
inline void store(Out* y, float s, const float* bias, int64_t j) {
  if (bias != nullptr) s += bias[j];
  y[0] = static_cast<Out>(s);  // c10::BFloat16 rounds to nearest even
}

// MT input rows x NT output features starting at feature j: y[i, j + c] = dot(x[i, :], w[c, :]).
// With `next` (the NT weight rows the following tile reads), those rows are prefetched a cache line
// at a time as this tile streams its own: a 1-row product is bound by memory, and the hardware
// prefetcher alone, following NT interleaved row streams, left it at ~70% of the bandwidth a plain
// sum reaches here (docs/perf_log.md, twelfth session).
template <int MT, int NT, typename Out>
inline void tile(const float* x, int64_t k, const uint16_t* w, Out* y, int64_t ldy, const float* bias, int64_t j,
                 const uint16_t* next = nullptr) {
  __m256 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int c = 0; c < NT; ++c) acc[i][c] = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= k; t += 8) {
    if (next != nullptr && (t & 31) == 0)  // 32 bf16 = one 64-byte line per row
      for (int c = 0; c < NT; ++c) _mm_prefetch(reinterpret_cast<const char*>(next + c * k + t), _MM_HINT_T0);
    __m256 xv[MT];
    for (int i = 0; i < MT; ++i) xv[i] = _mm256_loadu_ps(x + i * k + t);
    for (int c = 0; c < NT; ++c) {
      __m256 wv = load_bf16x8(w + c * k + t);
      for (int i = 0; i < MT; ++i) acc[i][c] = _mm256_fmadd_ps(xv[i], wv, acc[i][c]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int c = 0; c < NT; ++c) {
      float s = hsum(acc[i][c]);
      for (int64_t r = t; r < k; ++r) s += x[i * k + r] * bf16_to_float(w[c * k + r]);
      store(y + i * ldy + c, s, bias, j + c);
    }
}

// Output features [n0, n1) for all m rows: tiles of NT features, MT rows within each (the NT weight
// rows stay in L1 across the row tiles).
template <int MT, int NT, typename Out>
void feature_block(const float* x, int64_t m, const uint16_t* w, int64_t n0, int64_t n1, int64_t k, Out* y,
                   int64_t n, const float* bias) {
  int64_t j = n0;
  for (; j + NT <= n1; j += NT) {
    // the first row tile prefetches the next feature tile of this task range (later row tiles find
    // the current weight rows in L1)
    const uint16_t* next = j + 2 * NT <= n1 ? w + (j + NT) * k : nullptr;
    int64_t i = 0;
    for (; i + MT <= m; i += MT) tile<MT, NT>(x + i * k, k, w + j * k, y + i * n + j, n, bias, j, i == 0 ? next : nullptr);
    if (m - i == 2) {  // two rows left share each weight row read
      tile<2, NT>(x + i * k, k, w + j * k, y + i * n + j, n, bias, j);
      i += 2;
    }
    for (; i < m; ++i) tile<1, NT>(x + i * k, k, w + j * k, y + i * n + j, n, bias, j);
  }
  for (; j < n1; ++j)
    for (int64_t i = 0; i < m; ++i) tile<1, 1>(x + i * k, k, w + j * k, y + i * n + j, n, bias, j);
}

constexpr int64_t kFeaturesPerTask = 48;  // a multiple of every NT below

template <typename Out>
void run(const float* x, int64_t m, const uint16_t* w, int64_t n, int64_t k, Out* y, const float* bias) {
  const int64_t tasks = (n + kFeaturesPerTask - 1) / kFeaturesPerTask;
  at::parallel_for(0, tasks, 1, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * kFeaturesPerTask, n1 = std::min(n, b1 * kFeaturesPerTask);
    if (m == 1)
      feature_block<1, 8>(x, m, w, n0, n1, k, y, n, bias);
    else if (m >= 3)  // 3-row tiles, then 2 or 1 rows: 1.06-1.20x the 2x6 tiles for 4-11 rows
      feature_block<3, 4>(x, m, w, n0, n1, k, y, n, bias);
    else
      feature_block<2, 6>(x, m, w, n0, n1, k, y, n, bias);
  });
}

}  // namespace

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, "weight must be a 2-D bfloat16 tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bfloat16 or float32");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "bf16_linear runs on the CPU");
  TORCH_CHECK(x.size(-1) == weight.size(1), "x has ", x.size(-1), " features, weight expects ", weight.size(1));
  const int64_t k = weight.size(1), n = weight.size(0);
  const int64_t m = k == 0 ? 0 : x.numel() / k;
  const at::Tensor w = weight.contiguous();
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  // the input rows in fp32 (exact for bf16), contiguous. bf16 rows are widened into a buffer of the
  // calling thread: a tensor conversion per product (dispatch and allocation, ~4 us) cost ~1 ms of a
  // 211-product SmolLM2 forward.
  at::Tensor x32;
  const float* xp;
  if (x.scalar_type() == at::kFloat) {
    x32 = x.reshape({m, k}).contiguous();
    xp = x32.data_ptr<float>();
  } else {
    const at::Tensor xc = x.contiguous();
    const auto* src = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    thread_local std::vector<float> widened;
    widened.resize(static_cast<size_t>(m * k));
    for (int64_t e = 0; e < m * k; ++e) widened[e] = bf16_to_float(src[e]);
    xp = widened.data();
  }
  at::Tensor b32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bias has ", bias->numel(), " entries, expected ", n);
    b32 = bias->to(at::kFloat).contiguous();
  }
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, x.options());
  if (x.scalar_type() == at::kFloat)
    run(xp, m, wp, n, k, y.data_ptr<float>(), bp);
  else
    run(xp, m, wp, n, k, y.data_ptr<at::BFloat16>(), bp);
  return y;
}

}  // namespace selfdraft
