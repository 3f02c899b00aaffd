"""Draft trees as data: a parent array and everything derived from it.

A tree has ``n`` nodes; node 0 is the *root* (the last committed token, whose KV is not yet in the
target cache) and ``parents[i] < i`` for every other node (topological order). From the parent array
we derive the tree attention mask (each node sees itself and its ancestors; the prefix is visible to
all), position ids (prefix length + depth) and retrieve indices (one row per root-to-leaf path), as in
Medusa (Cai et al., 2024), SpecInfer (Miao et al., 2024) and EAGLE-2 (Li et al., 2024).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Tree:
    """A draft tree. ``parents[0] == -1``; all tensors live on the CPU and are tiny."""

    parents: Tensor
    """(n,) int64 parent index of each node; -1 for the root."""
    depth: Tensor
    """(n,) int64 distance from the root (root = 0)."""
    ancestors: Tensor
    """(n, n) bool; ``ancestors[i, j]`` is True when j is i or an ancestor of i (the tree attention mask)."""

    @property
    def size(self) -> int:
        return int(self.parents.numel())

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @property
    def is_chain(self) -> bool:
        """True for a line of nodes (each node's parent the one before): causal attention. A parent
        always precedes its child, so the last node at depth n-1 puts every node on one path."""
        return int(self.depth[-1]) == self.size - 1

    def children(self) -> list[list[int]]:
        """Child lists in node order (siblings keep their index order, i.e. their draft rank)."""
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                kids[p].append(i)
        return kids

    def path_to(self, node: int) -> Tensor:
        """(depth+1,) node indices from the root to ``node``, in order."""
        return self.ancestors[node].nonzero().flatten()

    def retrieve_indices(self) -> Tensor:
        """(n_leaves, max_depth + 1) root-to-leaf node indices, right-padded with -1 (Medusa's layout)."""
        is_leaf = torch.ones(self.size, dtype=torch.bool)
        is_leaf[self.parents[1:]] = False
        rows = torch.full((int(is_leaf.sum()), self.max_depth + 1), -1, dtype=torch.long)
        for r, leaf in enumerate(is_leaf.nonzero().flatten().tolist()):
            path = self.path_to(leaf)
            rows[r, : path.numel()] = path
        return rows


def tree_from_parents(parents: Sequence[int] | Tensor) -> Tree:
    """Build a tree from a parent array; raises if it is not rooted at 0 in topological order."""
    # Python lists first and one tensor per field: drafters build a tree every step, and per-element
    # tensor indexing costs more than the whole build for the trees we draft (5-60 nodes).
    plist = parents.flatten().tolist() if isinstance(parents, Tensor) else [int(p) for p in parents]
    n = len(plist)
    if n == 0 or plist[0] != -1:
        raise ValueError(f"a tree needs node 0 as its root with parent -1, got parents={plist}")
    if any(not 0 <= p < i for i, p in enumerate(plist) if i > 0):
        raise ValueError(f"parents must satisfy 0 <= parents[i] < i for i > 0, got {plist}")
    depth = [0] * n
    rows = [[False] * n for _ in range(n)]
    rows[0][0] = True
    for i in range(1, n):
        p = plist[i]
        depth[i] = depth[p] + 1
        row = rows[i]
        row[: p + 1] = rows[p][: p + 1]
        row[i] = True
    parents = torch.tensor(plist, dtype=torch.long)
    depth = torch.tensor(depth, dtype=torch.long)
    ancestors = torch.tensor(rows, dtype=torch.bool)
    return Tree(parents=parents, depth=depth, ancestors=ancestors)


def chain_tree(length: int) -> Tree:
    """A root followed by ``length`` draft nodes in a line (classic speculative decoding; a prefill's
    prompt). Built from tensors: :func:`tree_from_parents`' Python rows cost seconds for a long prompt
    (2.6 s for 4,541 tokens)."""
    if length < 0:
        raise ValueError(f"a chain has length >= 0, got {length}")
    n = length + 1
    return Tree(
        parents=torch.arange(-1, length, dtype=torch.long),
        depth=torch.arange(n, dtype=torch.long),
        ancestors=torch.ones(n, n, dtype=torch.bool).tril_(),
    )


def tree_from_paths(paths: Sequence[Sequence[int]]) -> tuple[Tree, Tensor]:
    """Build a static tree from Medusa-style choice paths.

    Each path is a tuple of ranks, e.g. ``(0, 1)`` = top-1 candidate at depth 1, then its top-2
    candidate at depth 2. Missing prefixes are added. Returns the tree and ``rank`` (n,), the
    candidate rank each node takes at its depth (-1 for the root). Siblings are ordered by rank.
    """
    closed = {tuple(p[:i]) for p in paths for i in range(1, len(p) + 1)}
    if any(r < 0 for p in closed for r in p):
        raise ValueError("tree paths hold ranks, which must be >= 0")
    ordered = sorted(closed, key=lambda p: (len(p), p))
    index = {(): 0}
    parents, ranks = [-1], [-1]
    for p in ordered:
        index[p] = len(parents)
        parents.append(index[p[:-1]])
        ranks.append(p[-1])
    return tree_from_parents(parents), torch.tensor(ranks, dtype=torch.long)


def tree_from_token_paths(root: int, paths: Sequence[Sequence[int]]) -> tuple[Tree, Tensor]:
    """Merge token sequences that all follow ``root`` into a trie; returns (tree, tokens (n,))."""
    parents, tokens = [-1], [root]
    child: dict[tuple[int, int], int] = {}
    for path in paths:
        node = 0
        for tok in path:
            key = (node, int(tok))
            if key not in child:
                child[key] = len(parents)
                parents.append(node)
                tokens.append(int(tok))
            node = child[key]
    return tree_from_parents(parents), torch.tensor(tokens, dtype=torch.long)


def tree_positions(tree: Tree, prefix_len: int) -> Tensor:
    """(n,) position ids of the tree nodes: the root sits at ``prefix_len``."""
    return tree.depth + prefix_len


def select_nodes(tree: Tree, keep: Tensor) -> tuple[Tree, Tensor]:
    """Sub-tree of the nodes where ``keep`` (n,) bool is True; ``keep`` must be closed under ancestors.

    Returns the new tree and the old index of each kept node (so callers can re-index tokens or q).
    """
    keep = keep.clone()
    keep[0] = True
    old = keep.nonzero().flatten()
    if bool((tree.ancestors[old] & ~keep[None, :]).any()):
        raise ValueError("select_nodes: the kept set must contain every ancestor of a kept node")
    new_index = torch.full((tree.size,), -1, dtype=torch.long)
    new_index[old] = torch.arange(old.numel())
    parents = tree.parents[old].clone()
    parents[1:] = new_index[parents[1:]]
    return tree_from_parents(parents), old


def truncate_depth(tree: Tree, max_depth: int) -> tuple[Tree, Tensor]:
    """Drop nodes deeper than ``max_depth``; returns (tree, old indices)."""
    if tree.max_depth <= max_depth:
        return tree, torch.arange(tree.size)
    return select_nodes(tree, tree.depth <= max_depth)


def top_nodes_by_score(tree: Tree, scores: Tensor, budget: int) -> tuple[Tree, Tensor]:
    """EAGLE-2 re-ranking: keep the root and the ``budget`` best-scoring nodes.

    ``scores`` (n,) are cumulative draft log-probabilities, so a node never outscores its parent and
    the top set is closed under ancestors; ties are broken towards shallower, earlier nodes.
    """
    if tree.size - 1 <= budget:
        return tree, torch.arange(tree.size)
    # in Python lists: drafters re-rank every step, trees of 3-60 nodes, where tensor ops cost more
    s = scores.float().tolist()
    parents = tree.parents.tolist()
    # stable sort on (score desc, index asc): earlier (shallower or higher-ranked) nodes win ties
    best = sorted(range(1, tree.size), key=lambda i: -s[i])[:budget]
    keep = {0}
    for i in best:  # close under ancestors in case of equal scores along a path
        while i not in keep:
            keep.add(i)
            i = parents[i]
    old = sorted(keep)
    new_index = {o: n for n, o in enumerate(old)}
    return tree_from_parents([-1] + [new_index[parents[o]] for o in old[1:]]), torch.tensor(old)
