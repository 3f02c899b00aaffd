"""The online speculation gate: draft only while drafting commits tokens faster than plain decoding.

Whether speculation pays depends on the machine as much as on the drafter: verifying n tree nodes
costs about one token's forward where the forward is memory-bound (a GPU, a CPU with native bf16
GEMM at batch 1), but close to n forwards where it is compute-bound (many batch rows, or bf16 weights
on a CPU without bf16 instructions, where PyTorch's bf16 GEMM costs about m times a one-row product).
The gate measures both modes on the run itself and keeps the faster, so a drafter that cannot pay
on this machine costs a probe step now and then instead of a slowdown. Used by the batch-1 loop
(:func:`selfdraft.generate.generate`, ``GenerationConfig.auto_off``) and the batched loop
(:func:`selfdraft.batch.generate_batch`, ``TreePolicy.auto_off``).

The two things measured behave differently, so they are estimated differently:

- a step's *time* is steady (it follows the tree size and the context length): a short moving
  average of each mode's step time is enough;
- the *tokens* a drafting step commits are noisy (a head accepting 40% of its drafts commits 1 token
  on most steps and 2 or more on the rest): their mean is estimated over the last ~20 drafting steps
  together with its standard error, and drafting continues while the mean *plus one standard error*
  still beats plain decoding. A short run of rejections therefore does not switch off a drafter that
  pays on average; a drafter that keeps losing is switched off once the evidence is clear.

While plain decoding runs, the drafting estimate ages (its weight shrinks a little each plain step),
so its error bar widens until the optimistic bound crosses plain decoding again and one drafting
step re-measures it: a drafter that loses by a small margin is probed often (each probe costs
little), one that loses by a wide margin rarely. While drafting runs, one plain step every
``probe_every`` steps keeps the plain step time current.

A drafter whose proposals cost no model forward (prompt lookup: an n-gram search) keeps drafting
*in the shadow* while plain decoding runs: the decode loop scores its draft against the tokens the
target then commits (:class:`ShadowDraft`, what verification would have accepted) and reports it
with :meth:`SpeculationGate.record_shadow`. A run of rejected first matches then no longer keeps such
a drafter off once the text turns to copying: the evidence arrives without paying for a verification.
For a deterministic draft the score is exact in distribution at any temperature (a one-hot draft
token is accepted with probability p(x), the chance that the target's own sample is x).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from selfdraft.drafters.base import Draft

TIME_DECAY = 0.8
"""Moving-average decay of a mode's step time (~5 steps of memory)."""
TOKENS_DECAY = 0.95
"""Decay per drafting step of the committed-tokens estimate (~20 steps of memory)."""
STALE_DECAY = 0.99
"""Decay of the committed-tokens estimate's weight per plain step (its error bar widens while unused)."""
MIN_STD = 0.5
"""Floor of the per-row committed-tokens standard deviation, so a short run of equal outcomes (or a
drafter whose drafts were all rejected so far) still leaves an error bar and gets probed again."""
CONFIDENCE = 1.0
"""Standard errors added to the drafting mean before it is compared with plain decoding."""
WARMUP = 2
"""Drafting steps, then plain steps, measured at the start of each batch size before the gate decides
(two of each: the first step of a mode often pays one-off costs, and the smaller time is kept)."""


@dataclass
class _Stats:
    """What the gate knows at one batch size."""

    weight: float = 0.0
    """Decayed count of drafting steps behind the tokens estimate."""
    tokens: float = 0.0
    """Decayed sum of tokens committed per row on drafting steps."""
    tokens_sq: float = 0.0
    """Decayed sum of their squares."""
    spec_s: float | None = None
    """Moving average of a drafting step's seconds."""
    plain_s: float | None = None
    """Moving average of a plain step's seconds."""
    spec_steps: int = 0
    plain_steps: int = 0
    steps: int = 0
    """Decisions taken (speculate() calls)."""
    last_plain: int = 0
    """Decision index of the last plain step."""

    def add_tokens(self, per_row: float) -> None:
        """One drafting step's (or one scored shadow draft's) tokens committed per row."""
        self.weight = TOKENS_DECAY * self.weight + 1.0
        self.tokens = TOKENS_DECAY * self.tokens + per_row
        self.tokens_sq = TOKENS_DECAY * self.tokens_sq + per_row * per_row

    def age(self) -> None:
        """A plain step: the tokens estimate loses a little weight, so its error bar widens."""
        self.weight *= STALE_DECAY
        self.tokens *= STALE_DECAY
        self.tokens_sq *= STALE_DECAY

    def mean_std(self) -> tuple[float, float]:
        mean = self.tokens / self.weight
        var = max(self.tokens_sq / self.weight - mean * mean, MIN_STD * MIN_STD)
        return mean, math.sqrt(var)


