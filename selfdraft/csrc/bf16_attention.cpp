// Attention over a bfloat16 KV cache for x86 CPUs with AVX2 + FMA but no native bf16 arithmetic.
//
// out[b, i, h, :] = sum_j softmax_j(scale * q[b, h, i] . k[b, g(h), j] + mask[b, i, j]) v[b, g(h), j]
//
// PyTorch's bf16 scaled_dot_product_attention on such a CPU costs ~5x its fp32 version (30 ms for one
// layer of a 48-row decode step over 640 cached positions on the 2-core AVX2 machine, against a 24 MB
// read of keys and values). Here every key and value row is widened to fp32 in registers as it is
// read; scores, softmax and the weighted sum run in fp32 for a tile of query rows at once, so the
// cache streams from memory once per (batch row, KV head) and query block. Grouped-query attention is
// native: the query heads of one KV head share its rows. Results are rounded to bf16 at the end, and
// a row's result depends only on the keys it sees, in order (below): tree verification in bf16 gives
// the tokens of plain decoding.
// Built into one module with the other kernels (kernels.h) by selfdraft/kernels.py.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace selfdraft {
namespace {

// e^x for x <= 0 (softmax arguments after the max is subtracted), relative error ~2e-7: x = n ln2 + r,
// |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial, 2^n through the exponent bits. Arguments
// below -87 (and -inf) give 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: exact first product
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// Where one query row's additive mask values start, and how to read them.
struct MaskRow {
  const void* data = nullptr;  // nullptr: no mask
  at::ScalarType dtype = at::kFloat;
  float at(int64_t j) const {
    switch (dtype) {
      case at::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(data)[j]);
      case at::kBool: return static_cast<const bool*>(data)[j] ? 0.0f : -std::numeric_limits<float>::infinity();
      default: return static_cast<const float*>(data)[j];
    }
  }
};

// A query row's output depends only on the sequence of keys it can see, not on where they sit or on
// what else is in the call: the same keys in the same order give the same bits, whether read in a
// one-token step (the cache, then the token) or in a tree verification (ancestors spread among
// branches the row cannot see, more keys after it, other query rows in the tile). Keys a row cannot
// see (additive bf16 minimum, -inf, bool False) get weight exactly 0, so every sum below runs over
// the keys in order and adds only exact zeros for them: the softmax's sum is one chain in key order
// (not lanes by position), the exp is the same vector function for every key (the scores padded to
// whole vectors), the weighted values sum each feature in key order. Speculative greedy decoding in
// bf16 then reproduces plain decoding token for token (tests/test_kernels.py, tests/test_smollm2.py).
constexpr int kTile = 4;  // query rows sharing each key / value row read

// R query rows (fp32, pre-scaled, in qf with row stride d) against keys 0..L-1: scores s[r * ls + j],
// each row's additive mask added.
template <int R>
void scores(const float* qf, int64_t d, const uint16_t* k, int64_t k_stride, int64_t L, const MaskRow* masks,
            float* s, int64_t ls) {
  int64_t j = 0;
  for (; j + 2 <= L; j += 2) {  // two keys at a time: twice the independent FMA chains
    const uint16_t* ka = k + j * k_stride;
    const uint16_t* kb = ka + k_stride;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) {
      const __m256 va = load_bf16x8(ka + c), vb = load_bf16x8(kb + c);
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_loadu_ps(qf + r * d + c);
        acc[r][0] = _mm256_fmadd_ps(qv, va, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qv, vb, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      s[r * ls + j] = hsum(acc[r][0]);
      s[r * ls + j + 1] = hsum(acc[r][1]);
    }
  }
  for (; j < L; ++j) {  // the same sum for a last odd key
    const uint16_t* kj = k + j * k_stride;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) {
      const __m256 kv = load_bf16x8(kj + c);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + r * d + c), kv, acc[r]);
    }
    for (int r = 0; r < R; ++r) s[r * ls + j] = hsum(acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    if (!masks[r].data) continue;
    float* sr = s + r * ls;
    int64_t t = 0;
    if (masks[r].dtype == at::kBFloat16) {
      const uint16_t* mr = static_cast<const uint16_t*>(masks[r].data);
      for (; t + 8 <= L; t += 8) _mm256_storeu_ps(sr + t, _mm256_add_ps(_mm256_loadu_ps(sr + t), load_bf16x8(mr + t)));
    } else if (masks[r].dtype == at::kFloat) {
      const float* mr = static_cast<const float*>(masks[r].data);
      for (; t + 8 <= L; t += 8) _mm256_storeu_ps(sr + t, _mm256_add_ps(_mm256_loadu_ps(sr + t), _mm256_loadu_ps(mr + t)));
    }
    for (; t < L; ++t) sr[t] += masks[r].at(t);
  }
}

