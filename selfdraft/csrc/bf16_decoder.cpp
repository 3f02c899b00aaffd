// A stack of Llama / Gemma-3 decoder layers over the bf16 kernels in one call.
//
// The lean forward (selfdraft/lean_forward.py) runs ~18 operations per layer around the kernels:
// norms, products, views, rotary embedding, the cache write, attention, the activation and the
// residual sums. From Python each costs ~4-6 us of interpreter and dispatch on the 2-core AVX2 CPU,
// ~3.5 ms of a one-token SmolLM2 step (30 layers) against ~17 ms for the whole step. Here the same
// operations run in the same order with the same kernels and ATen ops, so every value is bit-identical
// to the Python loop; only the interpreter between them is gone.
#include "kernels.h"

#include <algorithm>

namespace selfdraft {

DecoderLayer::DecoderLayer(int64_t type, const std::vector<c10::optional<at::Tensor>>& norms, const std::vector<double>& eps,
                           const std::vector<bool>& unit_offset, std::vector<at::Tensor> qkv,
                           std::vector<c10::optional<at::Tensor>> qkv_bias, at::Tensor o, c10::optional<at::Tensor> o_bias,
                           std::vector<at::Tensor> gate_up, std::vector<c10::optional<at::Tensor>> gate_up_bias,
                           at::Tensor down, c10::optional<at::Tensor> down_bias, int64_t act, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, double scale)
    : type(type), qkv(std::move(qkv)), qkv_bias(std::move(qkv_bias)), o(std::move(o)), o_bias(std::move(o_bias)),
      gate_up(std::move(gate_up)), gate_up_bias(std::move(gate_up_bias)), down(std::move(down)),
      down_bias(std::move(down_bias)), act(act), heads(heads), kv_heads(kv_heads), head_dim(head_dim), scale(scale) {
  TORCH_CHECK(norms.size() == 6 && eps.size() == 6 && unit_offset.size() == 6,
              "a decoder layer takes six norms (input, q, k, attention output, MLP input, MLP output), None where absent");
  TORCH_CHECK(norms[0].has_value() && norms[4].has_value(), "the input and MLP-input norms are required");
  TORCH_CHECK(norms[1].has_value() == norms[2].has_value(), "give both q and k norms or neither");
  TORCH_CHECK(this->qkv.size() == 3 && this->gate_up.size() == 2, "qkv takes three weights, gate_up two");
  TORCH_CHECK(act == 0 || act == 1, "act must be 0 (silu) or 1 (gelu, tanh approximation)");
  Norm* slots[6] = {&input_norm, &q_norm, &k_norm, &attn_out_norm, &mlp_norm, &mlp_out_norm};
  for (int i = 0; i < 6; ++i)
    if (norms[i].has_value() && norms[i]->defined()) *slots[i] = Norm{*norms[i], eps[i], static_cast<bool>(unit_offset[i])};
}

std::vector<at::Tensor> DecoderStack::forward(at::Tensor x, const std::vector<at::Tensor>& keys,
                                              const std::vector<at::Tensor>& values, int64_t start,
                                              const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                                              const std::vector<at::Tensor>& masks, const std::vector<int64_t>& record) const {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16, "x must be (batch, positions, hidden) bfloat16");
  TORCH_CHECK(keys.size() >= layers.size() && values.size() >= layers.size(), "one key and value buffer per layer");
  const int64_t b = x.size(0), n = x.size(1);
  std::vector<at::Tensor> out(1 + record.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    const DecoderLayer& L = layers[i];
    TORCH_CHECK(L.type >= 0 && static_cast<size_t>(L.type) < std::min({cos.size(), sin.size(), masks.size()}),
                "layer ", i, " has type ", L.type, " but rotary tables / masks were given for ", masks.size());
    TORCH_CHECK(keys[i].dim() == 4 && start + n <= keys[i].size(2) && start + n <= values[i].size(2),
                "layer ", i, "'s cache buffer holds ", keys[i].size(2), " positions, ", start + n, " needed");
    for (size_t r = 0; r < record.size(); ++r)
      if (record[r] == static_cast<int64_t>(i)) out[1 + r] = x;
    at::Tensor h = apply_norm(x, L.input_norm);
    std::vector<at::Tensor> qkv = bf16_linear_many(h, L.qkv, L.qkv_bias);
    at::Tensor q = qkv[0].view({b, n, L.heads, L.head_dim});
    at::Tensor key = qkv[1].view({b, n, L.kv_heads, L.head_dim});
    if (L.q_norm.weight.defined()) {
      q = apply_norm(q, L.q_norm);
      key = apply_norm(key, L.k_norm);
    }
    q = bf16_rope(q, cos[L.type], sin[L.type]);
    key = bf16_rope(key, cos[L.type], sin[L.type]);
    at::Tensor value = qkv[2].view({b, n, L.kv_heads, L.head_dim});
    keys[i].narrow(2, start, n).copy_(key.transpose(1, 2));
    values[i].narrow(2, start, n).copy_(value.transpose(1, 2));
    at::Tensor a = bf16_attention(q.transpose(1, 2), keys[i].narrow(2, 0, start + n), values[i].narrow(2, 0, start + n),
                                  masks[L.type], L.scale);
    at::Tensor o = bf16_linear(a.view({b, n, -1}), L.o, L.o_bias);
    x = x + (L.attn_out_norm.weight.defined() ? apply_norm(o, L.attn_out_norm) : o);
    h = apply_norm(x, L.mlp_norm);
    std::vector<at::Tensor> gate_up = bf16_linear_many(h, L.gate_up, L.gate_up_bias);
    at::Tensor act = L.act == 0 ? at::silu(gate_up[0]) : at::gelu(gate_up[0], "tanh");
    at::Tensor m = bf16_linear(act * gate_up[1], L.down, L.down_bias);
    x = x + (L.mlp_out_norm.weight.defined() ? apply_norm(m, L.mlp_out_norm) : m);
  }
  out[0] = x;
  return out;
}

}  // namespace selfdraft
