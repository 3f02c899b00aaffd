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

Steps can also come in *kinds* that the drafter tells apart for free before it proposes
(``Drafter.gate_kind``): a trained head merged with prompt lookup drafts a short head tree on most
steps and a long copied span where the context repeats itself, two modes with different costs and
acceptance. The gate keeps a drafting estimate per kind and decides per kind, against one shared
plain-step time: the copied spans keep being verified where the head alone does not pay, and one
kind's losing streak does not switch the other off.

A step can also offer *alternative* drafts (:meth:`SpeculationGate.pick`): where a merged drafter's
free member has a draft, the loop may verify the merged tree (the head's nodes included) or the free
member's draft alone (no head forward, a smaller tree). Each alternative is a kind of its own; the
gate runs the one with the best optimistic rate while that beats plain decoding, and the ones not run
age as a plain step ages the kind it replaced, so a losing alternative is probed again.

One gate can serve many replies (a chat's turns, a benchmark's prompts, a server's requests):
:func:`selfdraft.generate.generate` takes it as ``gate=``, and what it measured on earlier replies
decides the next reply's first steps, so a drafter that does not pay here is not drafted twice at
the start of every reply to find that out again (``WARMUP``). Step times and acceptance belong to one
model, drafter and sampling configuration: :meth:`SpeculationGate.bind` refuses a gate measured for
another.
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
    """What the gate knows about drafting at one batch size and kind."""

    weight: float = 0.0
    """Decayed count of drafting steps behind the tokens estimate."""
    tokens: float = 0.0
    """Decayed sum of tokens committed per row on drafting steps."""
    tokens_sq: float = 0.0
    """Decayed sum of their squares."""
    spec_s: float | None = None
    """Moving average of a drafting step's seconds."""
    spec_steps: int = 0

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


@dataclass
class _Plain:
    """What the gate knows about plain steps at one batch size (shared by every kind)."""

    plain_s: float | None = None
    """Moving average of a plain step's seconds."""
    plain_steps: int = 0
    steps: int = 0
    """Decisions taken at this batch size (speculate() calls, all kinds)."""
    last_plain: int = 0
    """Decision index of the last plain step."""


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
    """Online on/off switch for speculation, per batch size (the number of rows in a step) and kind.

    ``speculate(rows, kind)`` says whether the next step drafts; ``record(rows, speculative, tokens,
    seconds, kind)`` reports what the step did (``speculative``: whether a draft tree was verified; a
    drafter with nothing to propose makes a plain step). ``kind`` (any hashable, None by default)
    separates steps the drafter tells apart before proposing (``Drafter.gate_kind``). The first
    ``WARMUP`` steps of a kind draft, the first ``WARMUP`` plain steps at a batch size follow; from
    then on a kind drafts while its optimistic drafting rate (mean committed tokens plus
    ``CONFIDENCE`` standard errors, over its drafting step time) is at least the plain rate, and one
    step in ``probe_every`` runs plain to keep the plain time current. Greedy output does not depend
    on the gate; only speed does.
    """

    def __init__(self, probe_every: int = 64):
        if probe_every < 2:
            raise ValueError(f"probe_every must be >= 2, got {probe_every}")
        self.probe_every = probe_every
        self.stats: dict[tuple[int, object], _Stats] = {}
        """(batch size, kind) -> drafting estimate."""
        self.plain: dict[int, _Plain] = {}
        """batch size -> plain-step estimate."""
        self.owner: tuple | None = None
        """What the measurements belong to (:meth:`bind`); None until first bound."""

    def bind(self, owner: tuple, what: str = "") -> None:
        """Tie the gate to ``owner`` (a tuple identifying the model, drafter and sampling it measures)
        on first use; raise if it was bound to another, since its step times and acceptance would not
        describe this one. ``what`` names the owner in the error."""
        if self.owner is None:
            self.owner = owner
        elif self.owner != owner:
            raise ValueError(f"this SpeculationGate measured another model, drafter or sampling configuration "
                             f"({what or 'owner differs'}); keep one gate per (model, drafter, sampling) and pass "
                             f"a new SpeculationGate() for this one")

    def _at(self, rows: int, kind: object) -> tuple[_Stats, _Plain]:
        return self.stats.setdefault((rows, kind), _Stats()), self.plain.setdefault(rows, _Plain())

    def rate(self, rows: int, speculative: bool, kind: object = None) -> float | None:
        """Measured tokens per second of one mode at one batch size (None: not measured yet)."""
        if not speculative:
            p = self.plain.get(rows)
            return None if p is None or p.plain_s is None else rows / max(p.plain_s, 1e-9)
        s = self.stats.get((rows, kind))
        if s is None or s.spec_s is None or s.weight <= 0:
            return None
        return rows * (s.tokens / s.weight) / max(s.spec_s, 1e-9)

    def optimistic_rate(self, rows: int, kind: object = None) -> float | None:
        """The drafting rate with the tokens estimate raised by its error bar (None: not measured)."""
        s = self.stats.get((rows, kind))
        if s is None or s.spec_s is None or s.weight <= 0:
            return None
        mean, std = s.mean_std()
        return rows * (mean + CONFIDENCE * std / math.sqrt(s.weight)) / max(s.spec_s, 1e-9)

    def speculate(self, rows: int, kind: object = None) -> bool:
        """Whether the next step with ``rows`` rows (of ``kind``) should draft."""
        return self.pick(rows, (kind,)) is not None

    def pick(self, rows: int, kinds: Sequence[object]) -> int | None:
        """Which of the alternative drafts ``kinds`` the next step with ``rows`` rows verifies (an index
        into ``kinds``), or None for a plain step. Each kind first drafts ``WARMUP`` times; then the one
        with the best optimistic rate drafts while that rate is at least the plain rate."""
        stats = [self._at(rows, kind)[0] for kind in kinds]
        p = self.plain.setdefault(rows, _Plain())
        p.steps += 1
        cold = next((i for i, s in enumerate(stats) if s.spec_steps < WARMUP), None)
        if cold is not None:
            return cold
        if p.plain_steps < WARMUP:
            return None
        if p.steps - p.last_plain >= self.probe_every:
            return None  # re-measure the plain step time
        rates = [self.optimistic_rate(rows, kind) for kind in kinds]
        unmeasured = next((i for i, r in enumerate(rates) if r is None), None)
        plain = self.rate(rows, False)
        if unmeasured is not None:
            return unmeasured
        if plain is None:
            return 0
        best = max(range(len(kinds)), key=rates.__getitem__)
        return best if rates[best] >= plain else None

    def record(self, rows: int, speculative: bool, tokens: int, seconds: float, kind: object = None,
               idle: Sequence[object] = ()) -> None:
        """One step's outcome: ``tokens`` committed over all rows in ``seconds``. ``idle``: the other
        kinds :meth:`pick` was offered and did not run; their estimates age as on a plain step."""
        for other in idle:
            self._at(rows, other)[0].age()
        s, p = self._at(rows, kind)
        if speculative:
            s.add_tokens(tokens / rows)
            s.spec_steps += 1
            s.spec_s = _average(s.spec_s, seconds, s.spec_steps)
        else:
            s.age()
            p.plain_steps += 1
            p.plain_s = _average(p.plain_s, seconds, p.plain_steps)
            p.last_plain = p.steps

    def record_shadow(self, rows: int, tokens: float, kind: object = None) -> None:
        """A draft scored in the shadow of plain steps: ``tokens`` a drafting step would have committed
        per row (1 + the accepted depth). Feeds the tokens estimate only: no step ran, so no time."""
        self._at(rows, kind)[0].add_tokens(tokens)

    def speeds(self, kind: object = None) -> dict[int, tuple[float | None, float | None]]:
        """Batch size -> (speculative, plain) tokens per second measured so far for ``kind``."""
        rows = sorted({r for r, k in self.stats if k == kind})
        return {r: (self.rate(r, True, kind), self.rate(r, False)) for r in rows}
