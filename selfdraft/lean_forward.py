"""A lean forward for decode steps of Llama-family and Gemma-3 targets in bf16 on the CPU kernels.

A one-token SmolLM2 step through Hugging Face's forward costs ~37 ms on the 2-core AVX2 CPU, of which
the kernels (``selfdraft/csrc``: products, attention, norms) take ~22 ms; the rest is Python and
small eager ops around them: per layer the module calls, rotary embedding (~14 eager ops), the
cache update, the attention-interface lookup, and the output-recording hooks. For forwards small
enough for the kernels (a decode step, a draft tree), :func:`lean_forward` runs the same arithmetic
as that forward with the fused kernels, straight over the model's own weights: the same kernels in
the same order, the rotary embedding as one kernel with eager bf16's roundings, the model's own
rotary module for cos/sin, the same :class:`~selfdraft.cache.SpecCache` layers. The decoder layers
run in one call to the decoder-stack kernel (``csrc/bf16_decoder.cpp``, built from the plan once), so
no Python runs between a layer's ~18 operations (~1.8 ms of a one-token SmolLM2 step). Its logits,
hidden states and cache entries are bit-identical to the Hugging Face forward's with the fused kernels
taking every product (tests/test_lean_forward.py): the default on AVX2 CPUs and, up to 16 rows, where
the kernel runs its AVX512-BF16 path; where bf16 is native and the kernel is on its AVX2 path, the
model's own forward gives products of more than ``kernels.FUSED_MAX_ROWS_NATIVE`` rows to oneDNN, which
rounds differently, while the lean forward keeps them on the kernel (see :data:`LEAN_MAX_ROWS_NATIVE`).
Every verification takes the lean forward whatever its size (:func:`lean_applies`), so each tree row
gets the bits of plain decoding's one-token step; the row limits apply to prompts.

Which targets: ``model_type`` llama, qwen2 (no q/k norms, no sliding windows) or gemma3_text (q/k
norms, sliding-window layers through their mask, four norms per layer, scaled embeddings, final
logit soft-capping), with every projection a plain bf16 ``nn.Linear``, RMSNorms the norm kernel
reproduces, SDPA attention and an activation that matches the config's on a probe. Anything else
(other architectures, peft-wrapped layers, fp32, larger forwards) goes through the model's own
forward.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from selfdraft import kernels
from selfdraft.cache import PreallocatedLayer, SpecCache
from selfdraft.greedy_screen import lm_head_screen, screened_logits
from selfdraft.kernels import FUSED_MAX_ROWS, rms_norm_convention
from selfdraft.screened_draws import ScreenedDraws, screened_draws

LEAN_MODEL_TYPES = ("llama", "qwen2", "gemma3_text")
LEAN_MAX_ROWS_NATIVE = 16
"""Most tokens (over the batch) of a prompt's forward the lean forward takes where bf16 is native
(FUSED_MAX_ROWS elsewhere; a verification it takes at any size, :func:`lean_applies`); all its products
run on the product kernel and its attention on the attention kernel.
That beat the model's own forward when it gave products past kernels.FUSED_MAX_ROWS_NATIVE (6) rows
to oneDNN (the kernel's AVX2 path): on a 2-core AVX512-BF16 EPYC after 256 cached tokens (medians of 15, interleaved),
SmolLM2 7 rows 24.0 vs 49.1 ms, 8: 25.4 vs 47.4, 12: 34.7 vs 50.4, 16: 44.0 vs 53.8; Gemma-3-270M
7: 39.5 vs 52.4, 12: 60.5 vs 60.3, 16: 74.2 vs 68.4 (its 262k-row lm_head is where oneDNN wins).
oneDNN products inside the lean forward lost to the kernel at 7-12 rows (SmolLM2 7 rows 30.6 vs
23.5 ms; docs/perf_log.md). On the kernel's AVX512-BF16 path both forwards keep every product of up
to 16 rows on it, and the lean one stays 1.1-1.5x faster (SmolLM2 8 tokens 17.1 vs 23.6 ms, 16: 28.7
vs 35.0; Gemma-3 8: 28.5 vs 33.0, 16: 44.9 vs 49.4)."""
LEAN_MAX_ROWS_AMX = 24
"""The same limit where the product kernel multiplies on AMX tiles (:func:`kernels.amx_bf16_products`):
there a row costs little past the first, and on a 2-core Sapphire Rapids after 256 cached tokens
(medians of 7, interleaved) the lean forward beat the model's own forward (oneDNN past 16 rows) at
SmolLM2 20 tokens 32.9 vs 51.5 ms, 24: 35.0 vs 50.5, 32: 40.3 vs 51.6, and tied on Gemma-3-270M at
20-24 (57.8 vs 59.6, 61.3 vs 60.6) while losing at 32 (75.0 vs 63.9; docs/perf_log.md, forty-fourth
session)."""
LEAN_ENV = "SELFDRAFT_LEAN_FORWARD"
"""Set to 0 to send every forward through the model's own (Hugging Face) forward."""


@dataclass(frozen=True)
class _Norm:
    weight: Tensor
    eps: float
    unit_offset: bool


@dataclass(frozen=True)
class _Layer:
    """One decoder layer. Llama: x += o(attn(norm_in(x))); x += mlp(norm_mlp_in(x)). Gemma-3 adds q/k
    norms over each head, a norm of the attention output and one of the MLP output before each sum,
    and a layer type (sliding or full attention: its mask and its rotary frequencies)."""

    layer_type: str
    input_norm: _Norm
    q: nn.Linear
    k: nn.Linear
    v: nn.Linear
    o: nn.Linear
    mlp_norm: _Norm
    gate: nn.Linear
    up: nn.Linear
    down: nn.Linear
    act: int
    """Activation code of the decoder-stack kernel (:data:`_ACTIVATIONS`)."""
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    q_norm: _Norm | None = None
    k_norm: _Norm | None = None
    attn_out_norm: _Norm | None = None
    mlp_out_norm: _Norm | None = None
    def kernel_layer(self, kernel, type_index: int):
        """This layer as the decoder-stack kernel's ``DecoderLayer`` (references to the same weights)."""
        norms = (self.input_norm, self.q_norm, self.k_norm, self.attn_out_norm, self.mlp_norm, self.mlp_out_norm)
        return kernel.DecoderLayer(
            type_index,
            [None if m is None else m.weight for m in norms],
            [0.0 if m is None else m.eps for m in norms],
            [False if m is None else m.unit_offset for m in norms],
            [self.q.weight, self.k.weight, self.v.weight],
            [self.q.bias, self.k.bias, self.v.bias],
            self.o.weight,
            self.o.bias,
            [self.gate.weight, self.up.weight],
            [self.gate.bias, self.up.bias],
            self.down.weight,
            self.down.bias,
            self.act,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.scale,
        )


@dataclass(frozen=True)
class LeanPlan:
    """What :func:`lean_forward` reads from one model, gathered once (references, no copies)."""

    embed: nn.Module
    rotary: nn.Module
    rotary_per_type: bool
    """Gemma-3's rotary module takes the layer type (local and global frequencies)."""
    layers: tuple[_Layer, ...]
    norm: _Norm
    lm_head: nn.Linear
    logit_softcap: float | None
    layer_types: tuple[str, ...]
    """The distinct layer types; a layer's index in it selects its rotary table and mask in the stack."""
    stack: object
    """The layers as the kernel module's ``DecoderStack`` (one call runs them all)."""


_PLANS: weakref.WeakKeyDictionary[nn.Module, LeanPlan | None] = weakref.WeakKeyDictionary()

_ACTIVATIONS: dict[str, tuple[Callable[[Tensor], Tensor], int]] = {
    "silu": (F.silu, 0),
    "gelu_pytorch_tanh": (lambda x: F.gelu(x, approximate="tanh"), 1),
}
"""Activations by config name: the eager function each model's module is checked against on a probe,
and its code in the decoder-stack kernel (``csrc/bf16_decoder.cpp``)."""


def _plain_bf16_linear(m: object) -> bool:
    return (
        type(m) is nn.Linear
        and m.weight.dtype == torch.bfloat16
        and m.weight.device.type == "cpu"
        and "forward" not in vars(m)
        and not m.weight.requires_grad
    )


def _norm(module: object, kernel) -> _Norm | None:
    if not isinstance(module, nn.Module) or module.weight.requires_grad:
        return None
    convention = rms_norm_convention(module, kernel)
    return None if convention is None else _Norm(module.weight, *convention)


def _activation(module: object, name: str | None) -> int | None:
    """The kernel's code for the config's activation ``name`` if ``module`` computes exactly it (checked
    on a probe: activation classes vary by version), else None."""
    fn, code = _ACTIVATIONS.get(name, (None, None))
    if fn is None or not callable(module):
        return None
    probe = (torch.randn(64, generator=torch.Generator().manual_seed(0)) * 4).bfloat16()
    with torch.no_grad():
        try:
            return code if torch.equal(module(probe), fn(probe)) else None
        except Exception:
            return None


def _build_plan(model: nn.Module, kernel) -> LeanPlan | None:
    cfg = model.config
    gemma = cfg.model_type == "gemma3_text"
    if cfg.model_type not in LEAN_MODEL_TYPES or getattr(cfg, "_attn_implementation", None) != "sdpa":
        return None
    layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
    if not set(layer_types) <= ({"full_attention", "sliding_attention"} if gemma else {"full_attention"}):
        return None
    if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "use_bidirectional_attention", False):
        return None
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return None
    base = model.get_decoder()
    embed, rotary = getattr(base, "embed_tokens", None), getattr(base, "rotary_emb", None)
    lm_head = model.get_output_embeddings()
    if not isinstance(embed, nn.Embedding) or embed.max_norm is not None or rotary is None:
        return None
    if not _plain_bf16_linear(lm_head) or any("forward" in vars(m) for m in (model, base, embed, rotary)):
        return None
    act_name = getattr(cfg, "hidden_activation", None) if gemma else getattr(cfg, "hidden_act", None)
    layers = []
    for layer, layer_type in zip(base.layers, layer_types):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projections += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(_plain_bf16_linear(p) for p in projections) or any("forward" in vars(m) for m in (layer, attn, mlp)):
            return None
        act = _activation(getattr(mlp, "act_fn", None), act_name)
        names = ["input_layernorm", "post_attention_layernorm"]
        if gemma:
            names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        norms = [_norm(getattr(layer, n, None), kernel) for n in names]
        head_norms = [_norm(getattr(attn, n, None), kernel) for n in ("q_norm", "k_norm")] if gemma else []
        if act is None or None in norms or None in head_norms:
            return None
        head_dim = int(attn.head_dim)
        layers.append(
            _Layer(
                layer_type,
                norms[0],
                *projections[:4],
                norms[2] if gemma else norms[1],
                *projections[4:],
                act=act,
                heads=projections[0].out_features // head_dim,
                kv_heads=projections[1].out_features // head_dim,
                head_dim=head_dim,
                scale=float(attn.scaling),
                q_norm=head_norms[0] if gemma else None,
                k_norm=head_norms[1] if gemma else None,
                attn_out_norm=norms[1] if gemma else None,
                mlp_out_norm=norms[3] if gemma else None,
            )
        )
    norm = _norm(getattr(base, "norm", None), kernel)
    if norm is None:
        return None
    softcap = getattr(cfg, "final_logit_softcapping", None)
    types = tuple(dict.fromkeys(layer.layer_type for layer in layers))
    stack = kernel.DecoderStack([layer.kernel_layer(kernel, types.index(layer.layer_type)) for layer in layers])
    return LeanPlan(embed, rotary, gemma, tuple(layers), norm, lm_head, softcap, types, stack)


