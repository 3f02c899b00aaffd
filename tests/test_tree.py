"""Tree construction: parent arrays, Medusa path lists, tries, masks, retrieve indices, EAGLE-2 rerank."""

from __future__ import annotations

import pytest
import torch

from selfdraft.tree import (
    chain_tree,
    select_nodes,
    top_nodes_by_score,
    tree_from_parents,
    tree_from_paths,
    tree_from_token_paths,
    tree_positions,
    truncate_depth,
)


def test_mask_is_explicit_ancestor_relation():
    """Guards the tree attention mask against off-by-one or sibling leaks (checked against a hand-built mask)."""
    tree = tree_from_parents([-1, 0, 0, 1, 1, 2])
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.ancestors, want), tree.ancestors.int()
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2]
    assert tree_positions(tree, 10).tolist() == [10, 11, 11, 12, 12, 12]
    assert tree.retrieve_indices().tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    assert tree.children() == [[1, 2], [3, 4], [5], [], [], []]


def test_chain_is_causal():
    """Guards the chain tree (used for prefill) against being anything but a causal mask."""
    tree = chain_tree(4)
    assert torch.equal(tree.ancestors, torch.tril(torch.ones(5, 5, dtype=torch.bool)))


def test_medusa_paths_close_prefixes_and_order_by_rank():
    """Guards static Medusa trees: missing prefixes are added, siblings ordered by candidate rank."""
    tree, rank = tree_from_paths([(0, 1), (1,), (0, 0, 0)])
    # nodes: root, (0), (1), (0,0), (0,1), (0,0,0)
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    assert rank.tolist() == [-1, 0, 1, 0, 1, 0]


def test_token_trie_merges_shared_prefixes():
    """Guards prompt-lookup trees: shared continuations become one branch."""
    tree, tokens = tree_from_token_paths(7, [[1, 2, 3], [1, 2, 4], [5]])
    assert tokens.tolist() == [7, 1, 2, 3, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 2, 0]


@pytest.mark.parametrize("bad", [[0, 0], [-1, 1], [-1, 0, 3, 0], []])
def test_invalid_parent_arrays_are_rejected(bad):
    """Guards against silently building a cyclic or unrooted tree."""
    with pytest.raises(ValueError):
        tree_from_parents(bad)


def test_select_and_truncate_reindex():
    """Guards sub-tree extraction (used to fit drafts to the token budget)."""
    tree = tree_from_parents([-1, 0, 1, 2, 0, 4])
    sub, old = truncate_depth(tree, 1)
    assert sub.parents.tolist() == [-1, 0, 0] and old.tolist() == [0, 1, 4]
    with pytest.raises(ValueError, match="ancestor"):
        select_nodes(tree, torch.tensor([1, 0, 1, 0, 0, 0], dtype=torch.bool))


def test_eagle2_rerank_keeps_best_nodes_and_stays_a_tree():
    """Guards EAGLE-2 reranking: the top-N cumulative scores are kept, closed under ancestors."""
    tree = tree_from_parents([-1, 0, 0, 1, 1, 2, 3])
    scores = torch.tensor([0.0, -0.1, -1.0, -0.3, -2.0, -1.1, -0.5])
    sub, old = top_nodes_by_score(tree, scores, budget=3)
    assert old.tolist() == [0, 1, 3, 6], old
    assert sub.parents.tolist() == [-1, 0, 1, 2]


def test_eagle2_rerank_equals_the_definition_on_random_trees_with_ties():
    """Guards top_nodes_by_score's list-based selection against the definition: the root and the
    budget best nodes by (score desc, index asc), closed under ancestors (which cumulative scores
    never need, other scores do), as select_nodes cuts them."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = int(torch.randint(2, 30, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        tree = tree_from_parents(parents)
        steps = -torch.randint(0, 3, (n,), generator=gen).float()  # many ties, zero steps along paths
        scores = torch.zeros(n)
        for i in range(1, n):
            scores[i] = scores[parents[i]] + steps[i]
        if trial % 2:  # scores that are not cumulative: the ancestor closure has work to do
            scores = steps
        budget = int(torch.randint(1, n, (1,), generator=gen))
        order = sorted(range(1, n), key=lambda i: (-float(scores[i]), i))[:budget]
        keep = torch.zeros(n, dtype=torch.bool)
        keep[[0] + order] = True
        want_tree, want_old = select_nodes(tree, (tree.ancestors & keep[:, None]).any(0))
        got_tree, got_old = top_nodes_by_score(tree, scores, budget)
        assert got_old.tolist() == want_old.tolist(), trial
        assert torch.equal(got_tree.parents, want_tree.parents) and torch.equal(got_tree.ancestors, want_tree.ancestors)


@pytest.mark.parametrize("length", [0, 1, 6, 33])
def test_chain_tree_equals_the_parent_built_chain(length):
    """Guards the tensor-built chain (fast for long prompts) against drifting from the general builder."""
    fast, slow = chain_tree(length), tree_from_parents([-1] + list(range(length)))
    for field in ("parents", "depth", "ancestors"):
        got, want = getattr(fast, field), getattr(slow, field)
        assert got.dtype == want.dtype and torch.equal(got, want), field
    assert fast.is_chain and slow.is_chain
    assert not tree_from_parents([-1, 0, 1, 1]).is_chain and not tree_from_parents([-1, 0, 0, 2]).is_chain
