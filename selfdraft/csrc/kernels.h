// Shared helpers and the entry points of selfdraft's CPU kernels (one extension module, built on
// first use by selfdraft/kernels.py; bindings.cpp exposes the entry points to Python).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace selfdraft {

// Eight bf16 values widened to fp32 (a bf16 value is the top half of an fp32).
inline __m256 load_bf16x8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// fp32 rounded to bf16 (nearest even, as PyTorch's casts), as raw bits.
inline uint16_t round_bf16(float f) { return static_cast<at::BFloat16>(f).x; }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Every product's output features split into tasks of `per_task`, all products' tasks in one parallel
// loop: each thread takes a contiguous run of tasks, possibly across products, and calls
// run_range(product, n0, n1) for each product's features [n0, n1) in its run. Several small products
// of one input (a layer's q, k and v) then cost one thread hand-off instead of one each, and each
// thread streams a longer run of weight rows. Products: a vector of structs with the feature count n.
template <typename Product, typename RunRange>
void for_feature_tasks(const std::vector<Product>& products, int64_t per_task, const RunRange& run_range) {
  std::vector<int64_t> first(products.size() + 1, 0);  // first task of each product
  for (size_t p = 0; p < products.size(); ++p) first[p + 1] = first[p] + (products[p].n + per_task - 1) / per_task;
  at::parallel_for(0, first.back(), 1, [&](int64_t b0, int64_t b1) {
    for (size_t p = 0; p < products.size(); ++p) {
      const int64_t lo = std::max(b0, first[p]), hi = std::min(b1, first[p + 1]);
      if (lo < hi) run_range(products[p], (lo - first[p]) * per_task, std::min(products[p].n, (hi - first[p]) * per_task));
    }
  });
}

// x @ weight.T (+ bias) with a bf16 weight, fp32 accumulation (bf16_linear.cpp).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

// Several products of the same x in one parallel loop: [x @ w.T (+ b) for w, b in zip(weights, biases)] (bf16_linear.cpp).
std::vector<at::Tensor> bf16_linear_many(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                         const std::vector<c10::optional<at::Tensor>>& biases);

// a = xs * (xq @ q.T) * scale for int8 rows q (n, k) and fp32 row scales, each input row quantized to int16
// (x ~ xs * xq, one scale per row), exact int32 sums, fp32 output (int8_linear.cpp). With s = scale, for any
// input row x and weight row w: |x . w - a| <= ||x|| ||w - s q|| + s ||q|| eps(x) + fp32 rounding, eps(x)
// the quantization's own bound (int8_linear.cpp quantize_rows; selfdraft/greedy_screen.py).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale);

// The greedy screen's candidates (selfdraft/greedy_screen.py; int8_linear.cpp): with a = int8_linear(x, q, scale)
// and B = ||x||_2 * norm_allowance * bound + eps(x) * qnorm, the indices j (ascending) where a_j + B_j >=
// max(a - B) - margin * max(|a| + B) in some row of x; empty where anything is not finite.
at::Tensor int8_screen(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& bound,
                       const at::Tensor& qnorm, double norm_allowance, double margin);

// Upper bounds on the bf16 logits of the bf16 product (selfdraft/screened_draws.py; int8_linear.cpp): with a and
// B as int8_screen's, U = a + B + rounding * (|a| + B), (m, n) fp32; empty where anything is not finite.
at::Tensor int8_upper(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& bound,
                      const at::Tensor& qnorm, double norm_allowance, double rounding);

// The first maximum of each row of contiguous bf16 rows (m, n), as torch.argmax(-1): ties to the first index,
// the first NaN wins, all -inf gives 0; (m,) int64 (bf16_argmax.cpp).
at::Tensor bf16_argmax(const at::Tensor& x);

// Whether this compiler has the AVX512-BF16 intrinsics (GCC 10, Clang 9 and later); without them the
// module builds without that path and every product takes the AVX2 one.
#if defined(__clang__) ? (__clang_major__ >= 9) : (defined(__GNUC__) && __GNUC__ >= 10)
#define SELFDRAFT_HAVE_AVX512_BF16 1
#else
#define SELFDRAFT_HAVE_AVX512_BF16 0
#endif

