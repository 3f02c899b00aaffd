"""bf16 products on CPUs without native bf16 (selfdraft/kernels.py): the fused kernel, the fp32 route,
and where each applies."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from conftest import random_prompt, tiny_model

import selfdraft.kernels as kernels
from selfdraft.adapter import new_cache, tree_forward
from selfdraft.kernels import (
    FusedLinears,
    UpcastMatmuls,
    build_fused_kernel,
    fused_linears,
    matmul_mode,
    resolve_mixed_precision,
    upcast_linear,
)
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


@pytest.mark.parametrize("route", ["fused", "upcast"])
def test_tree_forward_with_other_products_matches_bf16_kernels(monkeypatch, route):
    """Guards the adapter's routes (the fused kernel for a small forward, the fp32 mode for a large one):
    a bf16 target's tree forward gives the same logits within bf16 rounding and the same argmax at
    (nearly) every node as with PyTorch's bf16 kernels."""
    if route == "fused" and build_fused_kernel() is None:
        pytest.skip("the fused bf16 kernel needs an x86 CPU with AVX2 and a C++ compiler")
    model = tiny_model("llama", dtype=torch.bfloat16)
    prompt = torch.tensor([random_prompt(20, 3)])
    if route == "upcast":
        monkeypatch.setattr(kernels, "fused_kernel", lambda: None)
    else:  # the 20-token prefill is a small forward: no fp32 mode, every product fused
        monkeypatch.setattr(kernels, "_shared_mode", lambda: pytest.fail("fp32 mode entered for a small forward"))
    calls = []
    real_build = kernels.build_fused_kernel()

    class Spy:
        def bf16_linear(self, x, w, b):
            calls.append(x.shape)
            return real_build.bf16_linear(x, w, b)

    if route == "fused":
        monkeypatch.setattr(kernels, "build_fused_kernel", lambda: Spy())

    def logits(force: bool):
        monkeypatch.setattr(kernels, "native_bf16_matmul", lambda device_type="cpu": not force)
        cache = new_cache(model, 64)
        with torch.inference_mode():
            return tree_forward(model, cache, prompt, chain_tree(prompt.shape[1] - 1)).logits.float()

    eager, upcast = logits(False), logits(True)
    if route == "fused":
        assert len(calls) >= 7 * model.config.num_hidden_layers, f"{len(calls)} fused products"
    scale = eager.abs().max().item()
    diff = (eager - upcast).abs().max().item()
    agree = (eager.argmax(-1) == upcast.argmax(-1)).float().mean().item()
    assert diff <= 0.05 * scale, f"max diff {diff} (logit scale {scale})"
    assert agree >= 0.9, f"argmax agreement {agree}"


def fused():
    kernel = build_fused_kernel()
    if kernel is None:
        pytest.skip("the fused bf16 kernel needs an x86 CPU with AVX2 and a C++ compiler")
    return kernel


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 16])
@pytest.mark.parametrize("k,n", [(64, 48), (20, 7), (96, 101)])
def test_fused_kernel_is_the_fp32_product_rounded(rows, k, n):
    """Guards the kernel's tiles and edges: row counts that hit each row tile and its remainder, a
    k that is not a multiple of 8 (scalar tail), feature counts that leave partial tiles and tasks,
    bias, batched input, bf16 and fp32 input."""
    kernel = fused()
    torch.manual_seed(rows * 1000 + k + n)
    w, b = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(2, rows, k).to(dtype)
        for bias in (None, b):
            got = kernel.bf16_linear(x, w, bias)
            want = x.float() @ w.float().t() + (bias.float() if bias is not None else 0)
            assert got.dtype == dtype and got.shape == (2, rows, n)
            diff = (got.float() - want).abs().max().item()
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            assert diff <= tol * want.abs().max().item(), f"{dtype}, bias {bias is not None}: max diff {diff}"


def test_fused_kernel_rejects_bad_input():
    kernel = fused()
    with pytest.raises(RuntimeError, match="weight expects 16"):
        kernel.bf16_linear(torch.randn(3, 8).bfloat16(), torch.randn(4, 16).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel.bf16_linear(torch.randn(3, 16), torch.randn(4, 16), None)


def test_fused_linears_route_small_inference_products_and_restore_the_modules():
    """Guards the module routing: inside, small bf16 inference products go to the kernel and large
    ones, fp32 weights and autograd to F.linear; nesting is free; outside, every module is as before
    (no instance forward left behind) and modules with their own forward hook are skipped."""
    kernel = fused()
    calls = []

    class Spy:
        def bf16_linear(self, x, w, b):
            calls.append(tuple(x.shape))
            return kernel.bf16_linear(x, w, b)

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8, bias=False)).bfloat16()
    hooked = torch.nn.Linear(8, 8).bfloat16()
    hooked.forward = lambda x: x  # e.g. an accelerate hook
    model.append(hooked)
    fl = FusedLinears(Spy(), [model], max_rows=4)
    assert len(fl) == 2
    x = torch.randn(3, 16).bfloat16()
    with torch.no_grad():
        want = model(x)
        with fl, fl:  # nested
            got = model(x)
            model(torch.randn(5, 16).bfloat16())  # too many rows: F.linear
        assert "forward" not in vars(model[0]) and "forward" not in vars(model[1])
        assert vars(hooked)["forward"] is not None
    with fl:
        model(torch.randn(2, 16).bfloat16().requires_grad_()).float().sum().backward()  # autograd: F.linear
    assert calls == [(3, 16), (3, 24)], calls
    assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
    assert model[0].weight.grad is not None


def test_fused_linears_is_null_where_the_kernel_does_not_apply(monkeypatch):
    model = torch.nn.Linear(8, 8).bfloat16()
    monkeypatch.setattr(kernels, "native_bf16_matmul", lambda device_type="cpu": True)
    assert isinstance(fused_linears(model), nullcontext)
    monkeypatch.setattr(kernels, "native_bf16_matmul", lambda device_type="cpu": False)
    monkeypatch.setenv(kernels.FUSED_ENV, "0")
    assert isinstance(fused_linears(model), nullcontext)
