// y = x @ w^T (+ bias) for a bfloat16 weight on x86 CPUs with AVX2 + FMA but no native bf16 arithmetic.
//
// PyTorch's eager bf16 GEMM without oneDNN bf16 costs about one one-row product per input row, so a
// forward over a few tree tokens costs several one-token forwards. Here each weight element is
// widened to fp32 in registers (a bf16 value is the top half of an fp32) and multiplied into fp32
// accumulators for a tile of input rows at once: the weight streams from memory once per tile of
// output rows, stays in L1 while every input row uses it, and nothing is converted in memory.
// Accumulation is fp32; the result is rounded to the input's dtype (as the bf16 kernel rounds its
// fp32 accumulator). Built into one module with the other kernels (kernels.h) by selfdraft/kernels.py.
// Where the CPU has AVX512-BF16, bf16 inputs go to bf16_linear_avx512.cpp instead (bf16_linear_many
// picks the path; fp32 inputs always stay here).
#include "kernels.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <type_traits>
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
// at a time as this tile streams its own: a product of a few rows is bound by memory, and the
// hardware prefetcher alone, following NT interleaved row streams, left it at ~70% of the bandwidth
// a plain sum reaches here (docs/perf_log.md, twelfth session). Products of one to sixteen rows do
// better still as one or two streams (features_stream below); the tiles serve more rows.
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
    if (MT > 3 && m - i == 3) {  // the rows left share each weight row read
      tile<3, NT>(x + i * k, k, w + j * k, y + i * n + j, n, bias, j);
      i += 3;
    }
    if (m - i == 2) {
      tile<2, NT>(x + i * k, k, w + j * k, y + i * n + j, n, bias, j);
      i += 2;
    }
    for (; i < m; ++i) tile<1, NT>(x + i * k, k, w + j * k, y + i * n + j, n, bias, j);
  }
  for (; j < n1; ++j)
    for (int64_t i = 0; i < m; ++i) tile<1, 1>(x + i * k, k, w + j * k, y + i * n + j, n, bias, j);
}

// One to ten input rows as one stream: the weight rows one after another, so each thread reads
// its share of the weight as one contiguous stream, prefetched kStreamAhead bytes ahead at every
// load, and every input row uses each weight vector as it arrives. The 1 x 8, 2 x 6 and 3 x 4 tiles
// read eight, six or four rows side by side (streams 1152 bytes apart for SmolLM2); on the AVX2 EPYC
// a decode step's products streamed ~1.25x (one row), ~1.2x (two) and ~1.08x (three) faster this
// way (docs/perf_log.md, fourteenth session), four and five rows 1.25x and 1.06-1.12x against the
// 3 x 4 tiles (sixteenth session). Six to ten rows keep up to ten independent sums per weight load
// (enough for two FMA pipes at a 4-5-cycle latency; ten accumulators, the weight vector and an input
// vector fit the sixteen registers): all layers' products of a SmolLM2 step 1.15-1.24x faster than
// the 4 x 3 tiles, Gemma-3's 1.06-1.18x (forty-third session). 11 to 16 rows run as two streams
// over each weight row (the second finds it in L1), past that the tiles. Each output's sum runs in
// the same order as in tile() (one accumulator over k, then hsum, then the tail), so a row's result
// does not depend on how many rows the product has.
constexpr int64_t kStreamAhead = 2048;
constexpr int64_t kStreamMaxRows = 10;  // one stream's rows
constexpr int64_t kTwoStreamsMaxRows = 16;  // two streams per weight row up to here, then the tiles

// MT input rows (1 to 10) against weight row wr: y[i * n] = dot(x[i, :], wr) for output feature j.
// (The accumulators are named variables: as an array, GCC kept them on the stack in the bf16 output
// instantiation, a store and a reload per step, which made two-row products 1.6x slower.)
template <int MT, typename Out>
inline void stream_rows(const float* x, const uint16_t* wr, int64_t k, Out* y, int64_t n, const float* bias, int64_t j) {
  static_assert(MT >= 1 && MT <= kStreamMaxRows, "one to ten input rows");
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0;
  int64_t t = 0;
  for (; t + 8 <= k; t += 8) {
    _mm_prefetch(reinterpret_cast<const char*>(wr + t) + kStreamAhead, _MM_HINT_T0);  // never faults
    const __m256 wv = load_bf16x8(wr + t);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + t), wv, a0);
    if constexpr (MT >= 2) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + t), wv, a1);
    if constexpr (MT >= 3) a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 2 * k + t), wv, a2);
    if constexpr (MT >= 4) a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 3 * k + t), wv, a3);
    if constexpr (MT >= 5) a4 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 4 * k + t), wv, a4);
    if constexpr (MT >= 6) a5 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 5 * k + t), wv, a5);
    if constexpr (MT >= 7) a6 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 6 * k + t), wv, a6);
    if constexpr (MT >= 8) a7 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 7 * k + t), wv, a7);
    if constexpr (MT >= 9) a8 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8 * k + t), wv, a8);
    if constexpr (MT == 10) a9 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 9 * k + t), wv, a9);
  }
  const __m256 acc[kStreamMaxRows] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9};
  for (int i = 0; i < MT; ++i) {
    float s = hsum(acc[i]);
    for (int64_t r = t; r < k; ++r) s += x[i * k + r] * bf16_to_float(wr[r]);
    store(y + i * n, s, bias, j);
  }
}