// One product of bf16 input rows on the AVX512-BF16 path: weight (n, k), bf16 output rows of n, fp32 bias or null.
struct BF16Product {
  const uint16_t* w;
  int64_t n;
  at::BFloat16* y;
  const float* bias;
};

// The products of the same m bf16 input rows (m, k), contiguous, with AVX512-BF16 dot products
// (bf16_linear_avx512.cpp); call only where avx512_bf16_available().
void bf16_products_avx512(const uint16_t* x, int64_t m, int64_t k, const std::vector<BF16Product>& products);

// Whether the AVX512-BF16 path multiplies in 512-bit registers (32 bf16 pairs a step) rather than 256-bit
// ones (16): by default on Intel CPUs, not on others (bf16_linear_avx512.cpp says why).
bool avx512_bf16_zmm();

// Choose the AVX512-BF16 path's register width for every later product (true: 512-bit); returns the
// previous setting. Results differ in rounding between the widths, so a process keeps one while it
// compares outputs (it is never chosen per product).
bool set_avx512_bf16_zmm(bool enabled);

// Whether this compiler has the AMX intrinsics (GCC 11, Clang 12 and later).
#if defined(__clang__) ? (__clang_major__ >= 12) : (defined(__GNUC__) && __GNUC__ >= 11)
#define SELFDRAFT_HAVE_AMX 1
#else
#define SELFDRAFT_HAVE_AMX 0
#endif

// The same products with AMX-BF16 tiles (bf16_linear_amx.cpp); call only where amx_bf16_enabled() and
// amx_bf16_takes(k).
void bf16_products_amx(const uint16_t* x, int64_t m, int64_t k, const std::vector<BF16Product>& products);

// Whether products of width k take the AMX path where it is enabled (k a multiple of 32); by k alone,
// never by the row count, so a row's result does not depend on how many rows share its product.
bool amx_bf16_takes(int64_t k);

// Whether this CPU runs AMX-BF16 with AVX512-BF16 and the OS lets this process use the tiles.
bool amx_bf16_available();

// Whether bf16 products take the AMX path where their width allows: available, not switched off, and the
// AVX512-BF16 path on.
bool amx_bf16_enabled();

// Switch the AMX path on (the default) or off where it is available; returns the previous setting.
bool set_amx_bf16(bool enabled);

// Whether this CPU runs AVX512-BF16 (and the OS keeps its registers).
bool avx512_bf16_available();

// Whether bf16 products take the AVX512-BF16 path: available and not switched off.
bool avx512_bf16_enabled();

// Switch the AVX512-BF16 path for bf16 products on (the default) or off, where it is available;
// returns the previous setting. Off, every product takes the AVX2 path (comparisons, tests).
bool set_avx512_bf16(bool enabled);

// softmax(scale * q k^T + mask) v over a bf16 cache, (batch, q positions, heads, head_dim) out (bf16_attention.cpp).
at::Tensor bf16_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const c10::optional<at::Tensor>& mask, double scale);

// RMSNorm of bf16 rows: weight * bf16(x_hat), or bf16(x_hat * (1 + weight)) with unit_offset (bf16_rms_norm.cpp).
at::Tensor bf16_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset);

// Rotary embedding of bf16 heads (batch, positions, heads, head_dim) with Hugging Face's eager roundings (bf16_rope.cpp).
at::Tensor bf16_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// An RMSNorm's weight and convention (see bf16_rms_norm); an undefined weight means no norm.
struct Norm {
  at::Tensor weight;
  double eps = 0.0;
  bool unit_offset = false;
};

inline at::Tensor apply_norm(const at::Tensor& x, const Norm& n) { return bf16_rms_norm(x, n.weight, n.eps, n.unit_offset); }

