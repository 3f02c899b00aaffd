"""Drafters: the protocol and a plain registry of implementations, built by name."""

from __future__ import annotations

import sys
from collections.abc import Callable

from torch import nn

from selfdraft.drafters.base import Draft, Drafter, StepResult, root_only
from selfdraft.drafters.draft_model import DraftModelDrafter
from selfdraft.drafters.layer_skip import layer_skip_drafter
from selfdraft.drafters.prompt_lookup import PromptLookupDrafter


def _draft_model(target: nn.Module, model: str | nn.Module, dtype: str | None = None, **options) -> Drafter:
    if isinstance(model, str):
        from selfdraft.target import load_target

        model = load_target(model, dtype=dtype or target.dtype).model
    return DraftModelDrafter(model, **options)


def _head(target: nn.Module, path: str, **options) -> Drafter:
    from selfdraft.heads import head_type, load_head
    from selfdraft.tune import read_tuned

    kind, head, _ = load_head(path, target)
    tuned = read_tuned(path)
    if tuned:
        shown = {k: v for k, v in tuned.items() if k != "paths"} or f"{len(tuned['paths'])} paths"
        print(f"[head] tree tuned for this machine (tune.json): {shown}; options given here override it", file=sys.stderr)
    return head_type(kind).drafter(head, **{**tuned, **options})


DRAFTERS: dict[str, Callable[..., Drafter]] = {
    "head": _head,
    "prompt_lookup": lambda target, **options: PromptLookupDrafter(**options),
    "layer_skip": layer_skip_drafter,
    "draft_model": _draft_model,
}


def build_drafter(name: str, target: nn.Module, **options) -> Drafter:
    """Build the drafter registered under ``name`` for ``target``; unknown names list the known ones."""
    if name not in DRAFTERS:
        raise KeyError(f"unknown drafter '{name}'; known: {', '.join(sorted(DRAFTERS))}")
    try:
        return DRAFTERS[name](target, **options)
    except TypeError as err:
        raise ValueError(f"bad options for drafter '{name}': {err}") from err


__all__ = [
    "DRAFTERS",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "PromptLookupDrafter",
    "StepResult",
    "build_drafter",
    "layer_skip_drafter",
    "root_only",
]
