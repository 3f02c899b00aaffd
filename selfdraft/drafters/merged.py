"""Several deterministic drafters merged into one draft tree (e.g. a trained head + prompt lookup).

Every member proposes its own tree from the same root; the trees are merged as a trie (paths that
agree token for token share their nodes), so the target verifies all candidates in one forward and
the acceptance rule keeps the longest agreeing path. A trained head guesses the language, prompt
lookup copies spans of the context: they miss on different tokens, and the merged tree keeps both.
Every member is told each step's outcome, so each keeps (and rolls back) its own state.

The speculation gate sees two kinds of steps (``gate_kind``): those where a member that proposes
for free (prompt lookup) has a draft, and the rest, where only the paid members (the head) would
draft. They differ in cost and acceptance, so the gate decides for each on its own: a copied span is
verified even where the head alone does not pay. The free members' drafts computed for the kind are
kept for the ``propose`` that follows, not computed twice, and while the gate runs plain steps they
are scored in the shadow (``shadow_draft``), as prompt lookup alone is: a few wrong matches early in
a reply then do not keep the copied spans unverified once the reply turns to copying.
Where the free members have a draft, the decode loop may also verify it alone (``free_alone``): no
head forward and a smaller tree, an alternative the gate weighs against the whole merged tree and
plain decoding (:meth:`selfdraft.gate.SpeculationGate.pick`), so a head that adds less to a copied
span than it costs is left out of that step instead of slowing it.

Members must draft deterministically (``Draft.q is None``: children are a function of the context),
which keeps sampling lossless for the merged tree as for each member; a member that draws its
children at random cannot be merged, because its q would not describe the merged siblings.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from selfdraft.drafters.base import Draft, Drafter, StepResult
from selfdraft.sampling import SamplingConfig
from selfdraft.tree import tree_from_parents


def merge_drafts(drafts: Sequence[Draft]) -> Draft:
    """Union of deterministic drafts with the same root, as a trie in topological order.

    The first draft's nodes keep their order; each later draft adds only the nodes whose path is
    new. Raises ValueError for drafts with different roots or with a sampling distribution q.
    """
    root = int(drafts[0].tokens[0])
    parents, tokens = [-1], [root]
    node_of: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    for draft in drafts:
        if draft.q is not None:
            raise ValueError("only deterministic drafts (q=None) can be merged: a drafter that samples its "
                             "children cannot share a tree without breaking lossless sampling")
        if int(draft.tokens[0]) != root:
            raise ValueError(f"drafts to merge must share the root: {int(draft.tokens[0])} != {root}")
        merged = [0]  # merged node of each node of this draft
        for parent, token in zip(draft.tree.parents[1:].tolist(), draft.tokens[1:].tolist()):
            key = (merged[parent], token)
            node = node_of.get(key)
            if node is None:
                node = node_of[key] = len(parents)
                parents.append(key[0])
                tokens.append(token)
            merged.append(node)
    return Draft(tree_from_parents(parents), torch.tensor(tokens, dtype=torch.long))


class MergedDrafter:
    """Drafts with every member and verifies the union of their trees."""

    def __init__(self, drafters: Sequence[Drafter], free_alone: bool = True):
        if not drafters:
            raise ValueError("MergedDrafter needs at least one drafter")
        self.drafters = list(drafters)
        self.free_alone = bool(free_alone)
        """Whether the decode loop may verify the free members' draft without the others' (gated)."""
        self.hidden_layers = tuple(dict.fromkeys(i for d in self.drafters for i in d.hidden_layers))
        self.proposes_for_free = all(getattr(d, "proposes_for_free", False) for d in self.drafters)
        self._free = [i for i, d in enumerate(self.drafters) if getattr(d, "proposes_for_free", False)]
        self._pending: tuple[int, dict[int, Draft]] | None = None
        """(sequence length, member index -> draft): the free members' drafts of the current step."""

    def _free_drafts(self, tokens: Tensor, sampling: SamplingConfig) -> dict[int, Draft]:
        """The free members' drafts for ``tokens`` (member index -> draft): the ones kept for this
        sequence length since the last step, else proposed now and kept (free members draw nothing)."""
        if self._pending is None or self._pending[0] != tokens.numel():
            self._pending = (tokens.numel(), {i: self.drafters[i].propose(tokens, sampling, None) for i in self._free})
        return self._pending[1]

    def gate_kind(self, tokens: Tensor, sampling: SamplingConfig) -> tuple[bool, ...] | None:
        """Whether each member that proposes for free has a draft for ``tokens`` (None: no such member,
        or every member is free and the gate can shadow the whole drafter)."""
        if not self._free or self.proposes_for_free:
            return None
        drafts = self._free_drafts(tokens, sampling)
        return tuple(drafts[i].tree.size > 1 for i in self._free)

    def shadow_draft(self, tokens: Tensor, sampling: SamplingConfig) -> Draft | None:
        """The free members' merged draft for ``tokens`` (no model forward, no state change): what the
        decode loop scores in the shadow of a plain step; a lower bound on what the whole tree would
        have committed. None when no free member has a draft."""
        drafts = [d for d in self._free_drafts(tokens, sampling).values() if d.tree.size > 1]
        return merge_drafts(drafts) if drafts else None

    def reset(self, step: StepResult) -> None:
        self._pending = None
        for d in self.drafters:
            d.reset(step)

    def propose(self, tokens: Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        free = self._free_drafts(tokens, sampling)
        self._pending = None
        return merge_drafts([free[i] if i in free else d.propose(tokens, sampling, generator) for i, d in enumerate(self.drafters)])

    def update(self, step: StepResult) -> None:
        self._pending = None
        for d in self.drafters:
            d.update(step)