def lean_plan(model: nn.Module, kernel) -> LeanPlan | None:
    """The model's :class:`LeanPlan` (built once per model object), or None where the lean forward does
    not reproduce the model's own. Not remembered while some module's ``forward`` is replaced (inside
    :class:`~selfdraft.kernels.FusedModules`, say): the answer may differ outside."""
    if model in _PLANS:
        return _PLANS[model]
    plan = _build_plan(model, kernel)
    if plan is not None or not any("forward" in vars(m) for m in model.modules()):
        _PLANS[model] = plan
    return plan


def lean_max_rows() -> int:
    """Most tokens (over the batch) of a prompt's forward the lean forward takes on this CPU (a
    verification it takes at any size)."""
    if not kernels.native_bf16_matmul("cpu"):
        return FUSED_MAX_ROWS
    return LEAN_MAX_ROWS_AMX if kernels.amx_bf16_products() else LEAN_MAX_ROWS_NATIVE


def lean_applies(model: nn.Module, cache: object, tokens: Tensor, verification: bool = False
                 ) -> tuple[LeanPlan, object] | None:
    """(plan, kernel module) for a forward of ``tokens`` (batch, n) into ``cache``, or None where it must
    go through the model's own forward (kernels off or not built, too many tokens for them, another
    cache, gradients on). ``verification``: the forward verifies a draft (every row's logits read, its
    accepted rows' keys and values kept), so it stays on the kernels at any size: only they give a
    tree's rows the bits of the one-token steps of plain decoding (greedy identity in bf16); the
    model's own forward gives products past ``kernels.fused_max_rows()`` rows to oneDNN or the fp32
    route, which round differently (until the forty-fourth session a tree of 17 or more nodes on an
    AVX512-BF16 CPU, such as an EAGLE head's untuned default of 16 drafted tokens, went there and
    its replies drifted from plain decoding's)."""
    if os.environ.get(LEAN_ENV, "1") == "0" or (kernel := kernels.fused_kernel()) is None:
        return None
    if tokens.device.type != "cpu" or torch.is_grad_enabled() or not isinstance(cache, SpecCache):
        return None
    # other forwards (prompts) of up to lean_max_rows() tokens: past that the model's own forward is
    # as fast or faster (oneDNN, the fp32 route), and a prompt's rounding is the same for every decoder
    if not verification and tokens.numel() > lean_max_rows():
        return None
    if not all(type(layer) is PreallocatedLayer for layer in cache.layers):
        return None
    plan = lean_plan(model, kernel)
    if plan is None or len(cache.layers) < len(plan.layers):
        return None
    return plan, kernel


