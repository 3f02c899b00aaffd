"""An EAGLE-3 head's drafting step in one call to the CPU kernels (``csrc/eagle3_step.cpp``).

On SmolLM2 the tree ``selfdraft tune`` picks on a 2-core AVX2 CPU is one head node, so a draft step
gains ~0.35 tokens and has to cost well under that share of a ~13-15 ms target step. Through the
head's modules a step costs ~2-3 ms, of which the kernels (products, attention, norms) take ~0.8 ms:
the rest is ~25 module calls and small eager ops (the rotary embedding alone ~12), each ~4-10 us of
interpreter and dispatch. :func:`lean_step` gives the kernel module's ``Eagle3Step`` built over the
head's own weights (references, no copies), which runs the same operations with the same kernels in
the same order in one call: its layer output and draft logits are bit-identical to the modules'
under :class:`~selfdraft.kernels.FusedModules` (tests/test_eagle3.py).

It applies to a bf16 :class:`~selfdraft.heads.eagle3.Eagle3Head` on the CPU for inference steps of
at most :data:`~selfdraft.kernels.FUSED_ATTENTION_MAX_QUERIES` rows (a catch-up on the prompt goes
through the modules and the fp32 route), with plain ``nn.Linear`` projections and norms the norm
kernel reproduces; ``SELFDRAFT_LEAN_STEP=0`` turns it off.
"""

from __future__ import annotations

import os
import weakref

import torch
from torch import nn

from selfdraft import kernels
from selfdraft.heads.eagle3 import Eagle3Head
from selfdraft.kernels import rms_norm_convention

LEAN_STEP_ENV = "SELFDRAFT_LEAN_STEP"
"""Set to 0 to run every drafting step through the head's modules."""

_STEPS: weakref.WeakKeyDictionary[nn.Module, tuple[list[tuple[nn.Parameter, int]], object | None]] = (
    weakref.WeakKeyDictionary()
)


def _plain_bf16_linear(m: object) -> bool:
    return (
        type(m) is nn.Linear
        and m.bias is None
        and m.weight.dtype == torch.bfloat16
        and m.weight.device.type == "cpu"
        and "forward" not in vars(m)
    )


def _build(head: Eagle3Head, kernel):
    """The kernel's ``Eagle3Step`` over ``head``'s weights, or None where it would not reproduce the modules."""
    layer = head.midlayer
    attn, mlp = layer.self_attn, layer.mlp
    linears = [head.fc, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj,
               head.lm_head]
    norms = [layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, head.norm]
    conventions = [rms_norm_convention(m, kernel) for m in norms]
    if not all(_plain_bf16_linear(m) for m in linears) or None in conventions:
        return None
    if any("forward" in vars(m) for m in (layer, attn, mlp)) or attn.head_dim % 8 != 0:  # the attention kernel's rows
        return None
    return kernel.Eagle3Step(
        head.fc.weight,
        [m.weight for m in norms],
        [eps for eps, _ in conventions],
        [unit_offset for _, unit_offset in conventions],
        [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
        attn.o_proj.weight,
        [mlp.gate_proj.weight, mlp.up_proj.weight],
        mlp.down_proj.weight,
        head.lm_head.weight,
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        attn.head_dim**-0.5,
    )


def lean_step(head: nn.Module):
    """The kernel module's ``Eagle3Step`` over ``head``'s weights for inference steps of at most
    FUSED_ATTENTION_MAX_QUERIES rows, or None where steps must go through the head's modules (another
    head type, not bf16 on the CPU, the kernels off or not built). Call it outside FusedModules (which
    replaces the modules' forwards it checks).

    Built once per head and rebuilt when a parameter's storage changes (``head.to(...)``): the step
    holds references to the weights it was built over."""
    if not isinstance(head, Eagle3Head):
        return None
    if os.environ.get(LEAN_STEP_ENV, "1") == "0" or (kernel := kernels.fused_kernel()) is None:
        return None
    entry = _STEPS.get(head)
    if entry is None or any(p.data_ptr() != ptr for p, ptr in entry[0]):
        params = [(p, p.data_ptr()) for p in head.parameters()]
        step = _build(head, kernel)
        if step is None and any("forward" in vars(m) for m in head.modules()):
            return None  # inside FusedModules, say: the answer may differ outside, do not remember it
        entry = _STEPS[head] = (params, step)
    return entry[1]