def shadow_accepted(children: Sequence[Sequence[int]], tokens: Sequence[int], continuation: Sequence[int]) -> int | None:
    """Draft tokens that verification would have accepted, scored against the tokens committed after the root.

    ``children``: the child node lists of a deterministic draft tree (``Tree.children()``), ``tokens``
    its node tokens (node 0 the root), ``continuation`` the tokens the target committed after the
    root so far. Returns the accepted depth once it is decided (a mismatch, or a leaf reached), None
    while every committed token still matches and the tree goes deeper than the continuation."""
    node = 0
    for depth, token in enumerate(continuation):
        nxt = next((c for c in children[node] if tokens[c] == token), None)
        if nxt is None:
            return depth
        node = nxt
        if not children[node]:
            return depth + 1
    return None if children[node] else len(continuation)


@dataclass(frozen=True)
class ShadowDraft:
    """A draft proposed while plain steps run, waiting for the target's tokens to score it."""

    children: list[list[int]]
    """Child node lists of the draft tree (``Tree.children()``)."""
    tokens: list[int]
    """Node tokens; node 0 is the root, the last committed token when it was proposed."""
    start: int
    """Length of the committed sequence when it was proposed (the root is its last token)."""

    @classmethod
    def of(cls, draft: Draft, committed: int) -> ShadowDraft | None:
        """The shadow of ``draft`` proposed after ``committed`` tokens; None when it drafts nothing."""
        if draft.tree.size <= 1:
            return None
        return cls(draft.tree.children(), draft.tokens.tolist(), committed)

    def score(self, committed: Sequence[int]) -> int | None:
        """Tokens a drafting step would have committed (1 + the accepted depth), or None while undecided."""
        depth = shadow_accepted(self.children, self.tokens, committed[self.start :])
        return None if depth is None else 1 + depth


def _average(old: float | None, new: float, count: int) -> float:
    """Moving average of step seconds; the first two steps keep the smaller (the first often warms up)."""
    if old is None:
        return new
    if count == 2:
        return min(old, new)
    return TIME_DECAY * old + (1 - TIME_DECAY) * new


class SpeculationGate:
    """Online on/off switch for speculation, per batch size (the number of rows in a step).

    ``speculate(rows)`` says whether the next step drafts; ``record(rows, speculative, tokens, seconds)``
    reports what the step did (``speculative``: whether a draft tree was verified; a drafter with
    nothing to propose makes a plain step). The first ``WARMUP`` steps at a batch size draft, the next
    ``WARMUP`` are plain; from then on drafting runs while the optimistic drafting rate
    (mean committed tokens plus ``CONFIDENCE`` standard errors, over the drafting step time) is at
    least the plain rate. Greedy output does not depend on the gate; only speed does.
    """

    def __init__(self, probe_every: int = 64):
        if probe_every < 2:
            raise ValueError(f"probe_every must be >= 2, got {probe_every}")
        self.probe_every = probe_every
        self.stats: dict[int, _Stats] = {}

    def _at(self, rows: int) -> _Stats:
        return self.stats.setdefault(rows, _Stats())

    def rate(self, rows: int, speculative: bool) -> float | None:
        """Measured tokens per second of one mode at one batch size (None: not measured yet)."""
        s = self.stats.get(rows)
        if s is None:
            return None
        if not speculative:
            return None if s.plain_s is None else rows / max(s.plain_s, 1e-9)
        if s.spec_s is None or s.weight <= 0:
            return None
        return rows * (s.tokens / s.weight) / max(s.spec_s, 1e-9)

    def optimistic_rate(self, rows: int) -> float | None:
        """The drafting rate with the tokens estimate raised by its error bar (None: not measured)."""
        s = self.stats.get(rows)
        if s is None or s.spec_s is None or s.weight <= 0:
            return None
        mean, std = s.mean_std()
        return rows * (mean + CONFIDENCE * std / math.sqrt(s.weight)) / max(s.spec_s, 1e-9)

    def speculate(self, rows: int) -> bool:
        """Whether the next step with ``rows`` rows should draft."""
        s = self._at(rows)
        s.steps += 1
        if s.spec_steps < WARMUP:
            return True
        if s.plain_steps < WARMUP:
            return False
        if s.steps - s.last_plain >= self.probe_every:
            return False  # re-measure the plain step time
        optimistic, plain = self.optimistic_rate(rows), self.rate(rows, False)
        return optimistic is None or plain is None or optimistic >= plain

    def record(self, rows: int, speculative: bool, tokens: int, seconds: float) -> None:
        """One step's outcome: ``tokens`` committed over all rows in ``seconds``."""
        s = self._at(rows)
        if speculative:
            s.add_tokens(tokens / rows)
            s.spec_steps += 1
            s.spec_s = _average(s.spec_s, seconds, s.spec_steps)
        else:
            s.age()
            s.plain_steps += 1
            s.plain_s = _average(s.plain_s, seconds, s.plain_steps)
            s.last_plain = s.steps

    def record_shadow(self, rows: int, tokens: float) -> None:
        """A draft scored in the shadow of plain steps: ``tokens`` a drafting step would have committed
        per row (1 + the accepted depth). Feeds the tokens estimate only: no step ran, so no time."""
        self._at(rows).add_tokens(tokens)

    def speeds(self) -> dict[int, tuple[float | None, float | None]]:
        """Batch size -> (speculative, plain) tokens per second measured so far."""
        return {r: (self.rate(r, True), self.rate(r, False)) for r in sorted(self.stats)}