// In place over one row's L scores (room for L rounded up to whole vectors): s <- exp(s - max); returns
// the sum of the terms, one chain in key order (0 when every key is masked out with -inf: then s is 0).
float softmax_numerators(float* s, int64_t L) {
  const int64_t padded = (L + 7) / 8 * 8;
  for (int64_t j = L; j < padded; ++j) s[j] = -std::numeric_limits<float>::infinity();
  __m256 mv8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < padded; j += 8) mv8 = _mm256_max_ps(mv8, _mm256_loadu_ps(s + j));
  alignas(32) float m8[8];
  _mm256_store_ps(m8, mv8);
  float m = m8[0];
  for (int e = 1; e < 8; ++e) m = std::max(m, m8[e]);
  if (m == -std::numeric_limits<float>::infinity()) {
    for (int64_t j = 0; j < L; ++j) s[j] = 0.0f;
    return 0.0f;
  }
  const __m256 mv = _mm256_set1_ps(m);
  for (int64_t j = 0; j < padded; j += 8)
    _mm256_storeu_ps(s + j, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv)));
  float total = 0.0f;
  for (int64_t j = 0; j < L; ++j) total += s[j];
  return total;
}

// acc[r * d + c] = sum_j p[r * lp + j] v[j, c] over L value rows, for features c0 .. c0 + 8A - 1: the keys
// outermost, R * A independent accumulators (no chain through the keys' latency); each feature sums
// its keys in key order whatever R and A are.
template <int R, int A>
void weighted_values(const float* p, int64_t lp, int64_t L, const uint16_t* v, int64_t v_stride, int64_t d, int64_t c0,
                     float* acc) {
  __m256 a[R][A];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < A; ++t) a[r][t] = _mm256_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    __m256 vv[A];
    for (int t = 0; t < A; ++t) vv[t] = load_bf16x8(v + j * v_stride + c0 + 8 * t);
    for (int r = 0; r < R; ++r) {
      const __m256 pr = _mm256_broadcast_ss(p + r * lp + j);
      for (int t = 0; t < A; ++t) a[r][t] = _mm256_fmadd_ps(pr, vv[t], a[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < A; ++t) _mm256_storeu_ps(acc + r * d + c0 + 8 * t, a[r][t]);
}

template <int R>
void tile(const float* qf, int64_t d, const uint16_t* k, int64_t ks, const uint16_t* v, int64_t vs, int64_t L,
          const MaskRow* masks, float* s, int64_t ls, float* acc, at::BFloat16* const* out) {
  scores<R>(qf, d, k, ks, L, masks, s, ls);
  float sums[R];
  for (int r = 0; r < R; ++r) sums[r] = softmax_numerators(s + r * ls, L);
  constexpr int A = R <= 2 ? 4 : 2;  // R * A accumulators, A values and a broadcast within the 16 registers
  int64_t c = 0;
  for (; c + 8 * A <= d; c += 8 * A) weighted_values<R, A>(s, ls, L, v, vs, d, c, acc);
  for (; c < d; c += 8) weighted_values<R, 1>(s, ls, L, v, vs, d, c, acc);
  for (int r = 0; r < R; ++r) {
    const float inv = sums[r] > 0 ? 1.0f / sums[r] : 0.0f;
    for (int64_t e = 0; e < d; ++e) out[r][e] = static_cast<at::BFloat16>(acc[r * d + e] * inv);
  }
}

}  // namespace

