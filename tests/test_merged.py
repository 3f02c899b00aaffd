"""Merged drafting: the union of deterministic draft trees, verified in one forward."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompt
from test_eagle3 import make_head

from selfdraft.drafters import MergedDrafter, PromptLookupDrafter, merge_drafts
from selfdraft.drafters.base import Draft
from selfdraft.drafters.eagle import EagleDrafter
from selfdraft.generate import GenerationConfig, generate
from selfdraft.tree import tree_from_token_paths


def paths_of(draft: Draft) -> set[tuple[int, ...]]:
    """Every root-to-node token path of a draft (the root's token excluded)."""
    return {tuple(draft.tokens[draft.tree.path_to(i)[1:]].tolist()) for i in range(1, draft.tree.size)}


def test_merge_shares_common_prefixes_and_keeps_every_path():
    """Guards the trie union: shared prefixes become one node, every member path survives, order is topological."""
    a = Draft(*tree_from_token_paths(7, [[1, 2, 3], [4]]))
    b = Draft(*tree_from_token_paths(7, [[1, 2, 9, 9], [5, 6]]))
    merged = merge_drafts([a, b])
    assert paths_of(merged) == paths_of(a) | paths_of(b)
    assert merged.tree.size == 1 + 4 + 4  # 1, 1-2, 1-2-3, 4 | 1-2-9, 1-2-9-9, 5, 5-6
    assert merged.tokens[: a.tree.size].tolist() == a.tokens.tolist()  # the first draft keeps its order
    assert merge_drafts([a]).tokens.tolist() == a.tokens.tolist()
    with pytest.raises(ValueError, match="share the root"):
        merge_drafts([a, Draft(*tree_from_token_paths(8, [[1]]))])
    with pytest.raises(ValueError, match="deterministic"):
        merge_drafts([a, Draft(b.tree, b.tokens, torch.ones(b.tree.size, 10) / 10)])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_head_plus_prompt_lookup_equals_plain_greedy(models, arch):
    """Guards MergedDrafter end to end: both members keep their own state through the merged steps."""
    model = models[arch]
    head = make_head(model, scale=20.0)
    merged_accepted = head_accepted = 0
    for i in range(6):
        base = random_prompt(4 + 5 * i, i)
        prompt = base + base  # repetition, so prompt lookup has matches to propose
        ref = generate(model, prompt, None, GenerationConfig(max_new_tokens=20)).tokens
        drafter = MergedDrafter([EagleDrafter(head, depth=2, top_k=2, total_tokens=3), PromptLookupDrafter()])
        assert drafter.hidden_layers == tuple(dict.fromkeys(head.feature_layers))  # each state asked for once
        out = generate(model, prompt, drafter, GenerationConfig(max_new_tokens=20))
        assert out.tokens == ref, f"{arch} prompt {i}"
        alone = generate(model, prompt, EagleDrafter(head, depth=2, top_k=2, total_tokens=3), GenerationConfig(max_new_tokens=20))
        merged_accepted += out.stats.accepted
        head_accepted += alone.stats.accepted
    # the lookup branch must win tokens the head alone does not, or the test would not see a merge that drops it
    assert merged_accepted > head_accepted, (merged_accepted, head_accepted)


def test_head_spec_with_lookup_builds_a_merged_drafter(models, tmp_path):
    """Guards the user-facing spec head:path=DIR,lookup=N (and its bad value)."""
    from selfdraft.drafters import drafter_factory
    from selfdraft.heads import save

    model = models["llama"]
    head = make_head(model)
    save(tmp_path / "head", "eagle3", head.cfg, head, model, "tiny-llama")
    drafter = drafter_factory("head", model, path=str(tmp_path / "head"), lookup=4, depth=2, top_k=2, total_tokens=3)()
    assert isinstance(drafter, MergedDrafter) and isinstance(drafter.drafters[1], PromptLookupDrafter)
    assert drafter.drafters[1].num_tokens == 4
    assert isinstance(drafter_factory("head", model, path=str(tmp_path / "head"))(), EagleDrafter)
    with pytest.raises(ValueError, match="lookup must be >= 0"):
        drafter_factory("head", model, path=str(tmp_path / "head"), lookup=-1)
