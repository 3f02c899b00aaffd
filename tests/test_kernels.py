"""bf16 products on CPUs without native bf16 (selfdraft/kernels.py): the fused kernel, the fp32 route,
and where each applies."""

from __future__ import annotations

import os
from contextlib import nullcontext

import pytest
import torch
from conftest import kernel_or_skip as fused
from conftest import random_prompt, tiny_model

import selfdraft.kernels as kernels
from selfdraft.adapter import new_cache, tree_forward
from selfdraft.kernels import (
    FusedModules,
    UpcastMatmuls,
    build_fused_kernel,
    fused_modules,
    matmul_mode,
    resolve_mixed_precision,
    upcast_linear,
)
from selfdraft.tree import chain_tree, tree_from_parents


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


def test_mode_scratch_made_in_inference_mode_serves_no_grad_forwards():
    """Guards the shared scratch: first used under inference_mode (an engine eval), then under no_grad
    (the training step after it), the same mode must still work."""
    lin = torch.nn.Linear(16, 24, bias=False).bfloat16()
    mode = UpcastMatmuls(min_rows=2, block_rows=8)
    x = torch.randn(6, 16).bfloat16()
    with torch.inference_mode(), mode:
        first = lin(x)
    with torch.no_grad(), mode:
        second = lin(x)
    assert torch.equal(first, second)


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
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tree_forward_with_other_products_matches_bf16_kernels(monkeypatch, route, arch):
    """Guards the adapter's routes (the fused kernels for a small forward, the fp32 mode for a large
    one): a bf16 target's tree forward gives the same logits within bf16 rounding and the same argmax
    at (nearly) every node as with PyTorch's bf16 kernels. Gemma-3: sliding-window masks, (1 + w)
    norms and q/k norms through the kernels."""
    if route == "fused" and build_fused_kernel() is None:
        pytest.skip("the fused bf16 kernel needs an x86 CPU with AVX2 and a C++ compiler")
    model = tiny_model(arch, dtype=torch.bfloat16)
    prompt = torch.tensor([random_prompt(14, 3)])  # 14 > the tiny Gemma-3's sliding window of 6
    if route == "upcast":
        monkeypatch.setattr(kernels, "fused_kernel", lambda: None)
    else:  # the 14-token prefill is a small forward: no fp32 mode, every product fused
        monkeypatch.setattr(kernels, "_shared_mode", lambda: pytest.fail("fp32 mode entered for a small forward"))
    calls = {"bf16_linear": 0, "bf16_attention": 0, "bf16_rms_norm": 0, "bf16_rope": 0, "stack_layers": 0}
    real_build = kernels.build_fused_kernel()

    class CountingStack:  # the lean forward's layers run in one kernel call: count the layers it runs
        def __init__(self, layers):
            self.stack, self.layers = real_build.DecoderStack(layers), len(layers)

        def forward(self, *args):
            calls["stack_layers"] += self.layers
            return self.stack.forward(*args)

    class Spy:
        def __getattr__(self, name):
            if name == "DecoderStack":
                return CountingStack
            if name == "DecoderLayer":
                return real_build.DecoderLayer

            def call(*args):
                if name == "bf16_linear_many":  # several products in one call (the lean forward's q/k/v)
                    calls["bf16_linear"] += len(args[1])
                else:
                    calls[name] += 1
                return getattr(real_build, name)(*args)

            return call

    if route == "fused":
        monkeypatch.setattr(kernels, "build_fused_kernel", lambda: Spy())

    def logits(force: bool):
        monkeypatch.setattr(kernels, "native_bf16_matmul", lambda device_type="cpu": not force)
        if force:  # the reference (native bf16, kernels off) runs PyTorch's kernels only
            monkeypatch.delenv(kernels.FUSED_ENV, raising=False)
        else:
            monkeypatch.setenv(kernels.FUSED_ENV, "0")
        cache = new_cache(model, 64)
        with torch.inference_mode():
            return tree_forward(model, cache, prompt, chain_tree(prompt.shape[1] - 1)).logits.float()

    eager, upcast = logits(False), logits(True)
    assert model.config._attn_implementation == "sdpa"  # restored after the forward
    layers = model.config.num_hidden_layers
    if route == "fused":
        # each layer through the kernels: one by one from Python (the HF forward), or inside the lean
        # forward's decoder-stack call (7 products, attention, 2 norms; Gemma-3 4 + q/k norms)
        per_layer_norms = 2 + (4 if arch == "gemma3" else 0)
        stacked = calls["stack_layers"]
        assert stacked in (0, layers), calls
        assert calls["bf16_linear"] + 7 * stacked >= 7 * layers, calls
        assert calls["bf16_attention"] + stacked == layers, calls
        assert calls["bf16_rms_norm"] + per_layer_norms * stacked >= per_layer_norms * layers + 1, calls
    scale = eager.abs().max().item()
    diff = (eager - upcast).abs().max().item()
    agree = (eager.argmax(-1) == upcast.argmax(-1)).float().mean().item()
    assert diff <= 0.05 * scale, f"max diff {diff} (logit scale {scale})"
    assert agree >= 0.9, f"argmax agreement {agree}"


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 9, 10, 11, 13, 16, 17, 19, 32])
@pytest.mark.parametrize("k,n", [(64, 48), (20, 7), (96, 101)])
def test_fused_kernel_is_the_fp32_product_rounded(rows, k, n, product_kernel):
    """Guards the kernel's paths and edges: row counts (rows and twice rows) that take one stream
    (1-10), two streams (11-16: 5 + 6 ... 8 + 8) and the row tiles with their remainders (17: 4 x 4 + 1,
    19: 4 x 4 + 3, 26: 4 x 6 + 2, ...) on the AVX2 path,
    one pass and even passes on the AVX512-BF16 one (13: 7 + 6, 32: 11 + 11 + 10), one and two column
    tiles on the AMX one (k = 64, 96; 17-32 rows), a k that is not a multiple of 8 (scalar tail; off
    the AMX path), feature counts that leave partial tiles and tasks (a zero-padded AMX tile), bias,
    batched input, bf16 and fp32 input."""
    kernel = product_kernel
    torch.manual_seed(rows * 1000 + k + n)
    w, b = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    for dtype in (torch.bfloat16, torch.float32):
        for shape in ((rows, k), (2, rows, k)):
            x = torch.randn(shape).to(dtype)
            for bias in (None, b):
                got = kernel.bf16_linear(x, w, bias)
                want = x.float() @ w.float().t() + (bias.float() if bias is not None else 0)
                assert got.dtype == dtype and got.shape == (*shape[:-1], n)
                diff = (got.float() - want).abs().max().item()
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
                assert diff <= tol * want.abs().max().item(), f"{shape} {dtype}, bias {bias is not None}: max diff {diff}"


