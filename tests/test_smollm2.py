"""Real-model checks on the embedded default target (slow: loads SmolLM2-135M)."""

from __future__ import annotations

import pytest
import torch

from selfdraft.benchmark import load_prompts
from selfdraft.drafters import DraftModelDrafter, PromptLookupDrafter, layer_skip_drafter
from selfdraft.generate import GenerationConfig, generate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from selfdraft.target import load_target

    return load_target("smollm2", dtype="float32")


def test_training_free_drafters_equal_plain_greedy_on_smollm2(smollm2):
    """Guards exactness on a real 30-layer GQA model: every drafter reproduces plain greedy (fp32)."""
    torch.set_num_threads(2)
    model = smollm2.model
    prompts = load_prompts("mtbench", 10)
    drafters = {
        "prompt_lookup": lambda: PromptLookupDrafter(max_candidates=2),
        "layer_skip": lambda: layer_skip_drafter(model, layers=20, gamma=3),
        # no smaller SmolLM2 ships here: the target's own first 24 layers serve as a separate draft model
        "draft_model": lambda: DraftModelDrafter(layer_skip_drafter(model, layers=24).model, gamma=3),
    }
    cfg = GenerationConfig(max_new_tokens=48)
    accepted = {}
    for i, text in enumerate(prompts):
        ids = smollm2.encode_chat(text)
        ref = generate(model, ids, None, cfg, eos_token_ids=smollm2.eos_token_ids).tokens
        for name, make in drafters.items():
            out = generate(model, ids, make(), cfg, eos_token_ids=smollm2.eos_token_ids)
            assert out.tokens == ref, f"prompt {i}, {name}: first diff at {next(j for j, (a, b) in enumerate(zip(out.tokens, ref)) if a != b)}"
            accepted[name] = accepted.get(name, 0) + out.stats.accepted
    assert all(v > 0 for v in accepted.values()), accepted


def test_gemma3_270m_prompt_lookup_and_layer_skip_equal_plain():
    """Guards exactness on the second real architecture (Gemma-3: sliding windows, 262k vocabulary)."""
    from selfdraft.target import load_target

    torch.set_num_threads(2)
    target = load_target("gemma3-270m", dtype="float32")
    cfg = GenerationConfig(max_new_tokens=32)
    for text in load_prompts("mtbench", 3):
        ids = target.encode_chat(text)
        ref = generate(target.model, ids, None, cfg, eos_token_ids=target.eos_token_ids).tokens
        for drafter in (PromptLookupDrafter(), layer_skip_drafter(target.model, layers=12, gamma=3)):
            out = generate(target.model, ids, drafter, cfg, eos_token_ids=target.eos_token_ids)
            assert out.tokens == ref, f"{type(drafter).__name__} diverged on gemma3-270m"
