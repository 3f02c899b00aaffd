"""Prompt lookup decoding (Saxena, 2023): draft by n-gram match against the context.

The last n tokens are searched for earlier in the sequence (longest n first); the tokens that
followed each match become candidate continuations. Several distinct continuations are merged into
a trie, so the target verifies them all in one tree forward. No model, no training.

A match that ends P tokens before the end of the sequence has only P tokens after it: the text
repeats with period P there, so the continuation goes on copying itself up to the draft length
(``periodic``; LZ77's overlapping copy). Loops of a few tokens (a base model's repetitions, runs of
table rows or list markers) then draft at full length instead of P tokens per step.

The draft length adapts to the sequence (``adaptive``, the heuristic of transformers' assisted
generation, as the draft-model drafter's): up by 2 after a draft the target committed whole, down by
1 after one it left. Copied spans run long in some replies (code, a base model's repetitions) and
short in others (chat), and every drafted token costs verification on a CPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from selfdraft.drafters.base import Draft, StepResult
from selfdraft.sampling import SamplingConfig
from selfdraft.stats import common_prefix
from selfdraft.tree import tree_from_token_paths


def find_continuations(tokens: Tensor, ngram: int, length: int, max_candidates: int,
                       periodic: bool = False) -> list[list[int]]:
    """Distinct continuations (most recent match first) of earlier occurrences of the last ``ngram`` tokens.

    tokens: (T,) int64. Returns up to ``max_candidates`` lists of up to ``length`` tokens; with
    ``periodic``, a continuation cut short by the end of the sequence repeats itself up to ``length``.
    """
    t = tokens.numel()
    if t <= ngram:
        return []
    pattern = tokens[-ngram:]
    windows = tokens[: t - 1].unfold(0, ngram, 1)  # a match must be followed by at least one token
    starts = (windows == pattern).all(1).nonzero().flatten().flip(0)
    found: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for s in starts.tolist():
        cont = tokens[s + ngram : s + ngram + length].tolist()
        if periodic:
            period = len(cont)  # short only where it reaches the end: the last `period` tokens repeat
            while len(cont) < length:
                cont.append(cont[-period])
        key = tuple(cont)
        if cont and key not in seen:
            seen.add(key)
            found.append(cont)
            if len(found) == max_candidates:
                break
    return found


class PromptLookupDrafter:
    """Deterministic n-gram drafter (q is one-hot, so sampling stays lossless).

    Defaults (3..2-grams, 10 tokens, one candidate) were measured best of six settings on SmolLM2
    bf16 (docs/perf_log.md): single-token matches and extra branches cost more verification than
    they win on a 2-core CPU. With ``adaptive`` the length starts at ``num_tokens`` and moves within
    ``min_tokens..max_tokens`` (default 2..12) by what the target committed of each draft; ``propose``
    then keeps its draft for ``update`` to score (nothing else: the same context gives the same draft).
    ``periodic``: continuations that reach the end of the sequence repeat themselves (see above).
    """

    hidden_layers: tuple[int, ...] = ()
    proposes_for_free = True  # an n-gram search over the context; the draft it keeps only scores the next update

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, num_tokens: int = 10, max_candidates: int = 1,
                 adaptive: bool = True, min_tokens: int | None = None, max_tokens: int | None = None,
                 periodic: bool = True):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if num_tokens < 1 or max_candidates < 1:
            raise ValueError("num_tokens and max_candidates must be >= 1")
        min_tokens = min(2, num_tokens) if min_tokens is None else min_tokens
        max_tokens = max(12, num_tokens) if max_tokens is None else max_tokens
        if adaptive and not 1 <= min_tokens <= num_tokens <= max_tokens:
            raise ValueError(f"adaptive draft length needs 1 <= min_tokens <= num_tokens <= max_tokens, got "
                             f"{min_tokens}, {num_tokens}, {max_tokens} (or adaptive=false for a fixed length)")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.initial_tokens, self.max_candidates = num_tokens, max_candidates
        self.adaptive, self.min_tokens, self.max_tokens = adaptive, min_tokens, max_tokens
        self.num_tokens, self.periodic = num_tokens, periodic
        self._proposed: tuple[int, list[list[int]]] | None = None
        """(sequence length, continuations) of the last draft, for ``update`` to score."""

    def reset(self, step: StepResult) -> None:
        self.num_tokens, self._proposed = self.initial_tokens, None

    def propose(self, tokens: Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        root = int(tokens[-1])
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            conts = find_continuations(tokens, n, self.num_tokens, self.max_candidates, self.periodic)
            if conts:
                self._proposed = (tokens.numel(), conts) if self.adaptive else None
                tree, node_tokens = tree_from_token_paths(root, conts)
                return Draft(tree, node_tokens)
        self._proposed = None
        tree, node_tokens = tree_from_token_paths(root, [])
        return Draft(tree, node_tokens)

    def update(self, step: StepResult) -> None:
        if self._proposed is None:
            return
        start, conts = self._proposed
        self._proposed = None
        self.num_tokens = adapt_length(self.num_tokens, conts, step.tokens[start:].tolist(), self.min_tokens, self.max_tokens)


def adapt_length(length: int, drafts: list[list[int]], committed: list[int], lo: int, hi: int) -> int:
    """The next draft length after ``drafts`` (drafted at length ``length``) met ``committed`` (the
    tokens the target committed after their root): +2 (up to ``hi``) when one of them was committed
    whole at full length, -1 (down to ``lo``) when every one of them disagrees with a committed token,
    else unchanged (the target committed too few tokens to tell: a plain step, the end of generation)."""
    if any(len(d) == length and common_prefix(d, committed) == length for d in drafts):
        return min(hi, length + 2)
    if all(common_prefix(d, committed) < min(len(d), len(committed)) for d in drafts):
        return max(lo, length - 1)
    return length