// One decoder layer's weights, gathered once (bf16_decoder.cpp). Llama: x += o(attn(norm_in(x)));
// x += down(act(gate(h)) * up(h)), h = norm_mlp_in(x). Gemma-3 adds q/k norms over each head and a norm
// of the attention output and of the MLP output before each sum. ``type`` indexes the forward's
// rotary tables and masks (Gemma-3's sliding and full layers differ in both).
struct DecoderLayer {
  DecoderLayer(int64_t type, const std::vector<c10::optional<at::Tensor>>& norms, const std::vector<double>& eps,
               const std::vector<bool>& unit_offset, std::vector<at::Tensor> qkv,
               std::vector<c10::optional<at::Tensor>> qkv_bias, at::Tensor o, c10::optional<at::Tensor> o_bias,
               std::vector<at::Tensor> gate_up, std::vector<c10::optional<at::Tensor>> gate_up_bias, at::Tensor down,
               c10::optional<at::Tensor> down_bias, int64_t act, int64_t heads, int64_t kv_heads, int64_t head_dim,
               double scale);
  int64_t type;
  Norm input_norm, q_norm, k_norm, attn_out_norm, mlp_norm, mlp_out_norm;
  std::vector<at::Tensor> qkv;
  std::vector<c10::optional<at::Tensor>> qkv_bias;
  at::Tensor o;
  c10::optional<at::Tensor> o_bias;
  std::vector<at::Tensor> gate_up;
  std::vector<c10::optional<at::Tensor>> gate_up_bias;
  at::Tensor down;
  c10::optional<at::Tensor> down_bias;
  int64_t act;  // 0 silu, 1 gelu (tanh approximation)
  int64_t heads, kv_heads, head_dim;
  double scale;
};

// The decoder layers of one model, run over (batch, n) new positions in one call (bf16_decoder.cpp):
// each layer writes its keys/values at ``start .. start + n`` of its cache buffers (batch, kv_heads,
// max_len, head_dim) and attends over ``0 .. start + n`` under ``masks[type]``. Returns the last layer's
// output, then the input of each layer listed in ``record``.
struct DecoderStack {
  explicit DecoderStack(std::vector<DecoderLayer> layers) : layers(std::move(layers)) {}
  std::vector<at::Tensor> forward(at::Tensor x, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                  int64_t start, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                                  const std::vector<at::Tensor>& masks, const std::vector<int64_t>& record) const;
  std::vector<DecoderLayer> layers;
};

// The EAGLE-3 head's drafting step on the kernels (eagle3_step.cpp): for n new (embedding, feature)
// rows, optionally fuse the target features (fc), run the draft decoder layer (two input norms over the
// concatenation, q/k/v with the head's rotary embedding, the cache write, attention, o, the MLP) with
// the feature as the residual stream, and project the outputs to the draft vocabulary. Rows before
// ``outputs_from`` (committed inputs no output is read of) only write their keys and values.
// Returns {layer output (n - outputs_from, hidden), logits (n - outputs_from, draft vocab)}.
struct Eagle3Step {
  Eagle3Step(at::Tensor fc, std::vector<at::Tensor> norms, std::vector<double> eps, std::vector<bool> unit_offset,
             std::vector<at::Tensor> qkv, at::Tensor o, std::vector<at::Tensor> gate_up, at::Tensor down,
             at::Tensor lm_head, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale);
  std::vector<at::Tensor> forward(const at::Tensor& emb, const at::Tensor& feature, bool fuse, const at::Tensor& keys,
                                  const at::Tensor& values, int64_t start, const at::Tensor& cos, const at::Tensor& sin,
                                  const c10::optional<at::Tensor>& visible, int64_t committed, int64_t outputs_from) const;
  at::Tensor fc;
  Norm input_norm, hidden_norm, post_norm, final_norm;
  std::vector<at::Tensor> qkv;
  at::Tensor o;
  std::vector<at::Tensor> gate_up;
  at::Tensor down, lm_head;
  int64_t heads, kv_heads, head_dim;
  double scale;
};

}  // namespace selfdraft
