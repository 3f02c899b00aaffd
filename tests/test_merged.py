"""Merged drafting: the union of deterministic draft trees, verified in one forward."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompt
from test_eagle3 import make_head

from selfdraft.adapter import new_cache, tree_forward
from selfdraft.drafters import MergedDrafter, PromptLookupDrafter, merge_drafts
from selfdraft.drafters.base import Draft, StepResult
from selfdraft.drafters.eagle import EagleDrafter
from selfdraft.generate import GenerationConfig, generate
from selfdraft.sampling import SamplingConfig
from selfdraft.tree import chain_tree, tree_from_token_paths


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
    assert drafter.free_alone  # the lookup draft may be verified without the head's nodes (gated)
    kept = drafter_factory("head", model, path=str(tmp_path / "head"), lookup=4, free_alone=False, depth=2, top_k=2,
                           total_tokens=3)()
    assert isinstance(kept, MergedDrafter) and not kept.free_alone
    assert isinstance(drafter_factory("head", model, path=str(tmp_path / "head"))(), EagleDrafter)
    with pytest.raises(ValueError, match="lookup must be >= 0"):
        drafter_factory("head", model, path=str(tmp_path / "head"), lookup=-1)


def test_merged_gate_kind_tells_lookup_matches_apart_and_reuses_their_drafts(models, monkeypatch):
    """Guards MergedDrafter.gate_kind and shadow_draft: the kind says whether prompt lookup has a match,
    the draft proposed after it is the one proposed without it (the lookup draft is reused, not
    changed), the shadow draft is prompt lookup's own, and decoding with the per-kind gate (auto_off)
    stays equal to plain greedy, with shadow scores reported under the free part's kind while it is off."""
    from selfdraft import gate as gate_module

    model = models["llama"]
    head = make_head(model, scale=20.0)
    greedy = SamplingConfig()

    def merged():
        return MergedDrafter([EagleDrafter(head, depth=2, top_k=2, total_tokens=3), PromptLookupDrafter()])

    assert MergedDrafter([PromptLookupDrafter()]).gate_kind(torch.tensor([1, 2, 3, 1, 2]), greedy) is None  # all free
    base = random_prompt(12, 3)
    kinds = []
    for i, prompt in enumerate((base + base, list(range(5, 35)))):  # a repeat; no repeated n-gram
        seq = torch.tensor(prompt)
        ref_drafter, kind_drafter = merged(), merged()
        with torch.inference_mode():
            for d in (ref_drafter, kind_drafter):
                fwd = tree_forward(model, new_cache(model, seq.numel() + 8), seq[None], chain_tree(seq.numel() - 1),
                                   d.hidden_layers, True)
                d.reset(StepResult(seq, 0, fwd.hidden_states))
            kinds.append(kind_drafter.gate_kind(seq, greedy))
            shadow = kind_drafter.shadow_draft(seq, greedy)
            want, got = ref_drafter.propose(seq, greedy, None), kind_drafter.propose(seq, greedy, None)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.tree.parents, want.tree.parents), f"prompt {i}"
        lookup = PromptLookupDrafter().propose(seq, greedy, None)
        if lookup.tree.size > 1:
            assert torch.equal(shadow.tokens, lookup.tokens) and torch.equal(shadow.tree.parents, lookup.tree.parents)
        else:
            assert shadow is None
        ref = generate(model, prompt, None, GenerationConfig(max_new_tokens=24)).tokens
        gated = generate(model, prompt, merged(), GenerationConfig(max_new_tokens=24, auto_off=True, probe_every=3))
        assert gated.tokens == ref, f"prompt {i}"
    assert kinds == [(True,), (False,)], kinds
    # the gate held off: plain steps only, the lookup part scored in the shadow under its kind
    shadows = []
    monkeypatch.setattr(gate_module.SpeculationGate, "pick", lambda self, rows, kinds: None)
    monkeypatch.setattr(gate_module.SpeculationGate, "record_shadow", lambda self, rows, tokens, kind=None: shadows.append((kind, tokens)))
    prompt = base + base
    out = generate(model, prompt, merged(), GenerationConfig(max_new_tokens=24, auto_off=True))
    assert out.tokens == generate(model, prompt, None, GenerationConfig(max_new_tokens=24)).tokens
    # (the free part's own kind: the alternative the gate weighs it as)
    assert shadows and all(kind == ("free alone", (True,)) and tokens >= 1 for kind, tokens in shadows), shadows
    assert out.stats.accepted == 0  # nothing was verified


def test_gated_loop_verifies_the_free_part_alone_when_the_gate_picks_it(models, monkeypatch):
    """Guards the free-alone alternative (MergedDrafter.free_alone, SpeculationGate.pick): where prompt
    lookup has a draft the gate is offered it alone next to the whole tree; picked, it is verified without
    a head forward and the output stays plain greedy's; with free_alone=false it is never offered."""
    from selfdraft import gate as gate_module

    model = models["llama"]
    head = make_head(model, scale=20.0)
    base = random_prompt(12, 3)
    prompt = base + base
    ref = generate(model, prompt, None, GenerationConfig(max_new_tokens=24)).tokens
    head_proposals, offered = [], []

    class CountingEagle(EagleDrafter):
        def propose(self, tokens, sampling, generator):
            head_proposals.append(tokens.numel())
            return super().propose(tokens, sampling, generator)

    def pick(self, rows, kinds):  # the free part alone whenever it is offered, else plain
        offered.append(tuple(kinds))
        return 1 if len(kinds) > 1 else None

    monkeypatch.setattr(gate_module.SpeculationGate, "pick", pick)
    cfg = GenerationConfig(max_new_tokens=24, auto_off=True)
    for free_alone in (True, False):
        head_proposals.clear()
        offered.clear()
        drafter = MergedDrafter([CountingEagle(head, depth=2, top_k=2, total_tokens=3), PromptLookupDrafter()], free_alone)
        out = generate(model, prompt, drafter, cfg)
        assert out.tokens == ref, free_alone
        assert not head_proposals  # the head never drafted: free-alone or plain steps only
        if free_alone:
            assert any(k == ((True,), ("free alone", (True,))) for k in offered), offered
            assert out.stats.accepted > 0  # lookup drafts were verified (the prompt repeats)
        else:
            assert offered and all(len(k) == 1 for k in offered), offered
            assert out.stats.accepted == 0
