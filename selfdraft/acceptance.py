"""Acceptance rules: which draft path the target keeps, and the token it adds after it.

* :func:`accept_greedy` - longest root-to-node path whose every token equals the target argmax at
  its parent (exact: the output equals plain greedy decoding).
* :func:`accept_sampling` - lossless recursive rejection sampling over a tree (SpecInfer, Miao et
  al. 2024; Recursive Speculative Decoding, Jeon et al. 2024). At a node with target distribution p
  and children x_1..x_k drawn from q (sequentially, without replacement), child x_i is accepted with
  probability min(1, p(x_i) / q_i(x_i)); on rejection p <- norm(max(0, p - q_i)) and x_i is removed
  from q. When every child is rejected, the next token is drawn from the residual p; when a leaf is
  reached, a bonus token is drawn from p at the leaf. A deterministic drafter is the case q = one-hot.
* :func:`accept_matching` - the same rule for deterministic drafts, by drawing y ~ p at each node and
  following the child whose token is y: the same distribution, from draws alone.
* :func:`accept_typical` - Medusa's typical acceptance. **Lossy**: fast, but the output distribution
  is *not* the target's. Opt-in only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from selfdraft.sampling import argmax, sample
from selfdraft.tree import Tree


@dataclass(frozen=True)
class Acceptance:
    """Result of verifying one draft tree."""

    path: Tensor
    """(1 + accepted,) node indices from the root to the last accepted node."""
    next_token: int
    """Token the target adds after the path: a correction (rejection) or a bonus (leaf reached)."""

    @property
    def num_accepted(self) -> int:
        return int(self.path.numel()) - 1


def _deepest_valid(tree: Tree, node_ok: Tensor) -> Tensor:
    """Path to the deepest node whose whole root path is ok (``node_ok`` (n,) bool, root forced ok)."""
    node_ok = node_ok.clone()
    node_ok[0] = True
    valid = ~(tree.ancestors & ~node_ok[None, :]).any(1)
    score = torch.where(valid, tree.depth, -1)
    best = int(score.argmax())  # argmax returns the first maximum: the higher-ranked branch wins ties
    return tree.path_to(best)


def accept_greedy(tree: Tree, tokens: Tensor, target_logits: Tensor) -> Acceptance:
    """Greedy verification.

    tokens: (n,) draft tokens (tokens[0] is the root). target_logits: (n, V) target logits at each node.
    """
    target_next = argmax(target_logits).cpu()
    ok = tokens == target_next[tree.parents.clamp(min=0)]
    path = _deepest_valid(tree, ok)
    return Acceptance(path=path, next_token=int(target_next[path[-1]]))


def accept_sampling(
    tree: Tree,
    tokens: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor | None,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Lossless tree rejection sampling.

    tokens: (n,) draft tokens. target_probs: (n, V) processed target distributions p at each node.
    draft_probs: (n, V) distribution q each node's children were drawn from (without replacement,
    in child order), or None for a deterministic drafter (q = one-hot of each proposed child).
    """
    children = tree.children()
    token_list = tokens.tolist()
    node = 0
    path = [0]
    while True:
        kids = children[node]
        p = target_probs[node]
        if not kids:
            return Acceptance(torch.tensor(path), int(sample(p, generator)))
        q = draft_probs[node] if draft_probs is not None else None
        accepted = -1
        for child in kids:
            x = token_list[child]
            px = float(p[x])
            qx = float(q[x]) if q is not None else 1.0
            if qx <= 0.0:
                raise ValueError(f"draft token {x} at node {child} has q(x) = 0: it cannot have been drawn from q")
            if float(torch.rand((), generator=generator)) * qx < px:
                accepted = child
                break
            # rejected: move to the residual norm(max(0, p - q)) and take x out of q
            if q is None:
                p = p.clone()
                p[x] = 0.0
            else:
                p = (p - q).clamp_(min=0.0)
                q = q.clone()
                q[x] = 0.0
                q_mass = float(q.sum())
                q = q / q_mass if q_mass > 0 else q
            mass = float(p.sum())
            if mass <= 0.0:
                # p <= q everywhere yet x was rejected: only possible through rounding; fall back to p
                p = target_probs[node]
                break
            p = p / mass
        if accepted < 0:
            return Acceptance(torch.tensor(path), int(sample(p, generator)))
        path.append(accepted)
        node = accepted


def accept_matching(tree: Tree, tokens: Tensor, draw: Callable[[int], int]) -> Acceptance:
    """Lossless verification of a deterministic draft (q one-hot at every node) by drawing: at each node
    y ~ p (``draw(node)``); the child whose token is y is accepted and the walk goes on from it, else y
    is the next token (at a leaf, the bonus).

    The same distribution as :func:`accept_sampling` with ``draft_probs=None``: there child x_i is
    accepted with probability p(x_i) / (1 - sum of its elder siblings' p), after each of them was
    rejected, i.e. with overall probability p(x_i) (a repeated token's later copies never), and once
    every child is rejected the next token follows p without the children, renormalised: y ~ p given
    the branch it falls in. One draw per node visited, and only those rows' distributions are needed
    (:mod:`selfdraft.screened_draws` draws without the whole vocabulary projection).
    """
    children = tree.children()
    token_list = tokens.tolist()
    node = 0
    path = [0]
    while True:
        y = draw(node)
        child = next((c for c in children[node] if token_list[c] == y), None)
        if child is None:
            return Acceptance(torch.tensor(path), y)
        path.append(child)
        node = child


def accept_typical(
    tree: Tree,
    tokens: Tensor,
    target_probs: Tensor,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Medusa typical acceptance (LOSSY: does not preserve the target distribution).

    A node is acceptable when p_parent(token) > min(threshold, alpha * exp(-H(p_parent))); the
    deepest fully acceptable path wins and the next token is sampled from p at its end.
    """
    p = target_probs
    entropy = -(p * torch.log(p.clamp_min(1e-10))).sum(-1)
    cutoff = torch.minimum(torch.full_like(entropy, posterior_threshold), posterior_alpha * torch.exp(-entropy))
    parent = tree.parents.clamp(min=0)
    ok = p[parent, tokens] > cutoff[parent]
    path = _deepest_valid(tree, ok)
    return Acceptance(path=path, next_token=int(sample(p[path[-1]], generator)))