@pytest.mark.parametrize("k", [96, 1152, 20])
def test_fused_kernel_row_results_do_not_depend_on_the_row_count(k, product_kernel):
    """Guards what greedy exactness rests on: a row's output is bit-identical whether the product has
    one row (a decode step) or several (a verified tree: on the AVX2 path one stream up to ten rows,
    two up to sixteen, the row tiles beyond; on the AVX512-BF16 path, in either register width, one pass of up to twelve rows,
    even passes beyond; on the AMX path one column tile of up to sixteen rows, two beyond),
    for every row position in a tile or pass and its remainders, with bias and a tail (k = 20: scalar
    on AVX2, masked on AVX512-BF16)."""
    kernel = product_kernel
    torch.manual_seed(k)
    w, b = torch.randn(101, k).bfloat16(), torch.randn(101).bfloat16()
    for dtype in (torch.bfloat16, torch.float32):  # fp32 output keeps differences bf16 rounding can hide
        x = torch.randn(26, k).to(dtype)
        for bias in (None, b):
            alone = torch.cat([kernel.bf16_linear(x[i : i + 1], w, bias) for i in range(26)])
            for rows in range(2, 27):
                got = kernel.bf16_linear(x[:rows], w, bias)
                assert torch.equal(got, alone[:rows]), f"{dtype}, {rows} rows, bias {bias is not None}"


