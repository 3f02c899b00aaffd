// The EAGLE-3 head's drafting step over the bf16 kernels in one call.
//
// A draft step of the head (selfdraft/drafters/eagle.py) runs one decoder layer over a few rows: from
// Python ~25 operations and module calls (norms, a concatenation, three products, the rotary embedding
// in ~6 eager ops per tensor, the cache write, the mask, attention, the residual sums, the MLP, the
// final norm and the draft-vocabulary product), ~1.5 ms of interpreter and dispatch per step on the
// 2-core AVX2 CPU against ~0.8 ms of kernels. Here the same operations run in the same order with the
// same kernels and ATen ops as the head's Python modules under selfdraft.kernels.FusedModules, so the
// layer output and logits are bit-identical to that path; only the interpreter between them is gone.
#include "kernels.h"

namespace selfdraft {
namespace {

// The head's rotary embedding (selfdraft/heads/layers.py apply_rope): fp32 cos and sin against bf16
// heads, the products and their sum in fp32 (ATen's type promotion), rounded to bf16 once.
// x: (n, heads, head_dim) bf16; cos, sin: (n, head_dim) fp32.
at::Tensor head_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return (x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(at::kBFloat16);
}

}  // namespace

Eagle3Step::Eagle3Step(at::Tensor fc, std::vector<at::Tensor> norms, std::vector<double> eps,
                       std::vector<bool> unit_offset, std::vector<at::Tensor> qkv, at::Tensor o,
                       std::vector<at::Tensor> gate_up, at::Tensor down, at::Tensor lm_head, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, double scale)
    : fc(std::move(fc)), qkv(std::move(qkv)), o(std::move(o)), gate_up(std::move(gate_up)), down(std::move(down)),
      lm_head(std::move(lm_head)), heads(heads), kv_heads(kv_heads), head_dim(head_dim), scale(scale) {
  TORCH_CHECK(norms.size() == 4 && eps.size() == 4 && unit_offset.size() == 4,
              "the step takes four norms: input (embedding), hidden (feature), post-attention, final");
  TORCH_CHECK(this->qkv.size() == 3 && this->gate_up.size() == 2, "qkv takes three weights, gate_up two");
  TORCH_CHECK(head_dim % 2 == 0 && heads % kv_heads == 0, "head_dim must be even and heads a multiple of kv_heads");
  Norm* slots[4] = {&input_norm, &hidden_norm, &post_norm, &final_norm};
  for (int i = 0; i < 4; ++i) *slots[i] = Norm{norms[i], eps[i], static_cast<bool>(unit_offset[i])};
}

std::vector<at::Tensor> Eagle3Step::forward(const at::Tensor& emb, const at::Tensor& feature, bool fuse,
                                            const at::Tensor& keys, const at::Tensor& values, int64_t start,
                                            const at::Tensor& cos, const at::Tensor& sin,
                                            const c10::optional<at::Tensor>& visible, int64_t committed,
                                            int64_t outputs_from) const {
  TORCH_CHECK(emb.dim() == 2 && emb.scalar_type() == at::kBFloat16, "emb must be (rows, hidden) bfloat16");
  const int64_t n = emb.size(0), total = start + n;
  TORCH_CHECK(feature.dim() == 2 && feature.size(0) == n && feature.scalar_type() == at::kBFloat16,
              "feature must be (rows, width) bfloat16 with one row per embedding");
  TORCH_CHECK(keys.dim() == 4 && keys.size(0) == 1 && keys.size(1) == kv_heads && total <= keys.size(2) &&
                  values.sizes() == keys.sizes(),
              "keys and values must be (1, ", kv_heads, ", >= ", total, ", ", head_dim, ") buffers, got ", keys.sizes());
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == n && cos.size(1) == head_dim && sin.sizes() == cos.sizes(),
              "cos and sin must be (rows, head_dim)");
  TORCH_CHECK(0 <= outputs_from && outputs_from < n, "outputs_from must be in [0, rows)");
  TORCH_CHECK(0 <= committed && committed <= start, "committed must be in [0, start]");
  const int64_t m = n - outputs_from;  // rows whose output is computed; the ones before only leave keys and values
  const at::Tensor f = fuse ? bf16_linear(feature, fc, c10::nullopt) : feature;
  const at::Tensor x = at::cat({apply_norm(emb, input_norm), apply_norm(f, hidden_norm)}, -1);
  at::Tensor q_rows, k_rows, v_rows;
  if (outputs_from == 0) {  // one product call for the three
    const std::vector<at::Tensor> qkv_out = bf16_linear_many(x, qkv, {});
    q_rows = qkv_out[0], k_rows = qkv_out[1], v_rows = qkv_out[2];
  } else {  // a row's product does not depend on the rows beside it (bf16_linear.cpp): the same values
    const std::vector<at::Tensor> kv_out = bf16_linear_many(x, {qkv[1], qkv[2]}, {});
    k_rows = kv_out[0], v_rows = kv_out[1];
    q_rows = bf16_linear(x.narrow(0, outputs_from, m), qkv[0], c10::nullopt);
  }
  const at::Tensor q = head_rope(q_rows.view({m, heads, head_dim}), cos.narrow(0, outputs_from, m),
                                 sin.narrow(0, outputs_from, m));
  const at::Tensor k = head_rope(k_rows.view({n, kv_heads, head_dim}), cos, sin);
  keys[0].narrow(1, start, n).copy_(k.transpose(0, 1));
  values[0].narrow(1, start, n).copy_(v_rows.view({n, kv_heads, head_dim}).transpose(0, 1));
  c10::optional<at::Tensor> mask;
  if (visible.has_value() || m > 1) {  // one committed row, the last, sees the whole cache: no mask
    at::Tensor mk = at::ones({m, total}, emb.options().dtype(at::kBool));
    if (visible.has_value()) {
      TORCH_CHECK(visible->dim() == 2 && visible->size(0) == n && visible->size(1) == total - committed,
                  "visible must be (rows, tree entries incl. the new rows) = (", n, ", ", total - committed, ")");
      mk.narrow(1, committed, total - committed).copy_(visible->narrow(0, outputs_from, m));
    } else {  // causal among the new committed rows
      mk.narrow(1, start + outputs_from, m).copy_(at::ones({m, m}, mk.options()).tril());
    }
    mask = mk.view({1, 1, m, total});
  }
  const at::Tensor a = bf16_attention(q.unsqueeze(0).transpose(1, 2), keys.narrow(2, 0, total),
                                      values.narrow(2, 0, total), mask, scale);
  at::Tensor h = f.narrow(0, outputs_from, m) + bf16_linear(a.view({m, heads * head_dim}), o, c10::nullopt);
  const std::vector<at::Tensor> gu = bf16_linear_many(apply_norm(h, post_norm), gate_up, {});
  h = h + bf16_linear(at::silu(gu[0]) * gu[1], down, c10::nullopt);
  at::Tensor logits = bf16_linear(apply_norm(h, final_norm), lm_head, c10::nullopt);
  return {h, logits};
}

}  // namespace selfdraft
