"""Draws through the int8 screen (selfdraft/screened_draws.py, csrc/int8_linear.cpp int8_upper): the
upper bounds hold, draws follow softmax(logits / T) exactly (chi-square, with a check that the same test
catches the proposals alone), the fallbacks keep them exact, and sampled generation takes them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import kernel_or_skip, random_prompt, tiny_model
from test_greedy_screen import inputs, quantized, weights
from test_sampling import P_MIN, chi2_pvalue, exact_third_token

import selfdraft.greedy_screen as gs
import selfdraft.screened_draws as sd
from selfdraft.drafters.base import Draft, StepResult
from selfdraft.generate import GenerationConfig, generate
from selfdraft.sampling import SamplingConfig, logits_to_probs, sample
from selfdraft.tree import chain_tree


@pytest.mark.parametrize("k", [64, 100])
def test_upper_bounds_hold_for_every_bf16_logit(k, product_kernel):
    """Guards int8_upper: U = a + B + r (|a| + B) as documented, never below the bf16 logit of the full
    product (outliers, zero rows, near-ties, large and small inputs), and empty where something is not finite."""
    w = weights(600, k, k)
    screen = gs.build_screen(w)
    allowance = gs.norm_allowance(k)
    for seed in range(6):
        x = inputs(5, k, 10 + seed, w) * (10.0 ** (seed - 2))
        upper = product_kernel.int8_upper(x, screen.q, screen.scale, screen.bound, screen.qnorm, allowance, sd.ROUNDING)
        assert upper.shape == (5, 600) and upper.dtype == torch.float32
        a = product_kernel.int8_linear(x, screen.q, screen.scale).double()
        spread = x.double().norm(dim=1, keepdim=True) * allowance * screen.bound.double()
        spread = spread + quantized(x)[2][:, None] * screen.qnorm.double()
        want = a + spread + sd.ROUNDING * (a.abs() + spread)
        assert (upper.double() - want).abs().max() <= 1e-5 * want.abs().max()
        exact = product_kernel.bf16_linear(x, w, None).float()
        assert bool((exact <= upper).all())
    assert product_kernel.int8_upper(x * float("inf"), screen.q, screen.scale, screen.bound, screen.qnorm, allowance,
                                     sd.ROUNDING).numel() == 0


def spread_weights(v: int, k: int, seed: int) -> torch.Tensor:
    """Rows of varied scale with logits a few units apart."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(v, k, generator=g) * torch.exp(0.8 * torch.randn(v, 1, generator=g)) * 0.15).bfloat16()


def loose_screen(w: torch.Tensor, seed: int) -> gs.Screen:
    """The screen of w with each row's bound raised 1-8x (still bounds): proposals far from the target,
    many rejected, so that a draw's acceptance test decides what it returns."""
    screen = gs.build_screen(w)
    raise_by = 1 + 7 * torch.rand(w.shape[0], generator=torch.Generator().manual_seed(seed))
    return dataclasses.replace(screen, bound=screen.bound * raise_by)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_draws_follow_the_softmax_of_the_logits(temperature, product_kernel):
    """Guards ScreenedDraws.draw, rows 0 and 1 of a two-row step: 12,000 draws per row match softmax(e / T)
    of the full product's bf16 logits e (bounds raised: ~half of the proposals rejected), while the same
    number of proposals alone (softmax(U / T), the rule without its acceptance test) fails the same check."""
    v, k, n = 40, 64, 12000
    w = spread_weights(v, k, 1)
    x = (torch.randn(2, k, generator=torch.Generator().manual_seed(2)) * 1.5).bfloat16()
    draws = sd.screened_draws(product_kernel, loose_screen(w, 0), x, temperature)
    assert draws is not None and len(draws) == 2
    g = torch.Generator().manual_seed(3)
    for row in range(2):
        want = logits_to_probs(product_kernel.bf16_linear(x[row : row + 1], w, None)[0], SamplingConfig(temperature))
        counts = torch.bincount(torch.tensor([draws.draw(row, g) for _ in range(n)]), minlength=v).float()
        assert chi2_pvalue(counts, want) > P_MIN, f"row {row}: draws differ from softmax(e / T)"
        proposals = sample(torch.softmax(draws.upper[row] / temperature, -1).expand(n, v), g)
        assert chi2_pvalue(torch.bincount(proposals, minlength=v).float(), want) < P_MIN, "the check cannot tell"


