// Python bindings of selfdraft's CPU kernels (see kernels.h).
#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_linear", &selfdraft::bf16_linear, "x @ weight.T (+ bias) with a bf16 weight, fp32 accumulation",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none());
  m.def("bf16_linear_many", &selfdraft::bf16_linear_many,
        "[x @ w.T (+ b) for w, b in zip(weights, biases)] in one parallel loop (biases: one per weight, None allowed, or [])",
        pybind11::arg("x"), pybind11::arg("weights"), pybind11::arg("biases") = std::vector<c10::optional<at::Tensor>>{});
  m.def("int8_linear", &selfdraft::int8_linear,
        "xs * (xq @ q.T) * scale for int8 rows q (n, k) with fp32 row scales (n,), inputs quantized to int16 per row; "
        "exact int32 sums, fp32 output",
        pybind11::arg("x"), pybind11::arg("q"), pybind11::arg("scale"));
  m.def("int8_screen", &selfdraft::int8_screen,
        "indices j where a_j + B_j >= max(a - B) - margin * max(|a| + B) in some row, a = int8_linear(x, q, scale), "
        "B = ||x|| * norm_allowance * bound + eps(x) * qnorm; empty where anything is not finite",
        pybind11::arg("x"), pybind11::arg("q"), pybind11::arg("scale"), pybind11::arg("bound"), pybind11::arg("qnorm"),
        pybind11::arg("norm_allowance"), pybind11::arg("margin"));
  m.def("int8_upper", &selfdraft::int8_upper,
        "(m, n) fp32 U = a + B + rounding * (|a| + B), a and B as int8_screen's; empty where anything is not finite",
        pybind11::arg("x"), pybind11::arg("q"), pybind11::arg("scale"), pybind11::arg("bound"), pybind11::arg("qnorm"),
        pybind11::arg("norm_allowance"), pybind11::arg("rounding"));
  m.def("bf16_argmax", &selfdraft::bf16_argmax,
        "(m,) int64 first maximum of each row of contiguous bf16 rows (m, n), as torch.argmax(-1) (a NaN wins)",
        pybind11::arg("x"));
  m.def("avx512_bf16_available", &selfdraft::avx512_bf16_available,
        "whether this CPU runs AVX512-BF16 (bf16 products then use VDPBF16PS)");
  m.def("avx512_bf16_enabled", &selfdraft::avx512_bf16_enabled,
        "whether bf16 products take the AVX512-BF16 path (available and not switched off)");
  m.def("set_avx512_bf16", &selfdraft::set_avx512_bf16,
        "use the AVX512-BF16 path for bf16 products where available (default true); returns the previous setting",
        pybind11::arg("enabled"));
  m.def("avx512_bf16_zmm", &selfdraft::avx512_bf16_zmm,
        "whether the AVX512-BF16 path multiplies in 512-bit registers (default on Intel CPUs) rather than 256-bit");
  m.def("set_avx512_bf16_zmm", &selfdraft::set_avx512_bf16_zmm,
        "choose 512-bit (true) or 256-bit registers for the AVX512-BF16 path; returns the previous setting",
        pybind11::arg("enabled"));
  m.def("amx_bf16_available", &selfdraft::amx_bf16_available,
        "whether this CPU runs AMX-BF16 and this process may use its tiles (bf16 products then use TDPBF16PS)");
  m.def("amx_bf16_enabled", &selfdraft::amx_bf16_enabled,
        "whether bf16 products of widths that are multiples of 32 take the AMX path (available, not switched off)");
  m.def("set_amx_bf16", &selfdraft::set_amx_bf16,
        "use the AMX path for bf16 products where available (default true); returns the previous setting",
        pybind11::arg("enabled"));
  m.def("bf16_attention", &selfdraft::bf16_attention,
        "softmax(scale * q k^T + mask) v for bf16 q (B, H, n, D) and cache k, v (B, Hk, L, D); out (B, n, H, D)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("mask") = pybind11::none(),
        pybind11::arg("scale") = 1.0);
  m.def("bf16_rms_norm", &selfdraft::bf16_rms_norm,
        "RMSNorm of bf16 rows: weight * bf16(x_hat), or bf16(x_hat * (1 + weight)) with unit_offset",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("unit_offset") = false);
  m.def("bf16_rope", &selfdraft::bf16_rope,
        "x * cos + rotate_half(x) * sin for bf16 x (B, n, H, D) and cos, sin (B or 1, n, D), rounded as eager bf16",
        pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"));
  pybind11::class_<selfdraft::DecoderLayer>(m, "DecoderLayer", "one decoder layer's weights (see kernels.h)")
      .def(pybind11::init<int64_t, const std::vector<c10::optional<at::Tensor>>&, const std::vector<double>&,
                          const std::vector<bool>&, std::vector<at::Tensor>, std::vector<c10::optional<at::Tensor>>, at::Tensor,
                          c10::optional<at::Tensor>, std::vector<at::Tensor>, std::vector<c10::optional<at::Tensor>>,
                          at::Tensor, c10::optional<at::Tensor>, int64_t, int64_t, int64_t, int64_t, double>(),
           pybind11::arg("type"), pybind11::arg("norms"), pybind11::arg("eps"), pybind11::arg("unit_offset"),
           pybind11::arg("qkv"), pybind11::arg("qkv_bias"), pybind11::arg("o"), pybind11::arg("o_bias"),
           pybind11::arg("gate_up"), pybind11::arg("gate_up_bias"), pybind11::arg("down"), pybind11::arg("down_bias"),
           pybind11::arg("act"), pybind11::arg("heads"), pybind11::arg("kv_heads"), pybind11::arg("head_dim"),
           pybind11::arg("scale"));
  pybind11::class_<selfdraft::DecoderStack>(m, "DecoderStack", "a model's decoder layers run in one call")
      .def(pybind11::init<std::vector<selfdraft::DecoderLayer>>(), pybind11::arg("layers"))
      .def("forward", &selfdraft::DecoderStack::forward,
           "run every layer over x (B, n, hidden); returns [output, inputs of the layers in record]",
           pybind11::arg("x"), pybind11::arg("keys"), pybind11::arg("values"), pybind11::arg("start"),
           pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("masks"), pybind11::arg("record"));
  pybind11::class_<selfdraft::Eagle3Step>(m, "Eagle3Step", "an EAGLE-3 head's drafting step in one call (see kernels.h)")
      .def(pybind11::init<at::Tensor, std::vector<at::Tensor>, std::vector<double>, std::vector<bool>, std::vector<at::Tensor>,
                          at::Tensor, std::vector<at::Tensor>, at::Tensor, at::Tensor, int64_t, int64_t, int64_t, double>(),
           pybind11::arg("fc"), pybind11::arg("norms"), pybind11::arg("eps"), pybind11::arg("unit_offset"),
           pybind11::arg("qkv"), pybind11::arg("o"), pybind11::arg("gate_up"), pybind11::arg("down"),
           pybind11::arg("lm_head"), pybind11::arg("heads"), pybind11::arg("kv_heads"), pybind11::arg("head_dim"),
           pybind11::arg("scale"))
      .def("forward", &selfdraft::Eagle3Step::forward,
           "the layer over n rows written at cache position start; returns [output, logits] of rows outputs_from.. (the rows before only write keys and values)",
           pybind11::arg("emb"), pybind11::arg("feature"), pybind11::arg("fuse"), pybind11::arg("keys"),
           pybind11::arg("values"), pybind11::arg("start"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("visible"), pybind11::arg("committed"), pybind11::arg("outputs_from"));
}
