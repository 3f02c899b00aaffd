// Attention over a bfloat16 KV cache for x86 CPUs with AVX2 + FMA but no native bf16 arithmetic.
//
// out[b, i, h, :] = sum_j softmax_j(scale * q[b, h, i] . k[b, g(h), j] + mask[b, i, j]) v[b, g(h), j]
//
// PyTorch's bf16 scaled_dot_product_attention on such a CPU costs ~5x its fp32 version (30 ms for one
// layer of a 48-row decode step over 640 cached positions on the 2-core AVX2 machine, against a 24 MB
// read of keys and values). Here every key and value row is widened to fp32 in registers as it is
// read; scores, softmax and the weighted sum run in fp32 for a tile of query rows at once, so the
// cache streams from memory once per (batch row, KV head) and query block. Grouped-query attention is
// native: the query heads of one KV head share its rows. Results are rounded to bf16 at the end.
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

// R query rows (fp32, pre-scaled, in qf with row stride d) against keys 0..L-1: scores s[r * L + j].
template <int R>
void scores(const float* qf, int64_t d, const uint16_t* k, int64_t k_stride, int64_t L, const MaskRow* masks,
            float* s) {
  for (int64_t j = 0; j < L; ++j) {
    const uint16_t* kj = k + j * k_stride;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) {
      const __m256 kv = load_bf16x8(kj + c);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + r * d + c), kv, acc[r]);
    }
    for (int r = 0; r < R; ++r) s[r * L + j] = hsum(acc[r]) + (masks[r].data ? masks[r].at(j) : 0.0f);
  }
}

// In place: s <- exp(s - max), returns the sum (0 when every key is masked out with -inf).
float softmax_numerators(float* s, int64_t L) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < L; ++j) m = std::max(m, s[j]);
  if (m == -std::numeric_limits<float>::infinity()) {
    for (int64_t j = 0; j < L; ++j) s[j] = 0.0f;
    return 0.0f;
  }
  const __m256 mv = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= L; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = hsum(total);
  for (; j < L; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

// R rows of weights p (row stride L) times values 0..L-1, divided by each row's sum: out rows (bf16).
template <int R>
void weighted_values(const float* p, int64_t L, const float* sums, const uint16_t* v, int64_t v_stride, int64_t d,
                     at::BFloat16* const* out) {
  for (int64_t c = 0; c < d; c += 8) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < L; ++j) {
      const __m256 vv = load_bf16x8(v + j * v_stride + c);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(p[r * L + j]), vv, acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, _mm256_mul_ps(acc[r], _mm256_set1_ps(sums[r] > 0 ? 1.0f / sums[r] : 0.0f)));
      for (int t = 0; t < 8; ++t) out[r][c + t] = static_cast<at::BFloat16>(tmp[t]);
    }
  }
}

constexpr int kTile = 4;          // query rows sharing each key / value row read
constexpr int64_t kBlockRows = 8;  // query rows of one (batch row, KV head) per parallel task

template <int R>
void tile(const float* qf, int64_t d, const uint16_t* k, int64_t ks, const uint16_t* v, int64_t vs, int64_t L,
          const MaskRow* masks, float* s, at::BFloat16* const* out) {
  scores<R>(qf, d, k, ks, L, masks, s);
  float sums[R];
  for (int r = 0; r < R; ++r) sums[r] = softmax_numerators(s + r * L, L);
  weighted_values<R>(s, L, sums, v, vs, d, out);
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
  const int64_t G = H / Hk, rows = G * n, blocks = (rows + kBlockRows - 1) / kBlockRows;
  at::Tensor out = at::empty({B, n, H, d}, q.options());
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto* op = out.data_ptr<at::BFloat16>();
  const float fscale = static_cast<float>(scale);
  const size_t melem = m.defined() ? m.element_size() : 0;
  const char* mp = m.defined() ? static_cast<const char*>(m.data_ptr()) : nullptr;

  at::parallel_for(0, B * Hk * blocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(kTile * d), s(kTile * L);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / (Hk * blocks), hk = task / blocks % Hk, blk = task % blocks;
      const uint16_t* kb = kp + b * k.stride(0) + hk * k.stride(1);
      const uint16_t* vb = vp + b * v.stride(0) + hk * v.stride(1);
      const int64_t r1 = std::min(rows, (blk + 1) * kBlockRows);
      for (int64_t r0 = blk * kBlockRows; r0 < r1; r0 += kTile) {
        const int R = static_cast<int>(std::min<int64_t>(kTile, r1 - r0));
        MaskRow masks[kTile];
        at::BFloat16* outs[kTile];
        for (int r = 0; r < R; ++r) {
          const int64_t row = r0 + r, h = hk * G + row / n, i = row % n;  // query row = (head in group, position)
          const uint16_t* qr = qp + b * q.stride(0) + h * q.stride(1) + i * q.stride(2);
          for (int64_t c = 0; c < d; ++c) qf[r * d + c] = bf16_to_float(qr[c]) * fscale;
          if (mp) {
            const int64_t mb = m.size(0) == 1 ? 0 : b, mh = m.size(1) == 1 ? 0 : h;
            masks[r].data = mp + (mb * m.stride(0) + mh * m.stride(1) + i * m.stride(2)) * melem;
            masks[r].dtype = m.scalar_type();
          }
          outs[r] = op + ((b * n + i) * H + h) * d;
        }
        switch (R) {
          case 4: tile<4>(qf.data(), d, kb, k.stride(2), vb, v.stride(2), L, masks, s.data(), outs); break;
          case 3: tile<3>(qf.data(), d, kb, k.stride(2), vb, v.stride(2), L, masks, s.data(), outs); break;
          case 2: tile<2>(qf.data(), d, kb, k.stride(2), vb, v.stride(2), L, masks, s.data(), outs); break;
          default: tile<1>(qf.data(), d, kb, k.stride(2), vb, v.stride(2), L, masks, s.data(), outs); break;
        }
      }
    }
  });
  return out;
}

}  // namespace selfdraft