// stream_rows for a row count known at run time (1 to kStreamMaxRows).
template <typename Out>
inline void stream_rows_n(int64_t mt, const float* x, const uint16_t* wr, int64_t k, Out* y, int64_t n,
                          const float* bias, int64_t j) {
  switch (mt) {
    case 1: return stream_rows<1>(x, wr, k, y, n, bias, j);
    case 2: return stream_rows<2>(x, wr, k, y, n, bias, j);
    case 3: return stream_rows<3>(x, wr, k, y, n, bias, j);
    case 4: return stream_rows<4>(x, wr, k, y, n, bias, j);
    case 5: return stream_rows<5>(x, wr, k, y, n, bias, j);
    case 6: return stream_rows<6>(x, wr, k, y, n, bias, j);
    case 7: return stream_rows<7>(x, wr, k, y, n, bias, j);
    case 8: return stream_rows<8>(x, wr, k, y, n, bias, j);
    case 9: return stream_rows<9>(x, wr, k, y, n, bias, j);
    default: return stream_rows<10>(x, wr, k, y, n, bias, j);
  }
}

// Output features [n0, n1) for MT input rows, one weight row after another.
template <int MT, typename Out>
void features_stream(const float* x, const uint16_t* w, int64_t n0, int64_t n1, int64_t k, Out* y, int64_t n,
                     const float* bias) {
  for (int64_t j = n0; j < n1; ++j) stream_rows<MT>(x, w + j * k, k, y + j, n, bias, j);
}

// Output features [n0, n1) for m input rows (kStreamMaxRows < m <= 2 * kStreamMaxRows) as two streams
// over each weight row: the first half of the rows, then the rest.
template <typename Out>
void features_two_streams(const float* x, int64_t m, const uint16_t* w, int64_t n0, int64_t n1, int64_t k, Out* y,
                          int64_t n, const float* bias) {
  const int64_t half = m / 2;
  for (int64_t j = n0; j < n1; ++j) {
    stream_rows_n(half, x, w + j * k, k, y + j, n, bias, j);
    stream_rows_n(m - half, x + half * k, w + j * k, k, y + half * n + j, n, bias, j);
  }
}

constexpr int64_t kFeaturesPerTask = 48;  // a multiple of every NT below

// Output features [n0, n1) of one product for all m rows, in the tile shape for m rows.
template <typename Out>
void features(const float* x, int64_t m, const uint16_t* w, int64_t n0, int64_t n1, int64_t k, Out* y, int64_t n,
              const float* bias) {
  switch (m) {
    case 1: return features_stream<1>(x, w, n0, n1, k, y, n, bias);
    case 2: return features_stream<2>(x, w, n0, n1, k, y, n, bias);
    case 3: return features_stream<3>(x, w, n0, n1, k, y, n, bias);
    case 4: return features_stream<4>(x, w, n0, n1, k, y, n, bias);
    case 5: return features_stream<5>(x, w, n0, n1, k, y, n, bias);
    case 6: return features_stream<6>(x, w, n0, n1, k, y, n, bias);
    case 7: return features_stream<7>(x, w, n0, n1, k, y, n, bias);
    case 8: return features_stream<8>(x, w, n0, n1, k, y, n, bias);
    case 9: return features_stream<9>(x, w, n0, n1, k, y, n, bias);
    case 10: return features_stream<10>(x, w, n0, n1, k, y, n, bias);
    default:
      if (m <= kTwoStreamsMaxRows) return features_two_streams(x, m, w, n0, n1, k, y, n, bias);
      return feature_block<4, 3>(x, m, w, n0, n1, k, y, n, bias);  // 4-row tiles, then 3, 2 or 1 rows
  }
}

