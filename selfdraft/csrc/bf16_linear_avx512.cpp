// y = x @ w^T (+ bias) for bf16 x and a bf16 weight on x86 CPUs with AVX512-BF16 (AMD Zen 4 and later,
// Intel Cooper Lake, Sapphire and Emerald Rapids): the native-bf16 path of bf16_linear.cpp's product kernel.
//
// The AVX2 kernel widens every weight element to fp32 and spends one 8-wide FMA per element and input
// row, so a product of a few rows is compute-bound long before it is memory-bound: on a 2-core Zen 4 a
// 16-token SmolLM2 verification cost ~4x a one-token forward. VDPBF16PS multiplies bf16 pairs of an
// input row and a weight row into fp32 sums, reading both operands as they lie in memory: twice the
// products per instruction, nothing widened or converted. Each bf16 product is exact in fp32 and each
// sum is rounded as an FMA's would be; the instruction flushes denormals, which the weights and
// activations of a trained model do not hold in any number that matters.
//
// Two register widths, one per CPU, chosen once (set_avx512_bf16_zmm): 256-bit (16 bf16 pairs into 8
// sums a step) and 512-bit (32 into 16). On a 2-core Zen 4, which splits each 512-bit instruction in
// two, whole SmolLM2 forwards of 2-3 tokens took 15-25% longer with 512-bit loads and products and
// 256-bit ones were as fast at 6-16 tokens (docs/perf_log.md, twenty-fifth session). On a 2-core Intel
// Emerald Rapids the 256-bit form ran no faster than the AVX2 path past five rows (a 10-token SmolLM2
// forward 37.3 against 29.6 ms) and the 512-bit one takes every row count faster (forty-fifth
// session): the 512-bit form is the default on Intel, the 256-bit one elsewhere.
//
// What greedy exactness rests on holds here as in the AVX2 kernel: with one width, every output element
// is one accumulator run over k in the same order (a masked tail last), then one reduction, then the
// bias, however many rows the product has, so a row's result does not depend on the row count. The
// width is a process-wide setting, never chosen by the row count. Built into the same module as the
// other kernels, with this file's functions alone targeting AVX512-BF16; bf16_linear_many calls them
// only where the CPU reports the instructions.
#include "kernels.h"

#include <algorithm>
#include <atomic>
#include <utility>

#if SELFDRAFT_HAVE_AVX512_BF16
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