def test_avx512_register_width_follows_the_cpu_and_switches(monkeypatch):
    """Guards the VDPBF16PS path's register width: 512-bit by default on Intel CPUs, 256-bit elsewhere
    (unless SELFDRAFT_AVX512_ZMM chose at build); the switch returns the previous setting, cpu_report
    records the width, and either width's product is the fp32 product to bf16 accuracy."""
    kernel = fused()
    if not kernel.avx512_bf16_available():
        pytest.skip("this CPU has no AVX512-BF16")
    vendor = next((line.split(":")[1].strip() for line in open("/proc/cpuinfo") if line.startswith("vendor_id")), "")
    if os.environ.get(kernels.ZMM_ENV, "") not in ("0", "1"):
        assert kernel.avx512_bf16_zmm() == (vendor == "GenuineIntel")
    before = kernel.avx512_bf16_zmm()
    torch.manual_seed(0)
    x, w = torch.randn(5, 1000).bfloat16(), torch.randn(300, 1000).bfloat16()
    want = x.float() @ w.float().t()
    monkeypatch.setattr(kernels, "fused_kernel", lambda: kernel)
    try:
        for zmm in (False, True):
            kernel.set_avx512_bf16_zmm(zmm)
            assert kernel.avx512_bf16_zmm() == zmm
            assert kernels.cpu_report()["avx512_bf16_zmm"] == (zmm and kernel.avx512_bf16_enabled())
            got = kernel.bf16_linear(x, w, None).float()
            assert (got - want).abs().max() <= 1e-2 * want.abs().max()
        assert kernel.set_avx512_bf16_zmm(before) is True
    finally:
        kernel.set_avx512_bf16_zmm(before)


def test_fused_kernel_reads_non_contiguous_input_and_reuses_its_buffer(product_kernel):
    """Guards the widening buffer the kernel keeps per calling thread: a strided view is read in its
    logical order, and a small product after a larger one reads only its own rows."""
    kernel = product_kernel
    torch.manual_seed(0)
    w = torch.randn(40, 24).bfloat16()
    big = torch.randn(7, 3, 24).bfloat16()
    strided = big.transpose(0, 1)  # (3, 7, 24), not contiguous
    for x in (strided, big[:1, :1], strided[:, ::2]):
        want = x.float() @ w.float().t()
        got = kernel.bf16_linear(x, w, None)
        assert got.shape == (*x.shape[:-1], 40)
        assert (got.float() - want).abs().max().item() <= 1e-2 * want.abs().max().item()


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("k", [40, 64])
def test_fused_kernel_many_products_equal_one_at_a_time(rows, k, product_kernel):
    """Guards the shared parallel loop: feature counts whose tasks straddle the products (7, 101, 48,
    1), biases on some products only; each output is bit-identical to that product alone (k = 64 on
    the AMX path where it is on, 40 off it)."""
    kernel = product_kernel
    torch.manual_seed(rows)
    x = torch.randn(2, rows, k).bfloat16()
    weights = [torch.randn(n, k).bfloat16() for n in (7, 101, 48, 1)]
    biases = [None, torch.randn(101).bfloat16(), None, torch.randn(1).bfloat16()]
    got = kernel.bf16_linear_many(x, weights, biases)
    assert [g.shape for g in got] == [(2, rows, w.shape[0]) for w in weights]
    for g, w, b in zip(got, weights, biases):
        assert torch.equal(g, kernel.bf16_linear(x, w, b))
    for g, w in zip(kernel.bf16_linear_many(x, weights), weights):  # no biases at all
        assert torch.equal(g, kernel.bf16_linear(x, w, None))
    with pytest.raises(RuntimeError, match="one bias"):
        kernel.bf16_linear_many(x, weights, biases[:2])
    with pytest.raises(RuntimeError, match=f"weight expects {k + 1}"):
        kernel.bf16_linear_many(x, [weights[0], torch.randn(3, k + 1).bfloat16()])
    with pytest.raises(RuntimeError, match="at least one weight"):
        kernel.bf16_linear_many(x, [])


