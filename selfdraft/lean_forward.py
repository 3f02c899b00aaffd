"""A lean forward for decode steps of Llama-family and Gemma-3 targets in bf16 on the CPU kernels.

A one-token SmolLM2 step through Hugging Face's forward costs ~37 ms on the 2-core AVX2 CPU, of which
the kernels (``selfdraft/csrc``: products, attention, norms) take ~22 ms; the rest is Python and
small eager ops around them: per layer the module calls, rotary embedding (~14 eager ops), the
cache update, the attention-interface lookup, and the output-recording hooks. For forwards small
enough for the kernels (a decode step, a draft tree), :func:`lean_forward` runs the same arithmetic
as that forward with the fused kernels, straight over the model's own weights: the same kernels in
the same order, the rotary embedding as one kernel with eager bf16's roundings, the model's own
rotary module for cos/sin, the same :class:`~selfdraft.cache.SpecCache` layers. Its logits, hidden
states and cache entries are bit-identical to the Hugging Face forward's with the fused kernels
(tests/test_lean_forward.py).

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
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from selfdraft import kernels
from selfdraft.cache import PreallocatedLayer, SpecCache
from selfdraft.kernels import FUSED_ATTENTION_MAX_QUERIES, fused_max_rows, rms_norm_convention

LEAN_MODEL_TYPES = ("llama", "qwen2", "gemma3_text")
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
    act: Callable[[Tensor], Tensor]
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    q_norm: _Norm | None = None
    k_norm: _Norm | None = None
    attn_out_norm: _Norm | None = None
    mlp_out_norm: _Norm | None = None
    qkv: tuple[list[Tensor], list[Tensor | None]] = field(init=False, repr=False)
    """(weights, biases) of the combined q/k/v product call, gathered once rather than per forward."""
    gate_up: tuple[list[Tensor], list[Tensor | None]] = field(init=False, repr=False)
    """(weights, biases) of the combined gate/up product call."""

    def __post_init__(self):  # a frozen dataclass sets its derived fields through object.__setattr__
        object.__setattr__(self, "qkv", ([self.q.weight, self.k.weight, self.v.weight], [self.q.bias, self.k.bias, self.v.bias]))
        object.__setattr__(self, "gate_up", ([self.gate.weight, self.up.weight], [self.gate.bias, self.up.bias]))


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


_PLANS: weakref.WeakKeyDictionary[nn.Module, LeanPlan | None] = weakref.WeakKeyDictionary()

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
"""Activations by config name, each checked against the model's own module on a probe."""


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


def _activation(module: object, name: str | None) -> Callable[[Tensor], Tensor] | None:
    """The function for the config's activation ``name`` if ``module`` computes exactly it (checked on a
    probe: activation classes vary by version), else None."""
    fn = _ACTIVATIONS.get(name)
    if fn is None or not callable(module):
        return None
    probe = (torch.randn(64, generator=torch.Generator().manual_seed(0)) * 4).bfloat16()
    with torch.no_grad():
        try:
            return fn if torch.equal(module(probe), fn(probe)) else None
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
    return LeanPlan(embed, rotary, gemma, tuple(layers), norm, lm_head, softcap)


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


def lean_applies(model: nn.Module, cache: object, tokens: Tensor) -> tuple[LeanPlan, object] | None:
    """(plan, kernel module) for a forward of ``tokens`` (batch, n) into ``cache``, or None where it must
    go through the model's own forward (kernels off or not built, too many tokens for them, another
    cache, gradients on)."""
    if os.environ.get(LEAN_ENV, "1") == "0" or (kernel := kernels.fused_kernel()) is None:
        return None
    if tokens.device.type != "cpu" or torch.is_grad_enabled() or not isinstance(cache, SpecCache):
        return None
    if tokens.shape[-1] > FUSED_ATTENTION_MAX_QUERIES or tokens.numel() > fused_max_rows():
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
) -> tuple[Tensor, dict[int, Tensor] | None]:
    """The model's forward over ``tokens`` (batch, n) at ``position_ids`` (batch, n) with the additive
    bf16 ``mask`` (1, 1, n, cache.length + n), or one per layer type (sliding-window models), writing
    K/V into ``cache``.

    Returns (logits (batch, n or 1, vocab) in bf16, {index: hidden state} for ``hidden_layers`` with Hugging
    Face's numbering: 0 the embeddings, i the input of layer i, the number of layers (or -1) the final
    normed state). ``k`` is the kernel module (:func:`selfdraft.kernels.fused_kernel`).
    """
    num_layers = len(plan.layers)
    wanted = {i % (num_layers + 1): i for i in hidden_layers}
    hidden: dict[int, Tensor] = {}
    b, n = tokens.shape
    x = plan.embed(tokens)
    if plan.rotary_per_type:
        rope = {t: plan.rotary(x, position_ids, t) for t in {layer.layer_type for layer in plan.layers}}
    else:
        rope = dict.fromkeys({layer.layer_type for layer in plan.layers}, plan.rotary(x, position_ids))
    for i, layer in enumerate(plan.layers):
        if i in wanted:
            hidden[wanted[i]] = x
        cos, sin = rope[layer.layer_type]
        h = _rms_norm(k, x, layer.input_norm)
        q, key, value = k.bf16_linear_many(h, *layer.qkv)
        q = q.view(b, n, layer.heads, layer.head_dim)
        key = key.view(b, n, layer.kv_heads, layer.head_dim)
        if layer.q_norm is not None:
            q, key = _rms_norm(k, q, layer.q_norm), _rms_norm(k, key, layer.k_norm)
        q, key = k.bf16_rope(q, cos, sin), k.bf16_rope(key, cos, sin)
        value = value.view(b, n, layer.kv_heads, layer.head_dim)
        keys, values = cache.layers[i].update(key.transpose(1, 2), value.transpose(1, 2))
        layer_mask = mask[layer.layer_type] if isinstance(mask, dict) else mask
        a = k.bf16_attention(q.transpose(1, 2), keys, values, layer_mask, layer.scale)
        o = k.bf16_linear(a.view(b, n, -1), layer.o.weight, layer.o.bias)
        x = x + (o if layer.attn_out_norm is None else _rms_norm(k, o, layer.attn_out_norm))
        h = _rms_norm(k, x, layer.mlp_norm)
        gate, up = k.bf16_linear_many(h, *layer.gate_up)
        m = k.bf16_linear(layer.act(gate) * up, layer.down.weight, layer.down.bias)
        x = x + (m if layer.mlp_out_norm is None else _rms_norm(k, m, layer.mlp_out_norm))
    x = _rms_norm(k, x, plan.norm)
    if num_layers in wanted:
        hidden[wanted[num_layers]] = x
    logits = k.bf16_linear(x[:, -1:] if last_logits_only else x, plan.lm_head.weight, plan.lm_head.bias)
    if plan.logit_softcap is not None:
        logits = torch.tanh(logits / plan.logit_softcap) * plan.logit_softcap
    return logits, (hidden if hidden_layers else None)
