"""Prompt lookup decoding (Saxena, 2023): draft by n-gram match against the context.

The last n tokens are searched for earlier in the sequence (longest n first); the tokens that
followed each match become candidate continuations. Several distinct continuations are merged into
a trie, so the target verifies them all in one tree forward. No model, no training.
"""

from __future__ import annotations

import torch
from torch import Tensor

from selfdraft.drafters.base import Draft, StepResult
from selfdraft.sampling import SamplingConfig
from selfdraft.tree import tree_from_token_paths


def find_continuations(tokens: Tensor, ngram: int, length: int, max_candidates: int) -> list[list[int]]:
    """Distinct continuations (most recent match first) of earlier occurrences of the last ``ngram`` tokens.

    tokens: (T,) int64. Returns up to ``max_candidates`` lists of up to ``length`` tokens.
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
    they win on a 2-core CPU.
    """

    hidden_layers: tuple[int, ...] = ()
    proposes_for_free = True  # an n-gram search over the context, no state

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, num_tokens: int = 10, max_candidates: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if num_tokens < 1 or max_candidates < 1:
            raise ValueError("num_tokens and max_candidates must be >= 1")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.num_tokens, self.max_candidates = num_tokens, max_candidates

    def reset(self, step: StepResult) -> None:
        pass

    def propose(self, tokens: Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        root = int(tokens[-1])
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            conts = find_continuations(tokens, n, self.num_tokens, self.max_candidates)
            if conts:
                tree, node_tokens = tree_from_token_paths(root, conts)
                return Draft(tree, node_tokens)
        tree, node_tokens = tree_from_token_paths(root, [])
        return Draft(tree, node_tokens)

    def update(self, step: StepResult) -> None:
        pass