def test_fused_kernel_rejects_bad_input():
    kernel = fused()
    with pytest.raises(RuntimeError, match="weight expects 16"):
        kernel.bf16_linear(torch.randn(3, 8).bfloat16(), torch.randn(4, 16).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel.bf16_linear(torch.randn(3, 16), torch.randn(4, 16), None)


def test_fused_modules_route_small_inference_products_and_restore_the_modules():
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
    fl = FusedModules(Spy(), [model], max_rows=4)
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


def test_fused_modules_take_fewer_rows_where_bf16_is_native(monkeypatch):
    """Guards the row limit per CPU: where oneDNN's bf16 products are native the kernel takes only the
    smallest products on its AVX2 path (it loses from ~8 rows there) and up to 16 on its AVX512-BF16
    path, elsewhere up to FUSED_MAX_ROWS; the cached routes follow the CPU's answer;
    SELFDRAFT_FUSED_BF16=0 turns them off."""
    if build_fused_kernel() is None:
        pytest.skip("the fused bf16 kernel needs an x86 CPU with AVX2 and a C++ compiler")
    model = torch.nn.Linear(8, 8).bfloat16()
    monkeypatch.setattr(kernels, "native_bf16_matmul", lambda device_type="cpu": True)
    monkeypatch.setattr(kernels, "avx512_bf16_products", lambda: True)
    assert fused_modules(model).max_rows == kernels.FUSED_MAX_ROWS_AVX512 == 16
    monkeypatch.setattr(kernels, "avx512_bf16_products", lambda: False)
    assert fused_modules(model).max_rows == kernels.FUSED_MAX_ROWS_NATIVE < 8
    monkeypatch.setattr(kernels, "native_bf16_matmul", lambda device_type="cpu": False)
    assert fused_modules(model).max_rows == kernels.FUSED_MAX_ROWS
    monkeypatch.setenv(kernels.FUSED_ENV, "0")
    assert isinstance(fused_modules(model), nullcontext)


def sdpa_reference(q, k, v, mask, scale):
    """fp32 SDPA of bf16 inputs, expanded for grouped-query attention, in the kernel's (B, n, H, D) layout."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(groups, 1), v.float().repeat_interleave(groups, 1)
    if mask is not None:
        mask = mask[..., : k.shape[2]]
        mask = mask if mask.dtype == torch.bool else mask.float()
    out = torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize(
    "b,h,hk,n,length,d",
    [(1, 9, 3, 1, 143, 64), (1, 9, 3, 9, 150, 64), (3, 4, 1, 5, 37, 256), (2, 6, 6, 13, 21, 16), (4, 2, 2, 16, 3, 8)],
)
def test_fused_attention_kernel_is_sdpa(b, h, hk, n, length, d):
    """Guards the attention kernel: grouped heads, query blocks and row tiles with remainders, head
    sizes, key/value views into a longer cache (row strides), masks wider than the keys, additive
    bf16 / fp32 and bool masks, a mask broadcast over the batch, no mask."""
    kernel = fused()
    torch.manual_seed(b * 100 + n + length)
    q = torch.randn(b, n, h, d).bfloat16().transpose(1, 2)  # HF's layout: a transposed view
    k = torch.randn(b, hk, length + 7, d).bfloat16()[:, :, :length]
    v = torch.randn(b, hk, length + 7, d).bfloat16()[:, :, :length]
    visible = torch.rand(b, 1, n, length + 3) > 0.3
    visible[..., 0] = True
    additive = torch.zeros(b, 1, n, length + 3, dtype=torch.bfloat16).masked_fill_(~visible, torch.finfo(torch.bfloat16).min)
    for mask in (additive, additive.float(), visible, visible[:1], None):
        got = kernel.bf16_attention(q, k, v, mask, d**-0.5)
        want = sdpa_reference(q, k, v, mask, d**-0.5)
        assert got.dtype == torch.bfloat16 and got.shape == (b, n, h, d)
        diff = (got.float() - want).abs().max().item()
        assert diff <= 2e-2 * max(1.0, want.abs().max().item()), f"mask {None if mask is None else mask.dtype}: {diff}"


@pytest.mark.parametrize("hk,d", [(16, 64), (4, 256)])
def test_fused_attention_rows_do_not_depend_on_the_other_rows(hk, d):
    """Guards what makes a verified tree's greedy tokens those of one-token steps, bit for bit: a query
    row's output among the rows of a tree verification (its ancestors spread among branches it cannot
    see, more keys after it, other rows and heads in its tile; additive bf16-minimum or bool mask)
    equals its output in the one-token step that would compute it in plain decoding (the cache, then
    its ancestors in order, no mask). Over many heads and cache lengths, as a difference in the last
    fp32 bit shows in a bf16 output only now and then (a few in a million): a kernel that summed the
    softmax in lanes by key position, or took a key's exp by how many keys followed it, fails here,
    and with it 1,024-token replies drifted apart from plain decoding (tests/test_smollm2.py)."""
    kernel = fused()
    torch.manual_seed(d)
    n, h = 7, 3 * hk
    tree = tree_from_parents([-1, 0, 0, 1, 2, 2, 4])  # row i sees the cache, its ancestors and itself
    k = torch.randn(1, hk, 160 + n, d).bfloat16()
    v = torch.randn(1, hk, 160 + n, d).bfloat16()
    for start in range(1, 160, 1 if d == 64 else 3):
        q = torch.randn(1, n, h, d).bfloat16().transpose(1, 2) * 3
        visible = torch.zeros(1, 1, n, start + n, dtype=torch.bool)
        visible[..., :start] = True
        visible[0, 0, :, start:] = tree.ancestors
        additive = torch.zeros(visible.shape, dtype=torch.bfloat16).masked_fill_(~visible, torch.finfo(torch.bfloat16).min)
        for mask in (additive, visible):
            together = kernel.bf16_attention(q, k[:, :, : start + n], v[:, :, : start + n], mask, d**-0.5)
            for i in range(n):
                seen = visible[0, 0, i].nonzero().flatten()  # the plain step's keys, in order
                alone = kernel.bf16_attention(q[:, :, i : i + 1], k[:, :, seen], v[:, :, seen], None, d**-0.5)
                assert torch.equal(together[:, i], alone[:, 0]), f"cache {start}, row {i}, mask {mask.dtype}"


def test_draft_head_attention_takes_the_kernel_for_bf16_steps_only(monkeypatch):
    """Guards the draft heads' attention (selfdraft/heads/layers.py): a bf16 drafting step (a few
    queries over a grouped-query cache, a tree mask) goes through the kernel, with SDPA's result to
    within bf16 rounding; fp32, gradients and long query blocks keep SDPA; the rotary table gives the
    values rope() computes, element for element, also after it grows."""
    from selfdraft.heads.layers import Attention, RopeTable, rope

    fused()
    torch.manual_seed(0)
    attn = Attention(64, 48, num_heads=6, num_kv_heads=2, head_dim=8, rope_theta=10000.0).bfloat16()
    q = torch.randn(1, 6, 5, 8).bfloat16()
    k, v = torch.randn(1, 2, 40, 8).bfloat16(), torch.randn(1, 2, 40, 8).bfloat16()
    mask = torch.rand(1, 1, 5, 40) > 0.4
    mask[..., 0] = True
    calls = []
    real = kernels.fused_kernel()

    class Spy:
        def bf16_attention(self, *args):
            calls.append(args[0].shape)
            return real.bf16_attention(*args)

    monkeypatch.setattr(kernels, "fused_kernel", lambda: Spy())
    with torch.no_grad():
        got = attn.attend(q, k, v, mask)
        assert calls == [(1, 6, 5, 8)]
        monkeypatch.setattr(kernels, "fused_kernel", lambda: None)
        want = attn.attend(q, k, v, mask)
    assert got.shape == want.shape == (1, 5, 48)
    assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()
    monkeypatch.setattr(kernels, "fused_kernel", lambda: Spy())
    with torch.no_grad():
        attn.float().attend(q.float(), k.float(), v.float(), mask)  # fp32
        attn.bfloat16()
        long_q = torch.randn(1, 6, kernels.FUSED_ATTENTION_MAX_QUERIES + 1, 8).bfloat16()
        attn.attend(long_q, k, v, torch.ones(1, 1, long_q.shape[2], 40, dtype=torch.bool))
    attn.attend(q.requires_grad_(), k, v, mask)  # training
    assert len(calls) == 1
    table = RopeTable(8, 10000.0)
    for positions in (torch.tensor([[3, 4, 4, 9]]), torch.arange(700)[None], torch.tensor([[0, 699, 5]])):
        for got_t, want_t in zip(table(positions), rope(positions, 8, 10000.0)):
            assert torch.equal(got_t, want_t)
    assert table.cos.shape[0] >= 700


def test_fused_attention_kernel_edges_and_bad_input():
    """A query row with every key masked out (bool) gives zeros, not NaN; bad shapes and dtypes raise
    with the reason."""
    kernel = fused()
    q, k = torch.randn(1, 2, 2, 8).bfloat16(), torch.randn(1, 1, 4, 8).bfloat16()
    mask = torch.ones(1, 1, 2, 4, dtype=torch.bool)
    mask[0, 0, 1] = False
    out = kernel.bf16_attention(q, k, k, mask, 1.0)
    assert torch.isfinite(out.float()).all() and (out[0, 1] == 0).all()
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel.bf16_attention(q.float(), k, k, None, 1.0)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        kernel.bf16_attention(torch.randn(1, 3, 2, 8).bfloat16(), torch.randn(1, 2, 4, 8).bfloat16(),
                              torch.randn(1, 2, 4, 8).bfloat16(), None, 1.0)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        kernel.bf16_attention(torch.randn(1, 1, 1, 6).bfloat16(), torch.randn(1, 1, 4, 6).bfloat16(),
                              torch.randn(1, 1, 4, 6).bfloat16(), None, 1.0)
    with pytest.raises(RuntimeError, match="mask must be"):
        kernel.bf16_attention(q, k, k, torch.zeros(1, 1, 2, 3), 1.0)


def test_rms_norm_kernel_reproduces_hf_norms_and_rejects_others():
    """Guards both norm conventions against the HF modules themselves (Llama: weight * bf16(x_hat);
    Gemma-3: bf16(x_hat * (1 + weight))), rows in parallel, and the probe that keeps a norm with other
    arithmetic on its own forward."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    kernel = fused()
    torch.manual_seed(5)
    for cls, unit_offset in ((LlamaRMSNorm, False), (Gemma3RMSNorm, True)):
        norm = cls(72, eps=1e-6).bfloat16()
        with torch.no_grad():
            norm.weight.copy_(torch.randn(72) * 0.5 + (0 if unit_offset else 1))
            assert kernels.rms_norm_convention(norm, kernel) == (1e-6, unit_offset)
            for rows in (1, 3, 700):
                x = (torch.randn(rows, 72) * 3).bfloat16()
                want, got = norm(x).float(), kernel.bf16_rms_norm(x, norm.weight, 1e-6, unit_offset).float()
                ulp = (want.abs() * 2**-7).clamp_min(1e-30)
                assert ((got - want).abs() <= ulp).all() and (got == want).float().mean() >= 0.99, cls.__name__

    class ScaledRMSNorm(LlamaRMSNorm):  # same attributes, other arithmetic
        def forward(self, x):
            return super().forward(x) * 2

    scaled = ScaledRMSNorm(72).bfloat16()
    with torch.no_grad():
        scaled.weight.copy_(torch.randn(72))  # (with weight 1 it would equal the Gemma convention)
    assert kernels.rms_norm_convention(scaled, kernel) is None
    assert kernels.rms_norm_convention(LlamaRMSNorm(72), kernel) is None  # fp32 weights: not this kernel's


