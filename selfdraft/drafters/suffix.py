"""Suffix decoding (Oliaro et al., 2024, "SuffixDecoding"; vLLM's ``suffix`` method): draft from the
target's earlier replies as well as from the request itself.

A table counts, for every context of 1..``max_ngram`` tokens, the tokens that followed it in the
replies of earlier requests and in the reply being generated, as its tokens are committed (and,
optionally, in a file of the target's own replies, e.g. what ``selfdraft distill`` wrote). Each
step drafts a chain from the longest context of the committed tokens the table holds, following the
most frequent next token while its share of that context's counts is at least ``min_prob``; prompt
lookup's continuation from the request is merged in as a second path. Deterministic (``q`` is
None), so sampling stays lossless; no model runs.

The table must hold the target's phrasing: replies written by another model match far less
(docs/perf_log.md, twenty-sixth session).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from selfdraft.drafters.base import Draft, StepResult
from selfdraft.drafters.merged import merge_drafts
from selfdraft.drafters.prompt_lookup import PromptLookupDrafter
from selfdraft.sampling import SamplingConfig
from selfdraft.tree import tree_from_token_paths


class NgramTable:
    """Next-token counts after every context of 1..max_ngram tokens of the sequences added.

    Per context it keeps the counts, their total and the most frequent next token, so a lookup is
    one dict access per context length tried. ``max_tokens`` bounds it (memory grows with every token
    added: about 6 contexts each): past it, the oldest additions are subtracted again, so the table
    holds the most recent ``max_tokens`` tokens or so (0: no bound).
    """

    def __init__(self, max_ngram: int = 6, max_tokens: int = 0):
        if max_ngram < 1 or max_tokens < 0:
            raise ValueError(f"need max_ngram >= 1 and max_tokens >= 0 (0: no bound), got {max_ngram}, {max_tokens}")
        self.max_ngram, self.max_tokens = max_ngram, max_tokens
        self._next: dict[tuple[int, ...], dict[int, int]] = {}
        self._best: dict[tuple[int, ...], tuple[int, int, int]] = {}
        """context -> (most frequent next token, its count, total count)."""
        self._added: deque[tuple[list[int], int]] = deque()
        """(sequence, start) of each addition, oldest first, while the table is bounded."""
        self.tokens = 0

    def _pairs(self, seq: list[int], start: int):
        for i in range(max(start, 1), len(seq)):
            for n in range(1, min(self.max_ngram, i) + 1):
                yield tuple(seq[i - n : i]), seq[i]

    def add(self, seq: Sequence[int], start: int = 0) -> None:
        """Count every (context, next token) pair of ``seq`` whose next token is at position >= ``start``
        (the tokens before it are context only: what an earlier ``add`` of the same sequence counted)."""
        seq = [int(t) for t in seq]
        self.tokens += max(0, len(seq) - start)
        for ctx, nxt in self._pairs(seq, start):
            counts = self._next.setdefault(ctx, {})
            c = counts.get(nxt, 0) + 1
            counts[nxt] = c
            best, best_c, total = self._best.get(ctx, (nxt, 0, 0))
            self._best[ctx] = (nxt, c, total + 1) if c > best_c else (best, best_c, total + 1)
        if self.max_tokens:
            self._added.append((seq, start))
            while self.tokens > self.max_tokens and len(self._added) > 1:
                self._remove(*self._added.popleft())

    def _remove(self, seq: list[int], start: int) -> None:
        """Undo ``add(seq, start)``."""
        self.tokens -= max(0, len(seq) - start)
        for ctx, nxt in self._pairs(seq, start):
            counts = self._next[ctx]
            if counts[nxt] == 1:
                del counts[nxt]
            else:
                counts[nxt] -= 1
            if not counts:
                del self._next[ctx], self._best[ctx]
                continue
            best, best_c, total = self._best[ctx]
            if best == nxt:
                best = max(counts, key=counts.__getitem__)
            self._best[ctx] = (best, counts[best], total - 1)

    def chain(self, context: Sequence[int], length: int, min_ngram: int = 2, min_prob: float = 0.4) -> list[int]:
        """Up to ``length`` tokens: from the longest context (>= min_ngram tokens) the table holds,
        the most frequent next token, while its share of the counts is >= min_prob."""
        ctx = [int(t) for t in context[-self.max_ngram :]]
        out: list[int] = []
        while len(out) < length:
            hit = None
            for n in range(min(self.max_ngram, len(ctx)), min_ngram - 1, -1):
                hit = self._best.get(tuple(ctx[-n:]))
                if hit is not None:
                    break
            if hit is None or hit[1] < min_prob * hit[2]:
                break
            out.append(hit[0])
            ctx = ctx[1:] + [hit[0]] if len(ctx) == self.max_ngram else ctx + [hit[0]]
        return out


class SuffixDrafter:
    """Drafts a chain from a table of earlier replies merged with prompt lookup's continuation.

    ``table`` may be shared by several drafters (the rows of a batch); with ``learn`` the reply (the
    tokens generated after the prompt) is added to it as its tokens are committed, so later requests,
    and the rest of this one, draft from it. ``lookup`` = prompt lookup's draft length (its default
    n-grams; 0: the table only), its length adapting to the sequence and its loops repeating
    (``adaptive``, ``periodic``: :class:`PromptLookupDrafter`).
    """

    hidden_layers: tuple[int, ...] = ()
    proposes_for_free = True  # dict lookups and an n-gram search, no model; what it keeps only scores the next update

    def __init__(self, table: NgramTable | None = None, num_tokens: int = 3, min_ngram: int = 2,
                 min_prob: float = 0.4, lookup: int = 10, learn: bool = True, adaptive: bool = True,
                 periodic: bool = True):
        if num_tokens < 1 or lookup < 0:
            raise ValueError(f"need num_tokens >= 1 and lookup >= 0, got {num_tokens}, {lookup}")
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
        self.table = table if table is not None else NgramTable()
        if not 1 <= min_ngram <= self.table.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= {self.table.max_ngram} (the table's max_ngram), got {min_ngram}")
        self.num_tokens, self.min_ngram, self.min_prob = num_tokens, min_ngram, min_prob
        self.learn = learn
        self._lookup = PromptLookupDrafter(num_tokens=lookup, adaptive=adaptive, periodic=periodic) if lookup else None
        self._prompt_len = 0
        self._counted = 0
        """Tokens of the sequence whose pairs the table holds (the prompt's are never counted)."""

    def _learn(self, tokens: Tensor) -> None:
        if not self.learn or tokens.numel() <= self._counted:
            return
        start = max(self._prompt_len, self._counted - self.table.max_ngram)  # the new tokens' contexts
        self.table.add(tokens[start:].tolist(), self._counted - start)
        self._counted = tokens.numel()

    def reset(self, step: StepResult) -> None:
        self._prompt_len = self._counted = step.tokens.numel() - 1  # step.tokens: the prompt and the first new token
        self._learn(step.tokens)
        if self._lookup is not None:
            self._lookup.reset(step)

    def propose(self, tokens: Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        chain = self.table.chain(tokens[-self.table.max_ngram :].tolist(), self.num_tokens, self.min_ngram, self.min_prob)
        drafts = [self._lookup.propose(tokens, sampling, generator)] if self._lookup is not None else []
        return merge_drafts(drafts + [Draft(*tree_from_token_paths(int(tokens[-1]), [chain] if chain else []))])

    def update(self, step: StepResult) -> None:
        self._learn(step.tokens)
        if self._lookup is not None:
            self._lookup.update(step)


def corpus_replies(corpus: str | Path) -> list[str]:
    """The assistant replies of a conversations file or folder (any format ``selfdraft.data`` reads)."""
    from selfdraft.data import load_conversations

    conversations, _ = load_conversations(corpus)
    replies = [m["content"] for c in conversations for m in c if m["role"] == "assistant"]
    if not replies:
        raise ValueError(f"suffix corpus {corpus} holds no assistant replies")
    return replies


def corpus_table(corpus: str | Path, tokenizer, max_ngram: int = 6, max_tokens: int = 0) -> NgramTable:
    """A table of a corpus's assistant replies, tokenized as the target generates them (no special tokens)."""
    table = NgramTable(max_ngram, max_tokens)
    for text in corpus_replies(corpus):
        table.add(tokenizer.encode(text, add_special_tokens=False))
    return table
