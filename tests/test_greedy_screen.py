"""The greedy logit screen (selfdraft/greedy_screen.py, csrc/int8_linear.cpp): its bound holds, the
screened argmax is the full product's (ties and near-ties included), and greedy generation does not
change when it takes the lm_head."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import kernel_or_skip, random_prompt, tiny_model

import selfdraft.greedy_screen as gs
import selfdraft.lean_forward as lean
from selfdraft.drafters import draft_model, layer_skip_drafter
from selfdraft.drafters.prompt_lookup import PromptLookupDrafter
from selfdraft.generate import GenerationConfig, generate
from selfdraft.sampling import SamplingConfig


def weights(v: int, k: int, seed: int) -> torch.Tensor:
    """bf16 rows of varied scale, with outliers, an all-zero row, exact duplicates and one-ulp neighbours."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, k, generator=g) * torch.exp(torch.randn(v, 1, generator=g))
    w[torch.rand(v, k, generator=g) < 0.002] *= 30
    w[3] = 0
    w = w.bfloat16()
    w[v // 2] = w[7]  # an exact tie with a lower row
    w[v // 3] = w[v // 2 + 1]  # ... and with a higher one
    w[v // 4] = (w[11].view(torch.int16) + 1).view(torch.bfloat16)  # one ulp apart, element by element
    return w


def inputs(rows: int, k: int, seed: int, weight: torch.Tensor) -> torch.Tensor:
    """Random rows, some aimed at the duplicated and neighbouring weight rows (decisive near-ties)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * (0.1 + 10 * torch.rand(rows, 1, generator=g))
    for i in range(0, rows, 3):
        x[i] += 4 * weight[[7, 11, weight.shape[0] // 2 + 1][i % 3]].float()
    return x.bfloat16()


def quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 kernel's int16 view of input rows (int8_linear.cpp quantize_rows), in fp64: (xs, xq, eps)."""
    k = x.shape[-1]
    level = min(16383, (2**31 - 1) // (127 * k))
    x = x.double()
    xs = (x.abs().amax(1).float() / level).double()
    xq = torch.round(x / xs[:, None]).clamp(-level, level)
    eps = ((x - xs[:, None] * xq).norm(dim=1) + 2.0**-22 * xs * xq.norm(dim=1)) * (1 + 2.0**-10)
    return xs, xq, eps


@pytest.mark.parametrize("k", [64, 100])
def test_int8_products_and_their_bound(k):
    """Guards build_screen and int8_linear: the int8 product is xs * (xq @ q.T) * scale for the int16 view
    of each input row, to fp32 accuracy, and the true product x @ w.T (fp64) lies within ||x|| * bound +
    eps(x) * qnorm of it on every row, for inputs small and large."""
    kernel = kernel_or_skip()
    w = weights(600, k, k)
    screen = gs.build_screen(w)
    assert screen.q.dtype == torch.int8 and screen.q.abs().max() <= 127 and torch.all(screen.q[3] == 0)
    for seed, size in enumerate([1e-3, 1.0, 1e3]):
        x = (inputs(7, k, 1 + seed, w).float() * size).bfloat16()
        approx = kernel.int8_linear(x, screen.q, screen.scale)
        xs, xq, eps = quantized(x)
        want = xs[:, None] * (xq @ screen.q.double().T) * screen.scale.double()
        assert (approx.double() - want).abs().max() <= 1e-6 * want.abs().max()
        true = x.double() @ w.double().T
        spread = x.double().norm(dim=1, keepdim=True) * screen.bound.double() + eps[:, None] * screen.qnorm.double()
        assert bool(((true - approx.double()).abs() <= spread).all())
    assert torch.isnan(kernel.int8_linear(x * float("nan"), screen.q, screen.scale)).all()
    with pytest.raises(RuntimeError, match="int8"):
        kernel.int8_linear(x, screen.q.float(), screen.scale)
    with pytest.raises(RuntimeError, match="features"):
        kernel.int8_linear(x[:, :-1], screen.q, screen.scale)


@pytest.mark.parametrize("k", [64, 100, 20])
def test_int8_passes_give_the_same_bits_on_every_path(k):
    """Guards the int8 passes' 512-bit forms (AVX512BW, VNNI): their sums are exact integers, so the
    product, the screen's kept rows and the upper bounds equal the AVX2 form's bit for bit, for one to
    seven rows (passes of four and their remainders) and a k with a scalar tail (100, 20)."""
    kernel = kernel_or_skip()
    if not kernel.avx512_bf16_available():
        pytest.skip("this CPU has no AVX512")
    w = weights(600, k, k)
    screen = gs.build_screen(w)
    allowance = gs.norm_allowance(k)
    for rows in range(1, 8):
        x = inputs(rows, k, rows, w)
        got = {}
        for avx512 in (True, False):
            before = kernel.set_avx512_bf16(avx512)
            try:
                got[avx512] = (kernel.int8_linear(x, screen.q, screen.scale),
                               kernel.int8_screen(x, screen.q, screen.scale, screen.bound, screen.qnorm, allowance,
                                                  gs.SCREEN_MARGIN),
                               kernel.int8_upper(x, screen.q, screen.scale, screen.bound, screen.qnorm, allowance, 0.0))
            finally:
                kernel.set_avx512_bf16(before)
        for a, b in zip(got[True], got[False]):
            assert torch.equal(a, b), f"{rows} rows"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_screened_argmax_is_the_full_products(rows, product_kernel):
    """Guards screened_logits: on 240 inputs (near-ties, exact ties across rows, zero rows), each row's
    argmax equals the full product's, the kept values are the full product's bit for bit, the rest
    -inf, and far fewer rows than the vocabulary are kept."""
    v, k = 2048, 96
    w = weights(v, k, rows)
    screen = gs.build_screen(w)
    kept = []
    for seed in range(240 // rows):
        x = inputs(rows, k, 100 + seed, w)
        full = product_kernel.bf16_linear(x, w, None)
        got = gs.screened_logits(product_kernel, screen, x)
        assert got is not None and got.shape == full.shape and got.dtype == torch.bfloat16
        assert torch.equal(got.argmax(-1), full.argmax(-1))
        finite = torch.isfinite(got)
        assert torch.equal(got[finite], full[finite]) and bool((got[~finite] == -math.inf).all())
        kept.append(int(finite.any(0).sum()))
    assert max(kept) < v // 4 and sorted(kept)[len(kept) // 2] < 64


def test_screen_declines_what_it_cannot_decide():
    """Guards the fallbacks: non-finite input or weights give None (the full product decides), and
    lm_head_screen applies to bias-free bf16 projections of at most SCREEN_MAX_ROWS rows only, and is
    rebuilt when the weight moves."""
    kernel = kernel_or_skip()
    w = weights(256, 32, 0)
    x = inputs(1, 32, 0, w)
    assert gs.screened_logits(kernel, gs.build_screen(w), x * float("inf")) is None
    bad = w.clone()
    bad[5, 0] = float("nan")
    assert gs.screened_logits(kernel, gs.build_screen(bad), x) is None
    head = torch.nn.Linear(32, 256, bias=False).bfloat16()
    first = gs.lm_head_screen(head, 1)
    assert first is not None and gs.lm_head_screen(head, gs.SCREEN_MAX_ROWS) is first
    assert gs.lm_head_screen(head, gs.SCREEN_MAX_ROWS + 1) is None
    head.float()
    assert gs.lm_head_screen(head, 1) is None
    head.bfloat16()
    assert gs.lm_head_screen(head, 1) not in (None, first)
    assert gs.lm_head_screen(torch.nn.Linear(32, 256, bias=True).bfloat16(), 1) is None


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_generation_is_unchanged_by_the_screen(monkeypatch, arch):
    """Guards the screen's use in the decode loop: bf16 greedy generation, plain, with prompt lookup and
    with layer-skip drafts, gives the same tokens with the screen on and off, and the screen took steps;
    sampled steps never take its argmax path (they draw: tests/test_screened_draws.py); a draft model's
    greedy forwards ask for it, its sampled ones do not."""
    kernel_or_skip()
    model = tiny_model(arch, dtype=torch.bfloat16)
    calls = {"n": 0}
    real = lean.screened_logits

    def counting(*a):
        calls["n"] += 1
        return real(*a)

    monkeypatch.setattr(lean, "screened_logits", counting)
    prompt = random_prompt(12, 5) * 2  # repeats: lookup drafts
    skip = layer_skip_drafter(model, layers=1)
    for drafter in (None, PromptLookupDrafter(num_tokens=1), PromptLookupDrafter(num_tokens=4), skip):
        outs = []
        for on in ("0", "1"):
            monkeypatch.setenv(gs.SCREEN_ENV, on)
            calls["n"] = 0
            outs.append(generate(model, prompt, drafter, GenerationConfig(max_new_tokens=40)).tokens)
            assert (calls["n"] > 0) == (on == "1")
        assert outs[0] == outs[1]
    calls["n"] = 0
    generate(model, prompt, None, GenerationConfig(max_new_tokens=8, sampling=SamplingConfig(1.0), seed=0))
    assert calls["n"] == 0
    # a draft model's (here the layer-skip view's) greedy forwards ask for the screen, sampled ones do not
    greedy_flags = []
    real_forward = draft_model.tree_forward

    def recording(*a, **kw):
        greedy_flags.append(kw.get("argmax_only", False))
        return real_forward(*a, **kw)

    monkeypatch.setattr(draft_model, "tree_forward", recording)
    generate(model, prompt, skip, GenerationConfig(max_new_tokens=16))
    assert greedy_flags and all(greedy_flags), greedy_flags
    greedy_flags.clear()
    generate(model, prompt, skip, GenerationConfig(max_new_tokens=8, sampling=SamplingConfig(1.0), seed=0))
    assert greedy_flags and not any(greedy_flags), greedy_flags