namespace selfdraft {
namespace {

// The two register widths: a weight vector, its loads (whole and masked), one VDPBF16PS, the sum of the
// lanes. Ymm: 16 bf16 elements a step into 8 fp32 lanes; Zmm: 32 into 16 (its sum adds the two halves,
// then as Ymm's).
struct Ymm {
  using Acc = __m256;
  using Bh = __m256bh;
  using Mask = __mmask16;
  static constexpr int64_t kLane = 16;
  static Acc zero() { return _mm256_setzero_ps(); }
  static Bh load(const uint16_t* p) { return (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Mask tail_mask(int64_t left) { return static_cast<Mask>((1u << left) - 1); }
  static Bh load_tail(const uint16_t* p, Mask mask) { return (__m256bh)_mm256_maskz_loadu_epi16(mask, p); }
  static Acc dot(Acc acc, Bh a, Bh b) { return _mm256_dpbf16_ps(acc, a, b); }
  static float sum(Acc v) { return hsum(v); }
};

struct Zmm {
  using Acc = __m512;
  using Bh = __m512bh;
  using Mask = __mmask32;
  static constexpr int64_t kLane = 32;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Bh load(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Mask tail_mask(int64_t left) { return static_cast<Mask>((uint64_t{1} << left) - 1); }
  static Bh load_tail(const uint16_t* p, Mask mask) { return (__m512bh)_mm512_maskz_loadu_epi16(mask, p); }
  static Acc dot(Acc acc, Bh a, Bh b) { return _mm512_dpbf16_ps(acc, a, b); }
  static float sum(Acc v) {
    return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  }
};

// The weight rows one after another, each thread reading its share of a product's weight as one
// contiguous stream prefetched kStreamAhead bytes ahead (as the AVX2 kernel's one-to-five-row stream):
// every input row takes its dot product with a weight row while that row is in L1, in passes over it of
// at most kChunk rows, as equal as they can be. (Tiles of four weight rows side by side, the AVX2
// kernel's shape for six rows and more, were no faster on Zen 4 at 6-16 rows and slower at one to four;
// tiles of two no faster at 13-16 rows and 1.4x slower at one to eight; on Emerald Rapids two 512-bit
// weight rows side by side were 1.1-1.25x slower than one at 2-12 rows.) Passes of eight rows and a
// remainder left 9-12 rows a second pass of one to four, whose few accumulators wait on the
// instruction's latency: a 9-row product cost 1.45x an 8-row one, 1.0x in one pass. One pass of 13-16
// rows was slower than two on Gemma-3's 640-wide products (a 16-token forward +10%), hence 12
// (docs/perf_log.md, thirtieth session).
constexpr int64_t kStreamAhead = 2048;
constexpr int kChunk = 12;

// MT input rows against weight row wr: y[i * n] = dot(x[i, :], wr) (+ bias[j]) for output feature j.
// (The loops over rows are unrolled so that the accumulators stay in registers.)
template <typename V, int MT>
inline void stream_rows(const uint16_t* x, const uint16_t* wr, int64_t k, at::BFloat16* y, int64_t n,
                        const float* bias, int64_t j) {
  typename V::Acc acc[MT];
#pragma GCC unroll 12
  for (int i = 0; i < MT; ++i) acc[i] = V::zero();
  int64_t t = 0;
  for (; t + V::kLane <= k; t += V::kLane) {
    if (V::kLane == 32 || (t & 31) == 0)  // one 64-byte line a step (Zmm), every other step (Ymm)
      _mm_prefetch(reinterpret_cast<const char*>(wr + t) + kStreamAhead, _MM_HINT_T0);  // never faults
    const typename V::Bh wv = V::load(wr + t);
#pragma GCC unroll 12
    for (int i = 0; i < MT; ++i) acc[i] = V::dot(acc[i], V::load(x + i * k + t), wv);
  }
  if (t < k) {  // the last k % kLane elements, the rest of each register zero
    const typename V::Mask mask = V::tail_mask(k - t);
    const typename V::Bh wv = V::load_tail(wr + t, mask);
#pragma GCC unroll 12
    for (int i = 0; i < MT; ++i) acc[i] = V::dot(acc[i], V::load_tail(x + i * k + t, mask), wv);
  }
#pragma GCC unroll 12
  for (int i = 0; i < MT; ++i) {
    float s = V::sum(acc[i]);
    if (bias != nullptr) s += bias[j];
    y[i * n] = static_cast<at::BFloat16>(s);  // rounds to nearest even
  }
}

// stream_rows<V, rows> for 1 <= rows <= kChunk.
template <typename V, int... MT>
inline void stream_some(int64_t rows, const uint16_t* x, const uint16_t* wr, int64_t k, at::BFloat16* y, int64_t n,
                        const float* bias, int64_t j, std::integer_sequence<int, MT...>) {
  ((rows == MT + 1 ? stream_rows<V, MT + 1>(x, wr, k, y, n, bias, j) : void()), ...);
}

// Output features [n0, n1) of one product for all m rows.
template <typename V>
void features(const uint16_t* x, int64_t m, const uint16_t* w, int64_t n0, int64_t n1, int64_t k, at::BFloat16* y,
              int64_t n, const float* bias) {
  const int64_t passes = (m + kChunk - 1) / kChunk;
  const int64_t rows = m / passes, longer = m % passes;  // the first `longer` passes take one row more
  for (int64_t j = n0; j < n1; ++j)
    for (int64_t i = 0, p = 0; p < passes; ++p) {
      const int64_t r = rows + (p < longer);
      stream_some<V>(r, x + i * k, w + j * k, k, y + i * n + j, n, bias, j, std::make_integer_sequence<int, kChunk>{});
      i += r;
    }
}

bool intel_cpu() {
  __builtin_cpu_init();  // this runs in a static initializer, possibly before libgcc's own
  return __builtin_cpu_is("intel");
}

std::atomic<bool> use_zmm{intel_cpu()};  // set_avx512_bf16_zmm

constexpr int64_t kFeaturesPerTask = 48;

}  // namespace

// All products of the same input rows, split into tasks across the threads (for_feature_tasks).
void bf16_products_avx512(const uint16_t* x, int64_t m, int64_t k, const std::vector<BF16Product>& products) {
  const bool zmm = use_zmm.load(std::memory_order_relaxed);
  for_feature_tasks(products, kFeaturesPerTask, [&](const BF16Product& q, int64_t n0, int64_t n1) {
    if (zmm)
      features<Zmm>(x, m, q.w, n0, n1, k, q.y, q.n, q.bias);
    else
      features<Ymm>(x, m, q.w, n0, n1, k, q.y, q.n, q.bias);
  });
}

bool avx512_bf16_zmm() { return use_zmm.load(std::memory_order_relaxed); }

bool set_avx512_bf16_zmm(bool enabled) { return use_zmm.exchange(enabled); }

}  // namespace selfdraft

#pragma GCC pop_options
#else  // a compiler without the intrinsics: avx512_bf16_available() is false and this is never called
namespace selfdraft {
void bf16_products_avx512(const uint16_t*, int64_t, int64_t, const std::vector<BF16Product>&) {
  TORCH_CHECK(false, "selfdraft's kernels were built without AVX512-BF16 support");
}
bool avx512_bf16_zmm() { return false; }
bool set_avx512_bf16_zmm(bool) { return false; }
}  // namespace selfdraft
#endif
