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


def test_bf16_prompt_lookup_equals_plain_over_a_long_reply():
    """Guards greedy identity in bf16 on the kernels (selfdraft/csrc), not only in fp32: every kernel
    gives a row the same result whatever the rows and keys around it, so a 1,024-token reply drafted
    and verified in chains, and in two-branch trees (a node's ancestors spread among the other
    branch's nodes), equals plain one-token decoding token for token. The attention kernel's softmax
    once took a key's exp and its lane in the sum from its position, and such replies drifted apart
    after a few hundred tokens (3 of 3 questions, docs/perf_log.md)."""
    from selfdraft.kernels import fused_kernel
    from selfdraft.target import load_target

    if fused_kernel() is None:
        pytest.skip("the bf16 kernels need an x86 CPU with AVX2 and a C++ compiler")
    torch.set_num_threads(2)
    target = load_target("smollm2", dtype="bfloat16")
    ids = target.encode_chat(load_prompts("mtbench")[31])
    cfg = GenerationConfig(max_new_tokens=1024)
    with torch.inference_mode():
        ref = generate(target.model, ids, None, cfg).tokens  # no EOS: the whole 1,024 tokens
        for candidates in (1, 2):
            out = generate(target.model, ids, PromptLookupDrafter(max_candidates=candidates), cfg)
            first = next((j for j, (a, b) in enumerate(zip(out.tokens, ref)) if a != b), None)
            assert out.tokens == ref, f"{candidates} candidate(s): first difference at token {first}"
            assert out.stats.accepted > 100, out.stats.accepted
