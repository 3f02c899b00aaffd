"""Test-only drafters with known behaviour: oracle (all accepted), random (none), partial (some)."""

from __future__ import annotations

import torch
from torch import Tensor

from selfdraft.drafters.base import Draft, StepResult
from selfdraft.sampling import SamplingConfig
from selfdraft.tree import tree_from_token_paths


class ScriptedDrafter:
    """Drafts from a known reference continuation, optionally corrupted, with decoy siblings.

    mode 'oracle': the true next ``depth`` tokens (plus decoy branches) - everything on the true path
    is accepted. 'random': random tokens only. 'partial': the true path corrupted at a random depth,
    with the true token sometimes offered as a lower-ranked sibling.
    """

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, reference: list[int], mode: str, vocab: int, depth: int = 4, seed: int = 0):
        self.reference, self.mode, self.vocab, self.depth = reference, mode, vocab, depth
        self.g = torch.Generator().manual_seed(seed)

    def _rand(self, n: int) -> list[int]:
        return torch.randint(3, self.vocab, (n,), generator=self.g).tolist()

    def reset(self, step: StepResult) -> None:
        pass

    def propose(self, tokens: Tensor, sampling: SamplingConfig, generator) -> Draft:
        t = tokens.numel()
        truth = self.reference[t : t + self.depth]
        if self.mode == "random":
            paths = [self._rand(self.depth), self._rand(2)]
        elif self.mode == "oracle":
            paths = [truth, self._rand(3)] if truth else [self._rand(2)]
        else:
            cut = int(torch.randint(0, self.depth + 1, (1,), generator=self.g))
            bad = truth[:cut] + self._rand(self.depth - cut)
            paths = [bad, truth[: cut + 1]]  # the true token as a sibling at the corrupted depth
        paths = [p for p in paths if p]
        tree, node_tokens = tree_from_token_paths(int(tokens[-1]), paths)
        return Draft(tree, node_tokens)

    def update(self, step: StepResult) -> None:
        pass


def log_proposals(drafter, proposed: list[int]):
    """Wrap ``drafter.propose`` so every non-empty draft appends the committed length it was proposed at."""
    real_propose = drafter.propose

    def propose(tokens, sampling, generator):
        draft = real_propose(tokens, sampling, generator)
        if draft.tree.size > 1:
            proposed.append(tokens.numel())
        return draft

    drafter.propose = propose
    return drafter