at::Tensor bf16_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D (batch, heads, positions, head_dim)");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "q, k, v must be bfloat16");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "bf16_attention runs on the CPU");
  const int64_t B = q.size(0), H = q.size(1), n = q.size(2), d = q.size(3);
  const int64_t Hk = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hk && v.size(2) == L, "k and v must be (batch, kv_heads, L, head_dim) like q");
  TORCH_CHECK(k.size(3) == d && v.size(3) == d, "q, k and v must share head_dim");
  TORCH_CHECK(d % 8 == 0, "head_dim must be a multiple of 8, got ", d);
  TORCH_CHECK(Hk > 0 && H % Hk == 0, "query heads (", H, ") must be a multiple of KV heads (", Hk, ")");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "head_dim must be the contiguous dimension");
  at::Tensor m;
  if (mask.has_value() && mask->defined()) {
    m = *mask;
    TORCH_CHECK(m.dim() == 4 && (m.size(0) == 1 || m.size(0) == B) && (m.size(1) == 1 || m.size(1) == H) &&
                    m.size(2) == n && m.size(3) >= L,
                "mask must be (1 or batch, 1 or heads, q positions, >= key positions)");
    TORCH_CHECK(m.scalar_type() == at::kFloat || m.scalar_type() == at::kBFloat16 || m.scalar_type() == at::kBool,
                "mask must be float32, bfloat16 (additive) or bool (True = attend)");
    if (m.stride(3) != 1) m = m.contiguous();
  }
  const int64_t G = H / Hk, rows = G * n;
  // query rows of one (batch row, KV head) per task: up to two tiles, fewer where that would leave a
  // thread idle (a one-token step has only G rows per KV head; Gemma-3 has one KV head). A row's result
  // does not depend on its task or tile, so this may follow the thread count.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t per = std::max<int64_t>(1, std::min<int64_t>(2 * kTile, (B * Hk * rows + threads - 1) / threads));
  const int64_t blocks = (rows + per - 1) / per;
  const int64_t ls = (L + 7) / 8 * 8;  // a row's scores, padded to whole vectors
  at::Tensor out = at::empty({B, n, H, d}, q.options());
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto* op = out.data_ptr<at::BFloat16>();
  const float fscale = static_cast<float>(scale);
  const size_t melem = m.defined() ? m.element_size() : 0;
  const char* mp = m.defined() ? static_cast<const char*>(m.data_ptr()) : nullptr;

  at::parallel_for(0, B * Hk * blocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(kTile * d), s(kTile * ls), acc(kTile * d);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / (Hk * blocks), hk = task / blocks % Hk, blk = task % blocks;
      const uint16_t* kb = kp + b * k.stride(0) + hk * k.stride(1);
      const uint16_t* vb = vp + b * v.stride(0) + hk * v.stride(1);
      const int64_t r1 = std::min(rows, (blk + 1) * per);
      for (int64_t r0 = blk * per; r0 < r1; r0 += kTile) {
        const int R = static_cast<int>(std::min<int64_t>(kTile, r1 - r0));
        MaskRow masks[kTile];
        at::BFloat16* outs[kTile];
        for (int r = 0; r < R; ++r) {
          const int64_t row = r0 + r, h = hk * G + row / n, i = row % n;  // query row = (head in group, position)
          const uint16_t* qr = qp + b * q.stride(0) + h * q.stride(1) + i * q.stride(2);
          for (int64_t e = 0; e < d; ++e) qf[r * d + e] = bf16_to_float(qr[e]) * fscale;
          if (mp) {
            const int64_t mb = m.size(0) == 1 ? 0 : b, mh = m.size(1) == 1 ? 0 : h;
            masks[r].data = mp + (mb * m.stride(0) + mh * m.stride(1) + i * m.stride(2)) * melem;
            masks[r].dtype = m.scalar_type();
          }
          outs[r] = op + ((b * n + i) * H + h) * d;
        }
        const float* qd = qf.data();
        float *sd = s.data(), *ad = acc.data();
        switch (R) {
          case 4: tile<4>(qd, d, kb, k.stride(2), vb, v.stride(2), L, masks, sd, ls, ad, outs); break;
          case 3: tile<3>(qd, d, kb, k.stride(2), vb, v.stride(2), L, masks, sd, ls, ad, outs); break;
          case 2: tile<2>(qd, d, kb, k.stride(2), vb, v.stride(2), L, masks, sd, ls, ad, outs); break;
          default: tile<1>(qd, d, kb, k.stride(2), vb, v.stride(2), L, masks, sd, ls, ad, outs); break;
        }
      }
    }
  });
  return out;
}

}  // namespace selfdraft
