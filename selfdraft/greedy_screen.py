"""Greedy logits at half the vocabulary projection's bytes: an int8 screen, then exact values where a row's maximum may be.

A one-token decode step reads every weight once and is bound by those bytes; the vocabulary
projection is a large share of them (SmolLM2-135M: 49,152 x 576, 57 MB of bf16, ~23% of a step on
the 2-core AVX2 CPU; Gemma-3-270M: 262,144 x 640, 335 MB, ~60% of its weights). Greedy decoding
and greedy verification use a row's argmax only. :class:`Screen` keeps an int8 copy of the projection
(one fp32 scale per row, half the bytes) and, per vocabulary row j, a bound c_j and m_j = s_j ||q_j||_2
such that for any input row x the kernel's fp32 sum f_j for the bf16 product (:func:`~selfdraft.kernels`
``bf16_linear``) and the int8 product a_j (``int8_linear``) satisfy ``|f_j - a_j| <= B_j = ||x||_2 c_j
+ eps(x) m_j``:

    c_j = ||w_j - s_j q_j||_2 + gamma * (s_j ||q_j||_2 + ||w_j||_2),  gamma = 2 (k + 2) 2^-24

(Cauchy-Schwarz on the weights' quantization error, plus the bf16 sum's fp32 rounding, at most about
k 2^-24 sum_i |x_i w_i|, and a spare allowance of the same size; raised by 2^-10 relative for its
own fp32 rounding; ||x|| is raised by gamma for its own). The int8 product multiplies integers: the
kernel quantizes each input row to int16, x = xs xq + delta (xs = max|x| / 16383, fewer levels where
k 127 16383 would overflow an int32 sum), sums xq . q_j exactly in int32 and scales the sum by s_j
xs in fp32 (three roundings of at most 2^-24 s_j xs |xq . q_j| each), so by Cauchy-Schwarz again

    |s_j q_j . x - a_j| <= s_j |q_j . delta| + 2^-22 s_j xs |xq . q_j| <= m_j (||delta|| + 2^-22 xs ||xq||) = m_j eps(x),

eps(x) computed in double in the kernel and raised by 2^-10 (m_j likewise). Widening int8 weights
to int16 and multiplying 16 at a time (``vpmaddwd``) streams the copy ~1.5x faster than fp32
multiply-adds of the same bytes on the 2-core AVX2 EPYC; eps adds a few percent to B.
:func:`screened_logits` computes a, B_j, the best lower bound L = max_j (a_j - B_j) and
M = max_j (|a_j| + B_j), and keeps every j with a_j + B_j >= L - 2^-6 M. For a j left out, its bf16
logit e_j = bf16(f_j) <= f_j + 2^-8 M < L - 2^-6 M + 2^-8 M, and the row attaining L has a logit of at
least L - 2^-8 M: every left-out logit is strictly below the row's maximum. The kept rows' logits
are then computed exactly (the same kernel over the gathered weight rows; each output's sum runs
in the same order whatever the rows, so the values are bit-identical to the full product's), the
rest set to -inf: the argmax, ties included (the first index, as ``torch.argmax``), is the full
product's. On SmolLM2's replies the screen kept a median of 5 rows of 49,152 (at most 109); whole
decode steps: SmolLM2 one token 18.8 -> 18.1 ms, Gemma-3-270M 29.3 -> 24.3 ms (plain decoding
+17%) on the 2-core AVX2 EPYC.

Only for greedy steps with exact acceptance (sampling and typical acceptance need the whole
distribution), projections without bias or logit soft-capping, and products of at most
:data:`SCREEN_MAX_ROWS` rows (past that the int8 product's arithmetic costs more than the bytes
saved). Draws at a temperature use the same copy (:mod:`selfdraft.screened_draws`).
``SELFDRAFT_GREEDY_SCREEN=0`` turns both off; the int8 copy costs half the projection's bytes
of memory (28 MB for SmolLM2, 168 MB for Gemma-3-270M), built on the first step it serves.
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from selfdraft.hugepages import to_huge_pages

SCREEN_ENV = "SELFDRAFT_GREEDY_SCREEN"
"""Set to 0 to compute every greedy step's full vocabulary projection."""
SCREEN_MAX_ROWS = 4
"""Most input rows a screened projection takes. On the 2-core AVX2 EPYC, the lm_heads alone with their
weights out of cache (medians of 12), bf16 product against the screen (int16 inputs, thirty-ninth session):
SmolLM2 1 row 3.6 / 2.1-2.4 ms, 2 rows 3.9-4.0 / 2.9-3.1, 3 rows 4.2 / 3.5-3.9, 4 rows 4.5-4.6 / 4.5,
6 rows 7.7-7.9 / 6.2-6.9; Gemma-3-270M 1 row 20.6-21.0 / 9.9-10.6, 2 rows 22.5-23.1 / 14.8-15.8, 3 rows
23.7-23.8 / 18.1-20.1, 4 rows 26.0-26.5 / 23.7, 6 rows 45 / 34-38. With fp32 inputs (thirty-seventh
session) the screen lost from three rows on (whole decode forwards after 300 cached tokens, off / on:
SmolLM2 3 rows 22.7 / 23.4, Gemma-3 4 rows 41.3 / 46.4; docs/perf_log.md). Five and more rows keep
the bf16 product: its tiles there, and the screen's candidate pass grows with the rows."""
SCREEN_MARGIN = 2.0**-6
"""Relative margin of the candidate test, against M = max |a_j| + B_j: above bf16's half-ulp (2^-8) twice."""
BUILD_ROWS = 4096
"""Vocabulary rows quantized at a time (fp32 scratch of BUILD_ROWS x hidden)."""