// One product of the same input rows: weight (n, k), output rows of n, fp32 bias or null.
template <typename Out>
struct Product {
  const uint16_t* w;
  int64_t n;
  Out* y;
  const float* bias;
};

// All products of the same input rows, split into tasks across the threads (for_feature_tasks).
template <typename Out>
void run(const float* x, int64_t m, int64_t k, const std::vector<Product<Out>>& products) {
  for_feature_tasks(products, kFeaturesPerTask, [&](const Product<Out>& q, int64_t n0, int64_t n1) {
    features(x, m, q.w, n0, n1, k, q.y, q.n, q.bias);
  });
}

std::atomic<bool> use_avx512_bf16{true};  // set_avx512_bf16

}  // namespace

bool avx512_bf16_available() {
  static const bool available = SELFDRAFT_HAVE_AVX512_BF16 && __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                                __builtin_cpu_supports("avx512bf16");
  return available;
}

bool avx512_bf16_enabled() { return use_avx512_bf16.load(std::memory_order_relaxed) && avx512_bf16_available(); }

bool set_avx512_bf16(bool enabled) { return use_avx512_bf16.exchange(enabled); }

std::vector<at::Tensor> bf16_linear_many(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                         const std::vector<c10::optional<at::Tensor>>& biases) {
  TORCH_CHECK(!weights.empty(), "bf16_linear_many needs at least one weight");
  TORCH_CHECK(biases.empty() || biases.size() == weights.size(), "give one bias (or None) per weight, or no biases: ",
              weights.size(), " weights, ", biases.size(), " biases");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bfloat16 or float32");
  TORCH_CHECK(x.dim() >= 1, "x must have a feature dimension");
  const int64_t k = x.size(-1);
  for (const at::Tensor& weight : weights) {
    TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, "weight must be a 2-D bfloat16 tensor");
    TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "bf16_linear runs on the CPU");
    TORCH_CHECK(weight.size(1) == k, "x has ", k, " features, weight expects ", weight.size(1));
  }
  const int64_t m = k == 0 ? 0 : x.numel() / k;
  std::vector<at::Tensor> ws, b32s, ys;
  for (size_t p = 0; p < weights.size(); ++p) {
    const int64_t n = weights[p].size(0);
    ws.push_back(weights[p].contiguous());
    at::Tensor b32;
    if (!biases.empty() && biases[p].has_value() && biases[p]->defined()) {
      TORCH_CHECK(biases[p]->numel() == n, "bias has ", biases[p]->numel(), " entries, expected ", n);
      b32 = biases[p]->to(at::kFloat).contiguous();
    }
    b32s.push_back(b32);
    auto sizes = x.sizes().vec();
    sizes.back() = n;
    ys.push_back(at::empty(sizes, x.options()));
  }
  const auto bias_ptr = [&](size_t p) { return b32s[p].defined() ? b32s[p].data_ptr<float>() : nullptr; };
  if (x.scalar_type() == at::kBFloat16 && avx512_bf16_enabled()) {  // bf16 rows read as they are
    const at::Tensor xc = x.contiguous();
    std::vector<BF16Product> products;
    for (size_t p = 0; p < ws.size(); ++p)
      products.push_back({reinterpret_cast<const uint16_t*>(ws[p].data_ptr<at::BFloat16>()), ws[p].size(0),
                          ys[p].data_ptr<at::BFloat16>(), bias_ptr(p)});
    const auto* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    if (amx_bf16_enabled() && amx_bf16_takes(k))
      bf16_products_amx(xb, m, k, products);
    else
      bf16_products_avx512(xb, m, k, products);
    return ys;
  }
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
  auto launch = [&](auto* tag) {
    using Out = std::remove_pointer_t<decltype(tag)>;
    std::vector<Product<Out>> products;
    for (size_t p = 0; p < ws.size(); ++p)
      products.push_back({reinterpret_cast<const uint16_t*>(ws[p].data_ptr<at::BFloat16>()), ws[p].size(0),
                          ys[p].data_ptr<Out>(), bias_ptr(p)});
    run(xp, m, k, products);
  };
  if (x.scalar_type() == at::kFloat)
    launch(static_cast<float*>(nullptr));
  else
    launch(static_cast<at::BFloat16*>(nullptr));
  return ys;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, "weight must be a 2-D bfloat16 tensor");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "x has ", x.dim() ? x.size(-1) : 0, " features, weight expects ",
              weight.size(1));
  return bf16_linear_many(x, {weight}, {bias})[0];
}

}  // namespace selfdraft