def test_fused_attention_switches_sdpa_layers_only_inside(monkeypatch):
    """Guards the attention route: inside, SDPA layers look up the fused attention; on exit (also
    nested) the configured implementation is back; eager models are left alone; autograd, long query
    runs and fp32 go to HF's SDPA."""
    real = fused()  # the built module; the spy below stands in for fused_kernel()
    model = tiny_model("llama", dtype=torch.bfloat16)
    fa = kernels.FusedAttention(model)
    assert len(fa) == 1
    with fa, fa:
        assert model.config._attn_implementation == kernels.ATTENTION_NAME
    assert model.config._attn_implementation == "sdpa"
    eager = tiny_model("llama", dtype=torch.bfloat16)
    eager.config._attn_implementation = "eager"
    assert len(kernels.FusedAttention(eager)) == 0
    attn = model.model.layers[0].self_attn
    calls = []

    class Spy:
        def bf16_attention(self, *args):
            calls.append(args[0].shape[2])
            return real.bf16_attention(*args)

    monkeypatch.setattr(kernels, "fused_kernel", lambda: Spy())
    q, k = torch.randn(1, 4, 3, 8).bfloat16(), torch.randn(1, 2, 5, 8).bfloat16()
    mask = torch.zeros(1, 1, 3, 5, dtype=torch.bfloat16)
    with torch.no_grad():
        out, _ = kernels._attention(attn, q, k, k, mask, scaling=0.3)
        want, _ = kernels._attention(attn, q, k, k, mask, scaling=0.3, softcap=None, output_attentions=True)  # SDPA
        long_q = torch.randn(1, 4, kernels.FUSED_ATTENTION_MAX_QUERIES + 1, 8).bfloat16()
        kernels._attention(attn, long_q, k, k, torch.zeros(1, 1, long_q.shape[2], 5, dtype=torch.bfloat16))
        kernels._attention(attn, q.float(), k.float(), k.float(), mask.float())
    kernels._attention(attn, q.requires_grad_(), k, k, mask)
    assert calls == [3], calls
    assert (out.float() - want.float()).abs().max() <= 2e-2


