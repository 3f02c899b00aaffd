// Rotary position embedding of bf16 query or key heads in one pass.
//
// Hugging Face's eager apply_rotary_pos_emb runs ~7 ops per tensor (two products, two slices, a
// negation, a concatenation, a sum), each rounding to bf16: x * cos + rotate_half(x) * sin, where
// rotate_half(x) = cat(-x2, x1) over the two halves of the head dimension. This kernel computes the
// same values with the same three roundings per element:
//   out[i] = bf16(bf16(x[i] * cos[i]) + bf16(r[i] * sin[i])),  r = (-x2, x1)
// A product of two bf16 values is exact in fp32, so each rounding matches PyTorch's bf16 op.
#include "kernels.h"

namespace selfdraft {
namespace {

inline float rounded_product(float a, float b) { return bf16_to_float(round_bf16(a * b)); }

}  // namespace

at::Tensor bf16_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4, "x must be (batch, positions, heads, head_dim), got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
              "x, cos and sin must be bfloat16");
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "bf16_rope runs on the CPU");
  const int64_t B = x.size(0), n = x.size(1), H = x.size(2), d = x.size(3);
  TORCH_CHECK(d % 2 == 0, "head_dim must be even, got ", d);
  TORCH_CHECK(cos.dim() == 3 && sin.sizes() == cos.sizes() && (cos.size(0) == 1 || cos.size(0) == B) &&
                  cos.size(1) == n && cos.size(2) == d,
              "cos and sin must be (batch or 1, positions, head_dim) = (", B, ", ", n, ", ", d, "), got ", cos.sizes());
  const at::Tensor xc = x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor y = at::empty_like(xc);
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* cp = reinterpret_cast<const uint16_t*>(cc.data_ptr<at::BFloat16>());
  const auto* sp = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t half = d / 2;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < n; ++t) {
      const int64_t row = (cos.size(0) == 1 ? 0 : b) * n + t;
      const uint16_t* c = cp + row * d;
      const uint16_t* s = sp + row * d;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t off = ((b * n + t) * H + h) * d;
        const uint16_t* xh = xp + off;
        uint16_t* yh = yp + off;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = bf16_to_float(xh[i]), x2 = bf16_to_float(xh[i + half]);
          yh[i] = round_bf16(rounded_product(x1, bf16_to_float(c[i])) + rounded_product(-x2, bf16_to_float(s[i])));
          yh[i + half] = round_bf16(rounded_product(x2, bf16_to_float(c[i + half])) +
                                    rounded_product(x1, bf16_to_float(s[i + half])));
        }
      }
    }
  }
  return y;
}

}  // namespace selfdraft
