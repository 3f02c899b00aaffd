"""Layer-skip self-drafting (Draft & Verify, Zhang et al. 2024; LayerSkip, Elhoushi et al. 2024).

The target's first k decoder layers, followed by its own final norm and lm_head, act as the draft
model. Nothing is copied: :func:`selfdraft.adapter.shallow_view` returns a module that holds the
target's own submodules, so draft and target share one set of weights in memory.
"""

from __future__ import annotations

from torch import nn

from selfdraft.adapter import num_layers, shallow_view
from selfdraft.drafters.draft_model import DraftModelDrafter


def layer_skip_drafter(
    target: nn.Module, layers: int | None = None, gamma: int = 4, adaptive: bool = True, max_gamma: int = 12
) -> DraftModelDrafter:
    """A chain drafter running the target's first ``layers`` layers (default: half of them)."""
    kept = layers if layers is not None else max(1, num_layers(target) // 2)
    return DraftModelDrafter(shallow_view(target, kept), gamma=gamma, adaptive=adaptive, max_gamma=max_gamma)
