"""A lean forward for decode steps of Llama-family targets in bf16 on the CPU kernels.

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

Which targets: ``model_type`` llama or qwen2 (what the decoder layer computes is fixed by that: no
q/k norms, no sliding windows, no soft-capping) with every projection a plain bf16 ``nn.Linear``,
RMSNorms the norm kernel reproduces, SDPA attention and SiLU. Anything else (other architectures,
peft-wrapped layers, fp32, larger forwards) returns None and goes through the model's own forward.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from selfdraft import kernels
from selfdraft.cache import PreallocatedLayer, SpecCache
from selfdraft.kernels import FUSED_ATTENTION_MAX_QUERIES, fused_max_rows, rms_norm_convention

LEAN_MODEL_TYPES = ("llama", "qwen2")
LEAN_ENV = "SELFDRAFT_LEAN_FORWARD"
"""Set to 0 to send every forward through the model's own (Hugging Face) forward."""


@dataclass(frozen=True)
class _Norm:
    weight: Tensor
    eps: float
    unit_offset: bool


@dataclass(frozen=True)
class _Layer:
    input_norm: _Norm
    q: nn.Linear
    k: nn.Linear
    v: nn.Linear
    o: nn.Linear
    post_norm: _Norm
    gate: nn.Linear
    up: nn.Linear
    down: nn.Linear
    heads: int
    kv_heads: int
    head_dim: int
    scale: float

    @property
    def qkv_weights(self) -> list[Tensor]:
        return [self.q.weight, self.k.weight, self.v.weight]

    @property
    def qkv_biases(self) -> list[Tensor | None]:
        return [self.q.bias, self.k.bias, self.v.bias]

    @property
    def gate_up_weights(self) -> list[Tensor]:
        return [self.gate.weight, self.up.weight]

    @property
    def gate_up_biases(self) -> list[Tensor | None]:
        return [self.gate.bias, self.up.bias]


@dataclass(frozen=True)
class LeanPlan:
    """What :func:`lean_forward` reads from one model, gathered once (references, no copies)."""

    embed: nn.Embedding
    rotary: nn.Module
    layers: tuple[_Layer, ...]
    norm: _Norm
    lm_head: nn.Linear


_PLANS: weakref.WeakKeyDictionary[nn.Module, LeanPlan | None] = weakref.WeakKeyDictionary()


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


def _is_silu(act: object) -> bool:
    """Whether ``act`` computes exactly ``F.silu`` (checked on a probe: activation classes vary by version)."""
    if not callable(act):
        return False
    probe = (torch.randn(64, generator=torch.Generator().manual_seed(0)) * 4).bfloat16()
    with torch.no_grad():
        try:
            return torch.equal(act(probe), F.silu(probe))
        except Exception:
            return False


def _build_plan(model: nn.Module, kernel) -> LeanPlan | None:
    cfg = model.config
    if cfg.model_type not in LEAN_MODEL_TYPES:
        return None
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or getattr(cfg, "hidden_act", None) != "silu":
        return None
    if set(getattr(cfg, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return None
    if getattr(cfg, "use_sliding_window", False):
        return None
    base = model.get_decoder()
    embed, rotary = getattr(base, "embed_tokens", None), getattr(base, "rotary_emb", None)
    lm_head = model.get_output_embeddings()
    if type(embed) is not nn.Embedding or embed.max_norm is not None or rotary is None or not _plain_bf16_linear(lm_head):
        return None
    if "forward" in vars(base) or "forward" in vars(model):
        return None
    layers = []
    for layer in base.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projections += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(_plain_bf16_linear(p) for p in projections):
            return None
        if any("forward" in vars(m) for m in (layer, attn, mlp)) or not _is_silu(getattr(mlp, "act_fn", None)):
            return None
        norms = [_norm(getattr(layer, n, None), kernel) for n in ("input_layernorm", "post_attention_layernorm")]
        if None in norms:
            return None
        head_dim = int(attn.head_dim)
        layers.append(
            _Layer(
                norms[0], *projections[:4], norms[1], *projections[4:],
                heads=projections[0].out_features // head_dim,
                kv_heads=projections[1].out_features // head_dim,
                head_dim=head_dim,
                scale=float(attn.scaling),
            )
        )
    norm = _norm(getattr(base, "norm", None), kernel)
    if norm is None:
        return None
    return LeanPlan(embed, rotary, tuple(layers), norm, lm_head)


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
    mask: Tensor,
    hidden_layers: tuple[int, ...] = (),
    last_logits_only: bool = False,
) -> tuple[Tensor, dict[int, Tensor] | None]:
    """The model's forward over ``tokens`` (batch, n) at ``position_ids`` (batch, n) with the additive
    bf16 ``mask`` (1, 1, n, cache.length + n), writing K/V into ``cache``.

    Returns (logits (batch, n or 1, vocab) in bf16, {index: hidden state} for ``hidden_layers`` with Hugging
    Face's numbering: 0 the embeddings, i the input of layer i, the number of layers (or -1) the final
    normed state). ``k`` is the kernel module (:func:`selfdraft.kernels.fused_kernel`).
    """
    num_layers = len(plan.layers)
    wanted = {i % (num_layers + 1): i for i in hidden_layers}
    hidden: dict[int, Tensor] = {}
    b, n = tokens.shape
    x = F.embedding(tokens, plan.embed.weight)
    cos, sin = plan.rotary(x, position_ids)
    for i, layer in enumerate(plan.layers):
        if i in wanted:
            hidden[wanted[i]] = x
        h = _rms_norm(k, x, layer.input_norm)
        q, key, value = k.bf16_linear_many(h, layer.qkv_weights, layer.qkv_biases)
        q = k.bf16_rope(q.view(b, n, layer.heads, layer.head_dim), cos, sin)
        key = k.bf16_rope(key.view(b, n, layer.kv_heads, layer.head_dim), cos, sin)
        value = value.view(b, n, layer.kv_heads, layer.head_dim)
        keys, values = cache.layers[i].update(key.transpose(1, 2), value.transpose(1, 2))
        a = k.bf16_attention(q.transpose(1, 2), keys, values, mask, layer.scale)
        x = x + k.bf16_linear(a.view(b, n, -1), layer.o.weight, layer.o.bias)
        h = _rms_norm(k, x, layer.post_norm)
        gate, up = k.bf16_linear_many(h, layer.gate_up_weights, layer.gate_up_biases)
        x = x + k.bf16_linear(F.silu(gate) * up, layer.down.weight, layer.down.bias)
    x = _rms_norm(k, x, plan.norm)
    if num_layers in wanted:
        hidden[wanted[num_layers]] = x
    logits = k.bf16_linear(x[:, -1:] if last_logits_only else x, plan.lm_head.weight, plan.lm_head.bias)
    return logits, (hidden if hidden_layers else None)
