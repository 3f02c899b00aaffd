"""The drafter protocol: one seam for every way of proposing draft tokens.

A drafter proposes a :class:`Draft` (a tree of tokens rooted at the last committed token) and is told
what the target accepted. Training-free drafters (draft model, layer-skip, prompt lookup) and trained
heads (Medusa, EAGLE) all implement it; the decode loop knows nothing else about them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from selfdraft.sampling import SamplingConfig
from selfdraft.tree import Tree, chain_tree


@dataclass(frozen=True)
class Draft:
    """A proposed tree of tokens."""

    tree: Tree
    tokens: Tensor
    """(n,) int64 token at each node; tokens[0] is the root (the last committed token)."""
    q: Tensor | None = None
    """(n, V) float distribution each node's children were drawn from (in child order, without
    replacement), processed with the same SamplingConfig as the target. None: deterministic children."""

    def __post_init__(self) -> None:
        if self.tokens.shape != (self.tree.size,):
            raise ValueError(f"draft has {self.tree.size} nodes but tokens of shape {tuple(self.tokens.shape)}")


def root_only(root: int) -> Draft:
    """The empty draft: just the root (plain decoding step)."""
    return Draft(chain_tree(0), torch.tensor([root], dtype=torch.long))


@dataclass(frozen=True)
class StepResult:
    """What the target kept after one verification step (given to :meth:`Drafter.update`)."""

    tokens: Tensor
    """(T,) the whole committed sequence, prompt included; tokens[-1] is the next root."""
    num_accepted: int
    """Draft tokens accepted this step (0 .. depth)."""
    hidden_states: dict[int, Tensor] | None = None
    """Target hidden states of the newly committed tokens, (1, k, hidden) per index the drafter
    asked for in ``hidden_layers`` (k = prompt length at reset, 1 + accepted after a step)."""


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft trees; keeps whatever state it needs (its own KV cache) between steps."""

    hidden_layers: tuple[int, ...]
    """Indices into the target's hidden states (0 = embeddings, i = input of layer i, -1 = final
    normed state) that :meth:`reset`/:meth:`update` need; empty for drafters that read tokens only."""

    proposes_for_free: bool
    """True when :meth:`propose` runs no model (prompt lookup) and leaves no state behind: while the
    speculation gate runs plain steps, the loop then keeps proposing and scores the drafts against
    what the target commits (:func:`selfdraft.gate.shadow_accepted`). Optional; absent means False."""

    # Optional: ``gate_kind(tokens, sampling) -> Hashable``, a classification of the coming draft
    # computed without a model forward (a merged drafter: whether its prompt-lookup member found a
    # match). The speculation gate then decides per kind (selfdraft.gate); absent means one kind.
    # Optional: ``shadow_draft(tokens, sampling) -> Draft | None``, the part of the next draft that
    # costs no model forward and changes no state (a merged drafter's prompt-lookup member), scored in
    # the shadow of plain steps as a whole free drafter's proposal is (``proposes_for_free``).
    # Optional: ``free_alone: bool``, with ``shadow_draft``: the gated loop may verify that free part
    # alone instead of the whole tree (an alternative the gate weighs, ``SpeculationGate.pick``).

    def reset(self, step: StepResult) -> None:
        """Start a new sequence after the target's prefill: step.tokens is the prompt plus the first
        generated token, step.hidden_states cover the prompt positions."""

    def propose(self, tokens: Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        """Propose a tree rooted at tokens[-1]. tokens: (T,) committed sequence."""

    def update(self, step: StepResult) -> None:
        """Learn what was accepted (roll back caches, adapt draft length)."""