@pytest.mark.parametrize("shape", ["prefix", "window", "bool"])
def test_long_masked_attention_in_query_blocks_equals_one_call(models, monkeypatch, shape):
    """Guards the blockwise SDPA of long masked forwards: each block of queries over only its visible
    key span gives what one SDPA call over every key gives (a prompt after a 40-token prefix, a
    window of 32, a bool mask), and the spans really are narrower than the keys."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    monkeypatch.setattr(kernels, "ATTENTION_QUERY_BLOCK", 16)
    module = models["llama"].model.layers[0].self_attn
    torch.manual_seed(0)
    n, prefix, d = 70, 40, module.head_dim
    q = torch.randn(1, 4, n, d)
    k, v = torch.randn(1, 2, prefix + n, d), torch.randn(1, 2, prefix + n, d)
    qpos, kpos = torch.arange(prefix, prefix + n), torch.arange(prefix + n)
    visible = qpos[:, None] >= kpos[None, :]
    if shape == "window":
        visible &= qpos[:, None] - kpos[None, :] < 32
    mask = visible[None, None]
    if shape != "bool":
        mask = torch.zeros(visible.shape).masked_fill_(~visible, torch.finfo(torch.float32).min)[None, None]
    spans = []

    def sdpa(module, query, key, *args, **kwargs):
        spans.append(key.shape[2])
        return sdpa_attention_forward(module, query, key, *args, **kwargs)

    monkeypatch.setattr("transformers.integrations.sdpa_attention.sdpa_attention_forward", sdpa)
    got, _ = kernels._attention(module, q, k, v, mask, scaling=d**-0.5)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=d**-0.5)
    assert got.shape == want.shape == (1, n, 4, d)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert len(spans) == 5 and max(spans) <= prefix + n and min(spans) < prefix + n
    if shape == "window":
        assert max(spans) <= 16 + 31


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_long_bf16_forward_after_a_prefix_runs_attention_in_query_blocks(monkeypatch, arch):
    """Guards the wiring of the blockwise SDPA: a bf16 target's masked forward of more queries than a
    block (a chain after a prefix; Gemma-3's sliding-window layers) takes it inside the adapter's
    attention and gives the one-call logits within bf16 rounding, the same argmax at nearly every node.
    (The model's own forward: a prompt's new tokens after a cached prefix take it; a verification of
    that many rows takes the lean forward, which the test turns off.)"""
    if build_fused_kernel() is None:
        pytest.skip("the blockwise path sits in the fused attention, which needs the fused bf16 kernel")
    from selfdraft.lean_forward import LEAN_ENV

    monkeypatch.setenv(LEAN_ENV, "0")
    model = tiny_model(arch, dtype=torch.bfloat16)
    prompt = torch.tensor([random_prompt(60, 5)])
    blocks = []
    real = kernels._blockwise_attention
    monkeypatch.setattr(kernels, "_blockwise_attention", lambda *a, **k: blocks.append(1) or real(*a, **k))
    runs = []
    for size in (1 << 30, 16):
        monkeypatch.setattr(kernels, "ATTENTION_QUERY_BLOCK", size)
        cache = new_cache(model, 64)
        with torch.inference_mode():
            tree_forward(model, cache, prompt[:, :8], chain_tree(7))
            runs.append(tree_forward(model, cache, prompt[:, 8:], chain_tree(51)).logits.float())
    assert len(blocks) == model.config.num_hidden_layers  # every layer of the second run
    one, split = runs
    assert (one - split).abs().max() <= 0.05 * one.abs().max()
    assert (one.argmax(-1) == split.argmax(-1)).float().mean() >= 0.9
