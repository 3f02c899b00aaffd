"""Prefix cache: a conversation's next turn reuses the KV (and EAGLE features) of the last sequence (fp32)."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, random_prompt
from test_eagle3 import make_head

from selfdraft.adapter import new_cache, tree_forward
from selfdraft.drafters import PromptLookupDrafter, layer_skip_drafter
from selfdraft.drafters.draft_model import DraftModelDrafter
from selfdraft.drafters.eagle import EagleDrafter
from selfdraft.generate import GenerationConfig, generate
from selfdraft.prefix_cache import PrefixCache
from selfdraft.sampling import SamplingConfig
from selfdraft.tree import chain_tree

NEW = 16


def conversation(model, make_drafter, turns: int, prefix_cache: PrefixCache | None, cfg=None):
    """``turns`` user turns of random tokens, each reply fed back: (prompt, output) per turn."""
    cfg = cfg or GenerationConfig(max_new_tokens=NEW)
    history: list[int] = []
    out = []
    for turn in range(turns):
        prompt = history + random_prompt(5 + 3 * turn, 100 + turn)
        drafter = make_drafter(model) if make_drafter is not None else None
        result = generate(model, prompt, drafter, cfg, prefix_cache=prefix_cache)
        out.append((prompt, result))
        history = prompt + result.tokens
    return out


DRAFTERS = {
    "plain": None,
    "prompt_lookup": lambda m: PromptLookupDrafter(max_candidates=2),
    "layer_skip": lambda m: layer_skip_drafter(m, layers=2, gamma=3),
    "eagle3": lambda m: EagleDrafter(make_head(m, scale=3.0), depth=3, top_k=2, total_tokens=6),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_turns_with_a_prefix_cache_equal_turns_without(models, arch, name):
    """Guards the reuse path end to end: same tokens every turn, and the later turns prefill only the new
    user tokens (the shared history, reply included, comes from the cache)."""
    model = models[arch]
    fresh = conversation(model, DRAFTERS[name], 3, None)
    pc = PrefixCache()
    reused = conversation(model, DRAFTERS[name], 3, pc)
    for turn, ((_, a), (_, b)) in enumerate(zip(fresh, reused)):
        assert b.tokens == a.tokens, f"{arch} {name} turn {turn}: {b.tokens} != {a.tokens}"
        want = 0 if turn == 0 else len(fresh[turn - 1][0]) + len(fresh[turn - 1][1].tokens) - 1
        # the last reply's final token was never forwarded: it is prefilled with the new user turn
        assert b.stats.reused_tokens == want, (turn, b.stats.reused_tokens, want)
    last_prompt, last = reused[-1]
    assert pc.tokens == (last_prompt + last.tokens)[: len(pc)] and len(pc) >= len(last_prompt) + len(last.tokens) - 1


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_reused_kv_and_features_equal_a_fresh_prefill(models, arch):
    """Guards the bookkeeping of what is kept: the cache's KV and the hidden states handed to the EAGLE
    drafter line up with the tokens, position for position, as a fresh prefill of the same sequence."""
    model = models[arch]
    seen = []

    class Spy(EagleDrafter):
        def reset(self, step):
            seen.append({i: h.clone() for i, h in step.hidden_states.items()})
            super().reset(step)

    head = make_head(model, scale=3.0)
    pc = PrefixCache()
    turns = conversation(model, lambda m: Spy(head, depth=3, top_k=2, total_tokens=6), 2, pc)
    layers = tuple(Spy(head).hidden_layers)
    # a fresh prefill of the whole second prompt gives the states the second reset received
    reset_states = seen[-1]
    n = reset_states[layers[0]].shape[1]
    assert n == len(turns[1][0]) and turns[1][1].stats.reused_tokens > 0
    tokens = torch.tensor(pc.tokens)
    cache = new_cache(model, len(tokens) + 8)
    fwd = tree_forward(model, cache, tokens[None], chain_tree(len(tokens) - 1), layers, True)
    for i in layers:
        torch.testing.assert_close(reset_states[i], fwd.hidden_states[i][:, :n], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(pc.hidden[i], fwd.hidden_states[i], atol=2e-4, rtol=1e-4)
    for layer in range(len(cache.layers)):
        for kept, ref in zip(pc.cache.key_value(layer), cache.key_value(layer)):
            torch.testing.assert_close(kept, ref, atol=2e-4, rtol=1e-4)


def test_a_diverging_prompt_reuses_only_the_shared_prefix(models):
    """Guards reuse past a difference: an edited earlier turn must be prefilled again from there."""
    model = models["llama"]
    pc = PrefixCache()
    prompt = random_prompt(20, 1)
    generate(model, prompt, None, GenerationConfig(max_new_tokens=NEW), prefix_cache=pc)
    edited = prompt[:7] + [(prompt[7] + 1) % 90 + 3] + prompt[8:] + random_prompt(4, 2)
    out = generate(model, edited, None, GenerationConfig(max_new_tokens=NEW), prefix_cache=pc)
    ref = generate(model, edited, None, GenerationConfig(max_new_tokens=NEW))
    assert out.stats.reused_tokens == 7 and out.tokens == ref.tokens
    # the very same prompt again: all but its last token reused
    again = generate(model, edited, None, GenerationConfig(max_new_tokens=NEW), prefix_cache=pc)
    assert again.stats.reused_tokens == len(edited) - 1 and again.tokens == ref.tokens


def test_another_model_or_drafter_needing_more_states_starts_afresh(models):
    """Guards reuse across what the cache does not belong to: another model's KV, or a drafter reading
    hidden states the last call did not keep, is never used."""
    llama, qwen = models["llama"], models["qwen2"]
    pc = PrefixCache()
    prompt = random_prompt(12, 3)
    generate(llama, prompt, None, GenerationConfig(max_new_tokens=NEW), prefix_cache=pc)
    out = generate(qwen, prompt + [5, 6], None, GenerationConfig(max_new_tokens=NEW), prefix_cache=pc)
    assert out.stats.reused_tokens == 0
    assert out.tokens == generate(qwen, prompt + [5, 6], None, GenerationConfig(max_new_tokens=NEW)).tokens
    # plain decoding kept no hidden states: the EAGLE drafter's turn prefills everything
    head = make_head(qwen, scale=3.0)
    longer = prompt + [5, 6, 7, 8]
    out = generate(qwen, longer, EagleDrafter(head, depth=3, top_k=2, total_tokens=6),
                   GenerationConfig(max_new_tokens=NEW), prefix_cache=pc)
    assert out.stats.reused_tokens == 0
    assert out.tokens == generate(qwen, longer, None, GenerationConfig(max_new_tokens=NEW)).tokens


def test_a_failed_generation_leaves_the_prefix_cache_empty(models):
    """Guards against KV that no longer matches its tokens: a generation that raises midway must not
    leave its half-updated cache for the next call."""
    model = models["llama"]
    pc = PrefixCache()
    prompt = random_prompt(12, 4)
    generate(model, prompt, None, GenerationConfig(max_new_tokens=NEW), prefix_cache=pc)
    assert len(pc) > 0

    class Boom(PromptLookupDrafter):
        def propose(self, tokens, sampling, generator):
            if tokens.numel() > len(prompt) + 3:
                raise RuntimeError("drafter failed")
            return super().propose(tokens, sampling, generator)

    longer = prompt + [7, 8, 9]
    with pytest.raises(RuntimeError, match="drafter failed"):
        generate(model, longer, Boom(), GenerationConfig(max_new_tokens=NEW), prefix_cache=pc)
    assert len(pc) == 0 and pc.cache is None
    out = generate(model, longer, None, GenerationConfig(max_new_tokens=NEW), prefix_cache=pc)
    assert out.stats.reused_tokens == 0
    assert out.tokens == generate(model, longer, None, GenerationConfig(max_new_tokens=NEW)).tokens


def test_sampling_with_a_prefix_cache_draws_the_same_tokens(models):
    """Guards sampled turns: with one seed, a turn after a reused prefix draws what a fresh one draws."""
    model = models["llama"]
    cfg = GenerationConfig(max_new_tokens=NEW, sampling=SamplingConfig(temperature=1.0), seed=7)
    fresh = conversation(model, DRAFTERS["prompt_lookup"], 2, None, cfg)
    reused = conversation(model, DRAFTERS["prompt_lookup"], 2, PrefixCache(), cfg)
    assert [r.tokens for _, r in reused] == [r.tokens for _, r in fresh]
    assert reused[1][1].stats.reused_tokens > 0


def test_draft_model_keeps_its_cache_across_prompts(models):
    """Guards the draft model's own reuse: a prompt extending the last sequence feeds only its new tokens."""
    model = models["llama"]
    fed: list[int] = []

    class Spy(DraftModelDrafter):
        def _feed(self, tokens, greedy):
            fed.append(len(tokens))
            return super()._feed(tokens, greedy)

    drafter = Spy(layer_skip_drafter(model, layers=2).model, gamma=3)
    prompt = random_prompt(30, 5)
    first = generate(model, prompt, drafter, GenerationConfig(max_new_tokens=NEW))
    fed.clear()
    longer = prompt + first.tokens + random_prompt(3, 6)
    out = generate(model, longer, drafter, GenerationConfig(max_new_tokens=NEW))
    assert fed[0] < 8, f"the draft model was prefilled again: first feed of {fed[0]} tokens"
    assert out.tokens == generate(model, longer, None, GenerationConfig(max_new_tokens=NEW)).tokens
