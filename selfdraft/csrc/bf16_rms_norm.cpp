// RMSNorm of bfloat16 rows in one pass, for CPUs where PyTorch's eager version is a chain of small ops.
//
// Hugging Face's RMSNorm modules run ~8 eager ops per call (upcast, pow, mean, add, rsqrt, mul,
// downcast, mul): ~40-85 us for one 576-wide row on the 2-core AVX2 machine, 61 calls per SmolLM2
// forward. Here each row is read once: the sum of squares accumulates in fp32, then the row is scaled
// and multiplied by the weight, with the roundings of the two conventions in use:
//   weight * bf16(x * rsqrt(mean(x^2) + eps))     (Llama, Mistral, Qwen: unit_offset = false)
//   bf16(x * rsqrt(mean(x^2) + eps) * (1 + weight)) (Gemma: unit_offset = true)
// selfdraft/kernels.py checks each module against its own forward before routing it here.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace selfdraft {
namespace {

void norm_row(const uint16_t* x, const uint16_t* w, int64_t h, float eps, bool unit_offset, uint16_t* y) {
  __m256 acc = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= h; c += 8) {
    const __m256 v = load_bf16x8(x + c);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum(acc);
  for (; c < h; ++c) ss += bf16_to_float(x[c]) * bf16_to_float(x[c]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
  for (c = 0; c < h; ++c) {
    const float n = bf16_to_float(x[c]) * inv;
    const float wc = bf16_to_float(w[c]);
    y[c] = unit_offset ? round_bf16(n * (1.0f + wc)) : round_bf16(wc * bf16_to_float(round_bf16(n)));
  }
}

}  // namespace

at::Tensor bf16_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "x and weight must be bfloat16");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "bf16_rms_norm runs on the CPU");
  TORCH_CHECK(weight.dim() == 1 && x.dim() >= 1 && x.size(-1) == weight.size(0), "weight must be 1-D with x's last size (",
              x.size(-1), "), got ", weight.sizes());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t h = weight.size(0), rows = h == 0 ? 0 : xc.numel() / h;
  at::Tensor y = at::empty_like(xc);
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float e = static_cast<float>(eps);
  // rows in parallel only when there are many: a thread hand-off costs more than a few rows
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(h, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * h, wp, h, e, unit_offset, yp + r * h);
  });
  return y;
}

}  // namespace selfdraft
