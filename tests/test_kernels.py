"""bf16 products in fp32 on CPUs without native bf16 (selfdraft/kernels.py), and where they apply."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from conftest import random_prompt, tiny_model

import selfdraft.kernels as kernels
from selfdraft.adapter import new_cache, tree_forward
from selfdraft.kernels import UpcastMatmuls, matmul_mode, resolve_mixed_precision, upcast_linear
from selfdraft.tree import chain_tree


def fp32_reference(x, w, b=None):
    y = x.float() @ w.float().t()
    return (y + b.float() if b is not None else y).to(x.dtype)


@pytest.mark.parametrize("block", [3, 8, 64])
def test_upcast_linear_is_the_fp32_product_rounded(block):
    """Guards the block loop (several blocks, a partial last block, one block) and the bias and shapes."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16).bfloat16()
    w, b = torch.randn(21, 16).bfloat16(), torch.randn(21).bfloat16()
    scratch = torch.empty(block, 16)
    for bias in (None, b):
        got = upcast_linear(x, w, bias, scratch)
        want = fp32_reference(x.reshape(-1, 16), w, bias).reshape(2, 5, 21)
        assert got.dtype == torch.bfloat16 and got.shape == (2, 5, 21)
        diff = (got.float() - want.float()).abs().max().item()
        assert diff <= 1e-2 * want.float().abs().max().item(), f"block {block}: max diff {diff}"


def test_mode_routes_only_large_bf16_inference_products():
    """Guards the routing rule: bf16 with >= min_rows rows goes to fp32; fp32, few rows and autograd do not."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(16, 24, bias=False).bfloat16()
    mode = UpcastMatmuls(min_rows=4, block_rows=8)
    calls = []
    real = kernels.upcast_linear

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    kernels.upcast_linear = spy
    try:
        with torch.no_grad(), mode:
            lin(torch.randn(3, 16).bfloat16())  # too few rows
            lin.float()(torch.randn(8, 16))  # fp32 weights
            lin.bfloat16()
            out = lin(torch.randn(2, 4, 16).bfloat16())  # 8 rows: routed
        x = torch.randn(8, 16).bfloat16().requires_grad_()
        with mode:
            lin(x).float().sum().backward()  # autograd through the weight's product: PyTorch's own kernel
    finally:
        kernels.upcast_linear = real
    assert calls == [torch.Size([2, 4, 16])], f"routed calls: {calls}"
    assert out.shape == (2, 4, 24) and x.grad is not None and x.grad.abs().sum() > 0


def test_matmul_mode_applies_only_where_bf16_is_not_native(monkeypatch):
    """Guards the switch: fp32, small forwards and CPUs with native bf16 keep PyTorch's kernels."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(kernels, "native_bf16_matmul", lambda device_type="cpu": False)
    assert isinstance(matmul_mode(torch.bfloat16, cpu, kernels.FORWARD_MIN_ROWS), UpcastMatmuls)
    assert isinstance(matmul_mode(torch.bfloat16, cpu, kernels.FORWARD_MIN_ROWS - 1), nullcontext)
    assert isinstance(matmul_mode(torch.float32, cpu, 4096), nullcontext)
    monkeypatch.setattr(kernels, "native_bf16_matmul", lambda device_type="cpu": True)
    assert isinstance(matmul_mode(torch.bfloat16, cpu, 4096), nullcontext)
    assert resolve_mixed_precision("auto", "cpu") == "bf16"
    monkeypatch.setattr(kernels, "native_bf16_matmul", lambda device_type="cpu": False)
    assert resolve_mixed_precision("auto", "cpu") == "no"
    assert resolve_mixed_precision("bf16", "cpu") == "bf16" and resolve_mixed_precision("no", "cuda") == "no"


def test_tree_forward_in_fp32_products_matches_bf16_kernels(monkeypatch):
    """Guards the adapter's use of the mode: a bf16 target's tree forward gives the same logits within bf16
    rounding and the same argmax at (nearly) every node as with PyTorch's bf16 kernels."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    prompt = torch.tensor([random_prompt(20, 3)])

    def logits(force: bool):
        monkeypatch.setattr(kernels, "native_bf16_matmul", lambda device_type="cpu": not force)
        cache = new_cache(model, 64)
        with torch.inference_mode():
            return tree_forward(model, cache, prompt, chain_tree(prompt.shape[1] - 1)).logits.float()

    eager, upcast = logits(False), logits(True)
    scale = eager.abs().max().item()
    diff = (eager - upcast).abs().max().item()
    agree = (eager.argmax(-1) == upcast.argmax(-1)).float().mean().item()
    assert diff <= 0.05 * scale, f"max diff {diff} (logit scale {scale})"
    assert agree >= 0.9, f"argmax agreement {agree}"
