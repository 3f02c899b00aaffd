"""Drafters: the protocol and a plain registry of implementations, built by name."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial

from torch import nn

from selfdraft.drafters.base import Draft, Drafter, StepResult, root_only
from selfdraft.drafters.draft_model import DraftModelDrafter
from selfdraft.drafters.layer_skip import layer_skip_drafter
from selfdraft.drafters.merged import MergedDrafter, merge_drafts
from selfdraft.drafters.prompt_lookup import PromptLookupDrafter
from selfdraft.drafters.suffix import NgramTable, SuffixDrafter, corpus_table


def _draft_model(target: nn.Module, model: str | nn.Module, dtype: str | None = None, **options) -> Drafter:
    if isinstance(model, str):
        from selfdraft.target import load_target

        model = load_target(model, dtype=dtype or target.dtype).model
    return DraftModelDrafter(model, **options)


def _head(target: nn.Module, path: str, **options) -> Drafter:
    return _head_factory(target, path, **options)()


def _head_factory(target: nn.Module, path: str, lookup: int = 0, suffix: bool | str = False,
                  temperature: float = 0.0, free_alone: bool = True, **options) -> Callable[[], Drafter]:
    """Read the head folder once; drafters built from it share the head module. Options default to
    the folder's tune.json (the tree ``selfdraft tune`` picked for this machine; with ``lookup=N`` the
    one it picked to merge with lookup, ``selfdraft tune --lookup N``; at ``temperature`` > 0, the
    generation's sampling temperature, the one it picked for sampling, ``selfdraft tune --temperature``).
    ``lookup=N`` (> 0) merges a prompt-lookup continuation of up to N tokens into every head tree
    (MergedDrafter). ``suffix=true`` merges a suffix drafter instead (its table of earlier replies
    and the same N-token lookup; one table for all drafters of the factory), ``suffix=FILE`` one
    whose table is seeded with the replies of a conversations file (as ``suffix:corpus=FILE``).
    ``free_alone=false`` keeps the gated decode loop from verifying the lookup or suffix draft without
    the head's nodes (MergedDrafter.free_alone)."""
    from selfdraft.heads import head_type, load_head
    from selfdraft.tune import read_tuned

    lookup = int(lookup)
    if lookup < 0:
        raise ValueError(f"lookup must be >= 0 draft tokens, got {lookup}")
    if not isinstance(suffix, (bool, str)):
        raise ValueError(f"suffix must be true, false or a conversations file (the table's seed), got {suffix!r}")
    kind, head, _ = load_head(path, target)
    tuned = read_tuned(path, lookup, temperature)
    if tuned:
        shown = {k: v for k, v in tuned.items() if k != "paths"} or f"{len(tuned['paths'])} paths"
        print(f"[head] tree tuned for this machine (tune.json): {shown}; options given here override it", file=sys.stderr)
    settings = {**tuned, **options}
    if (lookup or suffix) and settings.get("sample"):
        raise ValueError("sample=true draws the head's children at random, and a merged tree needs deterministic "
                         "members: drop sample, or lookup and suffix")
    if not (lookup or suffix):
        return lambda: head_type(kind).drafter(head, **settings)
    if suffix:
        member = _suffix_factory(target, corpus=suffix if isinstance(suffix, str) else "", lookup=lookup)
    else:
        member = partial(PromptLookupDrafter, num_tokens=lookup)
    return lambda: MergedDrafter([head_type(kind).drafter(head, **settings), member()], free_alone)


SUFFIX_MAX_TOKENS = 1_000_000
"""The suffix table's default bound, in tokens (Python dicts of about 0.8 KiB per token of SmolLM2 replies)."""


def _suffix_factory(target: nn.Module, corpus: str = "", max_ngram: int = 6, max_tokens: int = SUFFIX_MAX_TOKENS,
                    **options) -> Callable[[], Drafter]:
    """Suffix drafters sharing one table: seeded with the assistant replies of ``corpus`` (a
    conversations file or folder, e.g. ``selfdraft distill`` output of this target), then growing
    with every reply, up to the most recent ``max_tokens`` tokens (0: no bound)."""
    if not corpus:
        table = NgramTable(int(max_ngram), int(max_tokens))
        return lambda: SuffixDrafter(table, **options)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(target.name_or_path)
    except (OSError, ValueError) as err:
        raise ValueError(f"suffix corpus: the target's tokenizer is not at {target.name_or_path!r} ({err}); "
                         "load the target once so its de-quantised copy (with the tokenizer) is cached") from err
    table = corpus_table(corpus, tokenizer, int(max_ngram), int(max_tokens))
    print(f"[suffix] table of {table.tokens} tokens of replies from {corpus}", file=sys.stderr)
    return lambda: SuffixDrafter(table, **options)


def _checked_factory(name: str, make: Callable[[], Callable[[], Drafter]]) -> Callable[[], Drafter]:
    """``make()``'s factory, with one drafter built right away so bad options fail here, as ValueError."""
    try:
        factory = make()
        factory()
    except TypeError as err:
        raise ValueError(f"bad options for drafter '{name}': {err}") from err
    return factory


DRAFTERS: dict[str, Callable[..., Drafter]] = {
    "head": _head,
    "prompt_lookup": lambda target, **options: PromptLookupDrafter(**options),
    "suffix": lambda target, **options: _suffix_factory(target, **options)(),
    "layer_skip": layer_skip_drafter,
    "draft_model": _draft_model,
}


def drafter_factory(name: str, target: nn.Module, temperature: float = 0.0, **options) -> Callable[[], Drafter]:
    """A function that builds fresh drafters (one per sequence of a batch) sharing what can be shared
    (a head folder is read once). Builds one drafter right away so bad options fail here.
    ``temperature``: the sampling temperature the drafters will run at (a head picks its tuned tree by it)."""
    if name == "head":
        if "path" not in options:
            raise ValueError("the head drafter needs path=HEAD_DIR")
        return _checked_factory(name, lambda: _head_factory(target, temperature=temperature, **options))
    if name == "suffix":  # one table for all the rows
        return _checked_factory(name, lambda: _suffix_factory(target, **options))
    build_drafter(name, target, **options)
    return lambda: build_drafter(name, target, **options)


def build_drafter(name: str, target: nn.Module, temperature: float = 0.0, **options) -> Drafter:
    """Build the drafter registered under ``name`` for ``target``; unknown names list the known ones.
    ``temperature``: the sampling temperature it will run at (a head picks its tuned tree by it)."""
    if name not in DRAFTERS:
        raise KeyError(f"unknown drafter '{name}'; known: {', '.join(sorted(DRAFTERS))}")
    try:
        if name == "head":
            return DRAFTERS[name](target, temperature=temperature, **options)
        return DRAFTERS[name](target, **options)
    except TypeError as err:
        raise ValueError(f"bad options for drafter '{name}': {err}") from err


__all__ = [
    "DRAFTERS",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "MergedDrafter",
    "PromptLookupDrafter",
    "StepResult",
    "SuffixDrafter",
    "build_drafter",
    "drafter_factory",
    "layer_skip_drafter",
    "merge_drafts",
    "root_only",
]