@dataclass(frozen=True, eq=False)
class Screen:
    """The int8 screen of one bf16 vocabulary projection (see the module docstring)."""

    weight: Tensor
    """(V, k) the bf16 projection weight it screens (a reference)."""
    q: Tensor
    """(V, k) int8 rows, in huge pages where they apply."""
    scale: Tensor
    """(V,) fp32 row scales: row j is about scale[j] * q[j]."""
    bound: Tensor
    """(V,) fp32 c_j, the bound's term in ||x||_2."""
    qnorm: Tensor
    """(V,) fp32 m_j = s_j ||q_j||_2, the bound's term in the input's int16 quantization error eps(x)."""


def build_screen(weight: Tensor) -> Screen:
    """Quantize a (V, k) bf16 weight row-wise to int8 (symmetric, scale max|w_j| / 127) with its bounds.

    In fp32, block by block: each element's computed error w - s q is off by at most 2^-24 |w|, which
    the gamma term (2 (k + 2) 2^-24 ||w_j||) covers, and the norms' relative rounding (~k 2^-24) the
    2^-10 allowance."""
    v, k = weight.shape
    gamma = _gamma(k)
    q = torch.empty(v, k, dtype=torch.int8)
    scale = torch.empty(v, dtype=torch.float32)
    bound = torch.empty(v, dtype=torch.float32)
    qnorm = torch.empty(v, dtype=torch.float32)
    for start in range(0, v, BUILD_ROWS):
        w = weight[start : start + BUILD_ROWS].float()
        s = w.abs().amax(1) / 127
        s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero row: any scale, q = 0
        rows = torch.round(w / s[:, None]).clamp_(-127, 127)
        q[start : start + BUILD_ROWS] = rows.to(torch.int8)
        scale[start : start + BUILD_ROWS] = s
        error = (w - rows * s[:, None]).norm(dim=1)
        qnorm[start : start + BUILD_ROWS] = s * rows.norm(dim=1)
        bound[start : start + BUILD_ROWS] = error + gamma * (qnorm[start : start + BUILD_ROWS] + w.norm(dim=1))
    return Screen(weight, to_huge_pages(q), scale, bound * (1 + 2.0**-10), qnorm * (1 + 2.0**-10))


def _gamma(k: int) -> float:
    """Relative allowance for the fp32 rounding of a k-term sum (of products, or of squares for ||x||)."""
    return 2.0 * (k + 2) * 2.0**-24


def norm_allowance(k: int) -> float:
    """Factor raising a computed ||x||_2 of k terms above the exact one (its own rounding)."""
    return 1 + _gamma(k)


_SCREENS: weakref.WeakKeyDictionary[nn.Module, Screen] = weakref.WeakKeyDictionary()


def lm_head_screen(lm_head: nn.Module, rows: int) -> Screen | None:
    """The screen of ``lm_head`` (built on first use, rebuilt when its weight moves) for a greedy
    product of ``rows`` input rows or their draws (:mod:`selfdraft.screened_draws`), or None where the full product must run (see the module
    docstring)."""
    if rows > SCREEN_MAX_ROWS or os.environ.get(SCREEN_ENV, "1") == "0":
        return None
    weight = getattr(lm_head, "weight", None)
    if (
        type(lm_head) is not nn.Linear
        or lm_head.bias is not None
        or weight.dtype != torch.bfloat16
        or weight.device.type != "cpu"
        or weight.dim() != 2
    ):
        return None
    screen = _SCREENS.get(lm_head)
    # the screen holds the weight it was built from: a moved weight (``lm_head.to(...)``) is another tensor
    if screen is None or screen.weight.data_ptr() != weight.data_ptr() or screen.weight.shape != weight.shape:
        screen = _SCREENS[lm_head] = build_screen(weight.detach())
    return screen


def screened_logits(kernel, screen: Screen, x: Tensor) -> Tensor | None:
    """(…, V) bf16 logits of bf16 rows ``x`` (…, k): the full product's values where they may be a
    row's maximum, -inf elsewhere; None where something is not finite (the full product decides then)."""
    rows = x.reshape(-1, x.shape[-1])
    keep = kernel.int8_screen(rows, screen.q, screen.scale, screen.bound, screen.qnorm, norm_allowance(rows.shape[-1]),
                              SCREEN_MARGIN)
    if keep.numel() == 0:
        return None
    exact = kernel.bf16_linear(rows, screen.weight.index_select(0, keep), None)  # (m, kept)
    logits = torch.full((rows.shape[0], screen.weight.shape[0]), -math.inf, dtype=torch.bfloat16)
    logits.index_copy_(1, keep, exact)
    return logits.view(*x.shape[:-1], -1)
