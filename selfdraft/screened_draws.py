"""Draws from softmax(logits / T) without the whole vocabulary projection: rejection sampling under the int8 screen's upper bounds.

A one-token decode step at temperature T > 0 (no top-k or top-p) only needs one draw from each row's
softmax(e / T), e the bf16 logits of the vocabulary projection. :func:`screened_draws` reads the
projection through the int8 copy of :mod:`selfdraft.greedy_screen` (half the bytes) and turns it into
upper bounds: with a_j the int8 product, B_j = ||x|| c_j + eps(x) m_j its proven distance to the
kernel's fp32 sum f_j, and e_j = bf16(f_j) within half a bf16 ulp (2^-8 |f_j|) of f_j,

    e_j <= U_j = a_j + B_j + r (|a_j| + B_j),   r = 2^-8 + 2^-20 (the last term: U's own fp32 rounding).

:meth:`ScreenedDraws.draw` is then rejection sampling: propose j from softmax(U / T), compute e_j
exactly (the bf16 kernel over the gathered weight rows; each output's sum runs in the same order
whatever the rows, so the values are bit-identical to the full product's), accept with probability
exp(e_j / T - U_j / T) <= 1. An accepted j has probability proportional to exp(U_j / T) exp((e_j -
U_j) / T) = exp(e_j / T): exactly the target's (up to the fp32 rounding every softmax has). Every
round is independent, so proposals go in batches of :data:`DRAW_BATCH` (the first accepted one is
the draw), and after :data:`MAX_ROUNDS` rejected batches the row's full product is computed and
sampled instead, which keeps the draw exact. The quotient is computed as the reference does
(``logits.float() / T``); rounding is monotone, so e_j <= U_j gives fl(e_j / T) <= fl(U_j / T).

The bounds are loose (Cauchy-Schwarz: B is ~1.3-1.8 logits on SmolLM2's and Gemma-3-270M's replies), so a
draw accepts ~14-29% of proposals; each batch costs one 32-row product of the hidden size.

Deterministic drafts need nothing else: :func:`selfdraft.acceptance.accept_matching` verifies them by
drawing from p at each node. Drafts drawn from a q need p(x) / q(x), i.e. every logit, and take the
full product.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from selfdraft.greedy_screen import Screen, norm_allowance
from selfdraft.sampling import SamplingConfig, logits_to_probs, sample

ROUNDING = 2.0**-8 + 2.0**-20
"""r in U = a + B + r (|a| + B): half a bf16 ulp of |f| <= |a| + B, plus U's fp32 rounding (three
operations of relative 2^-24 on values at most |a| + B + r (|a| + B))."""
DRAW_BATCH = 32
"""Proposals whose exact logits one kernel call computes (a draw accepts each with probability ~0.14-0.29)."""
MAX_ROUNDS = 16
"""Rejected batches after which a draw computes the row's full product instead."""


def drawable(sampling: SamplingConfig) -> bool:
    """Whether tokens of these settings are draws from softmax(logits / T) alone (no top-k, no top-p)."""
    return not sampling.greedy and sampling.top_k == 0 and sampling.top_p == 1.0


@dataclass(eq=False)
class ScreenedDraws:
    """Draws from the rows of a projection whose full logits were never computed (module docstring)."""

    kernel: object
    """The kernel module (:func:`selfdraft.kernels.fused_kernel`)."""
    screen: Screen
    rows: Tensor
    """(m, k) bf16 input rows of the projection."""
    upper: Tensor
    """(m, V) fp32 U: upper bounds on each row's bf16 logits."""
    temperature: float

    def __len__(self) -> int:
        return self.rows.shape[0]

    def draw(self, row: int, generator: torch.Generator | None = None) -> int:
        """One token from softmax(logits[row] / T)."""
        t = self.temperature
        u = self.upper[row] / t
        weights = torch.exp(u - u.max())
        cdf = weights.double().cumsum(0)
        x = self.rows[row : row + 1]
        for _ in range(MAX_ROUNDS):
            spot = torch.rand(DRAW_BATCH, dtype=torch.float64, generator=generator) * cdf[-1]
            proposed = torch.searchsorted(cdf, spot, right=True)
            if bool((proposed >= cdf.numel()).any()):  # a spot rounded up to the total: the last token with weight
                proposed.clamp_(max=int(weights.nonzero()[-1]))
            exact = self.kernel.bf16_linear(x, self.screen.weight.index_select(0, proposed), None)[0].float() / t
            gap = (exact - u[proposed]).double()
            if bool((gap > 0).any()):
                raise RuntimeError("a logit exceeded its int8 screen bound: the bound is wrong, please report this")
            accepted = (torch.rand(DRAW_BATCH, dtype=torch.float64, generator=generator) < gap.exp()).nonzero()
            if accepted.numel():
                return int(proposed[accepted[0, 0]])
        logits = self.kernel.bf16_linear(x, self.screen.weight, None)[0]
        return int(sample(logits_to_probs(logits, SamplingConfig(t)), generator))


def screened_draws(kernel, screen: Screen, x: Tensor, temperature: float) -> ScreenedDraws | None:
    """The draws of bf16 rows ``x`` (…, k) at ``temperature`` > 0 through ``screen`` (rows flattened in
    order), or None where something is not finite (the full product decides then)."""
    rows = x.reshape(-1, x.shape[-1])
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"screened draws need a finite temperature > 0, got {temperature}")
    upper = kernel.int8_upper(rows, screen.q, screen.scale, screen.bound, screen.qnorm, norm_allowance(rows.shape[-1]),
                              ROUNDING)
    if upper.numel() == 0:
        return None
    return ScreenedDraws(kernel, screen, rows, upper, float(temperature))