def _rms_norm(kernel, x: Tensor, norm: _Norm) -> Tensor:
    return kernel.bf16_rms_norm(x, norm.weight, norm.eps, norm.unit_offset)


def lean_forward(
    plan: LeanPlan,
    k,
    cache: SpecCache,
    tokens: Tensor,
    position_ids: Tensor,
    mask: Tensor | dict[str, Tensor],
    hidden_layers: tuple[int, ...] = (),
    last_logits_only: bool = False,
    argmax_only: bool = False,
    draw_temperature: float = 0.0,
) -> tuple[Tensor | None, dict[int, Tensor] | None, ScreenedDraws | None]:
    """The model's forward over ``tokens`` (batch, n) at ``position_ids`` (batch, n) with the additive
    bf16 ``mask`` (1, 1, n, cache.length + n), or one per layer type (sliding-window models), writing
    K/V into ``cache``.

    Returns (logits (batch, n or 1, vocab) in bf16, {index: hidden state} for ``hidden_layers`` with Hugging
    Face's numbering: 0 the embeddings, i the input of layer i, the number of layers (or -1) the final
    normed state, draws). ``k`` is the kernel module (:func:`selfdraft.kernels.fused_kernel`). With
    ``argmax_only`` (a greedy step) the logits may be screened (:mod:`selfdraft.greedy_screen`): each
    row's argmax is the full projection's, values that cannot be a row's maximum are -inf. With
    ``draw_temperature`` T > 0 (a step that only draws from softmax(logits / T)) the projection may be
    screened for draws instead (:mod:`selfdraft.screened_draws`): logits None, draws the rows' sampler
    (rows in batch-major order); otherwise draws is None.
    """
    num_layers = len(plan.layers)
    wanted = {i % (num_layers + 1): i for i in hidden_layers}
    b, n = tokens.shape
    x = plan.embed(tokens)
    if plan.rotary_per_type:
        rope = [plan.rotary(x, position_ids, t) for t in plan.layer_types]
    else:
        rope = [plan.rotary(x, position_ids)] * len(plan.layer_types)
    masks = [mask[t] for t in plan.layer_types] if isinstance(mask, dict) else [mask] * len(plan.layer_types)
    layers = cache.layers[:num_layers]
    start = layers[0].length
    for layer, spec in zip(layers, plan.layers):
        if layer.length != start:
            raise RuntimeError(f"cache layers disagree on their length ({layer.length} != {start})")
        if not layer.is_initialized:
            like = x.new_empty(b, spec.kv_heads, 0, spec.head_dim)
            layer.lazy_initialization(like, like)
        layer.reserve(n)
    record = [i for i in sorted(wanted) if i < num_layers]
    out = plan.stack.forward(x, [layer.keys for layer in layers], [layer.values for layer in layers], start,
                             [c for c, _ in rope], [s for _, s in rope], masks, record)
    for layer in layers:
        layer.length = start + n
    x = out[0]
    hidden: dict[int, Tensor] = {wanted[i]: h for i, h in zip(record, out[1:])}
    x = _rms_norm(k, x, plan.norm)
    if num_layers in wanted:
        hidden[wanted[num_layers]] = x
    rows = x[:, -1:] if last_logits_only else x
    hidden = hidden if hidden_layers else None
    screen = None
    if (argmax_only or draw_temperature > 0) and plan.logit_softcap is None:
        screen = lm_head_screen(plan.lm_head, rows.shape[0] * rows.shape[1])
    if screen is not None and draw_temperature > 0:
        draws = screened_draws(k, screen, rows, draw_temperature)
        if draws is not None:
            return None, hidden, draws
    logits = screened_logits(k, screen, rows) if screen is not None and argmax_only else None
    if logits is None:
        logits = k.bf16_linear(rows, plan.lm_head.weight, plan.lm_head.bias)
        if plan.logit_softcap is not None:
            logits = torch.tanh(logits / plan.logit_softcap) * plan.logit_softcap
    return logits, hidden, None