def test_draws_stay_exact_when_they_fall_back_and_refuse_a_wrong_bound(monkeypatch, product_kernel):
    """Guards the fallbacks: with no proposal rounds a draw samples the full product (still softmax(e / T));
    a screen whose bounds are wrong (U below some logit) raises instead of drawing from a distorted rule."""
    v, k = 40, 64
    w = spread_weights(v, k, 4)
    x = (torch.randn(1, k, generator=torch.Generator().manual_seed(5)) * 1.5).bfloat16()
    screen = gs.build_screen(w)
    want = logits_to_probs(product_kernel.bf16_linear(x, w, None)[0], SamplingConfig(1.0))
    monkeypatch.setattr(sd, "MAX_ROUNDS", 0)
    draws = sd.screened_draws(product_kernel, screen, x, 1.0)
    g = torch.Generator().manual_seed(6)
    counts = torch.bincount(torch.tensor([draws.draw(0, g) for _ in range(6000)]), minlength=v).float()
    assert chi2_pvalue(counts, want) > P_MIN
    monkeypatch.setattr(sd, "MAX_ROUNDS", 16)
    monkeypatch.setattr(sd, "ROUNDING", 0.0)
    wrong = sd.screened_draws(product_kernel, dataclasses.replace(screen, bound=torch.zeros(v), qnorm=torch.zeros(v)), x, 1.0)
    with pytest.raises(RuntimeError, match="bound"):
        for _ in range(200):
            wrong.draw(0, g)
    with pytest.raises(ValueError, match="temperature"):
        sd.screened_draws(product_kernel, screen, x, 0.0)


class ArgmaxDrafter:
    """A deterministic one-token drafter: the target's own argmax (often accepted at a low temperature)."""

    hidden_layers = ()

    def __init__(self, model):
        self.model = model

    def reset(self, step: StepResult) -> None:
        pass

    def update(self, step: StepResult) -> None:
        pass

    def propose(self, tokens, sampling, generator) -> Draft:
        guess = int(self.model(input_ids=tokens[None]).logits[0, -1].argmax())
        return Draft(chain_tree(1), torch.tensor([int(tokens[-1]), guess]))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sampled_generation_draws_through_the_screen(monkeypatch, arch):
    """Guards the screen's use at a temperature: bf16 generations at T = 0.25, plain and with one-token
    deterministic drafts (verified by drawing, accept_matching), take screened draws, get drafts accepted,
    and their second and third tokens follow the target's exact marginals; top-k sampling never takes them."""
    kernel_or_skip()
    model = tiny_model(arch, dtype=torch.bfloat16)
    cfg = SamplingConfig(temperature=0.25)  # the tiny models' logits are close together: p(argmax) ~0.2-0.4
    prompt = random_prompt(6, 7)
    want3, want2 = exact_third_token(model, prompt, cfg)
    calls = {"n": 0}
    real = sd.ScreenedDraws.draw

    def counting(self, *a):
        calls["n"] += 1
        return real(self, *a)

    monkeypatch.setattr(sd.ScreenedDraws, "draw", counting)
    for drafter in (None, ArgmaxDrafter(model)):
        counts2, counts3 = torch.zeros(model.config.vocab_size), torch.zeros(model.config.vocab_size)
        accepted = 0
        for seed in range(1200):
            out = generate(model, prompt, drafter, GenerationConfig(max_new_tokens=3, sampling=cfg, seed=seed, auto_off=False))
            counts2[out.tokens[1]] += 1
            counts3[out.tokens[2]] += 1
            accepted += out.stats.accepted
        assert calls["n"] >= 3 * 1200 - accepted, "steps went past the screen"
        if drafter is not None:
            assert accepted > 150, f"drafts must be accepted for this test to mean anything ({accepted})"
        for name, counts, want in [("x2", counts2, want2), ("x3", counts3, want3)]:
            assert chi2_pvalue(counts, want) > P_MIN, f"{arch} {drafter}: {name} differs from the target's marginal"
        calls["n"] = 0
    generate(model, prompt, None, GenerationConfig(max_new_tokens=4, sampling=SamplingConfig(1.5, top_k=20), seed=0))
    assert calls["n"] == 0
