"""Prompt lookup: the adaptive draft length grows after drafts the target commits whole, shrinks after
drafts it leaves and holds where a step cannot tell; continuations that reach the end of the sequence
repeat their loop."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompt, tiny_model

from selfdraft.drafters.base import StepResult
from selfdraft.drafters.prompt_lookup import PromptLookupDrafter, adapt_length, find_continuations
from selfdraft.generate import GenerationConfig, generate
from selfdraft.sampling import SamplingConfig

GREEDY = SamplingConfig(temperature=0.0)


def test_adapt_length_rules():
    assert adapt_length(4, [[1, 2, 3, 4]], [1, 2, 3, 4, 9], 2, 16) == 6  # committed whole at full length
    assert adapt_length(15, [[1, 2, 3, 4]], [1, 2, 3, 4], 2, 16) == 15  # shorter than the length: no signal
    assert adapt_length(16, [list(range(16))], list(range(17)), 2, 16) == 16  # capped
    assert adapt_length(4, [[1, 2, 3, 4]], [1, 2, 7], 2, 16) == 3  # left at the third token
    assert adapt_length(2, [[1, 2]], [5], 2, 16) == 2  # floored
    assert adapt_length(4, [[1, 2, 3, 4]], [1], 2, 16) == 4  # a plain step that agreed: cannot tell
    assert adapt_length(4, [[1, 2, 3, 4]], [], 2, 16) == 4
    assert adapt_length(4, [[1, 2, 3, 4], [1, 2, 9]], [1, 2, 7], 2, 16) == 3  # every candidate left
    assert adapt_length(4, [[1, 2, 3, 4], [5, 6]], [5, 6, 7], 2, 16) == 4  # one candidate committed whole, short


def step(tokens: list[int]) -> StepResult:
    return StepResult(torch.tensor(tokens), 0)


def test_drafter_length_follows_what_the_target_commits():
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    drafter = PromptLookupDrafter(num_tokens=3)
    drafter.reset(step(seq))
    assert drafter.propose(torch.tensor(seq), GREEDY, None).tokens.tolist() == [2, 3, 4, 5]
    seq += [3, 4, 5, 6]  # the three drafted tokens and one more
    drafter.update(step(seq))
    assert drafter.num_tokens == 5
    assert drafter.propose(torch.tensor(seq), GREEDY, None).tokens.tolist() == [6, 7, 8, 1, 2, 3]
    seq += [9]  # left at the first token
    drafter.update(step(seq))
    assert drafter.num_tokens == 4
    drafter.propose(torch.tensor(seq), GREEDY, None)  # no match for (..., 6, 9): nothing to score
    seq += [1]
    drafter.update(step(seq))
    assert drafter.num_tokens == 4
    drafter.reset(step(seq))
    assert drafter.num_tokens == 3

    fixed = PromptLookupDrafter(num_tokens=3, adaptive=False)
    fixed.reset(step(seq[:10]))
    fixed.propose(torch.tensor(seq[:10]), GREEDY, None)
    fixed.update(step(seq[:14]))
    assert fixed.num_tokens == 3


def test_adaptive_lookup_equals_plain_greedy_and_adapts():
    model = tiny_model("llama")
    prompt = random_prompt(12, 0) * 4
    cfg = GenerationConfig(max_new_tokens=40)
    plain = generate(model, prompt, None, cfg)
    lengths = []

    class Recording(PromptLookupDrafter):
        def update(self, s):
            super().update(s)
            lengths.append(self.num_tokens)

    out = generate(model, prompt, Recording(num_tokens=4, max_tokens=12), cfg)
    assert out.tokens == plain.tokens
    assert len(set(lengths)) > 1  # the length moved


@pytest.mark.parametrize("options", [dict(num_tokens=4, min_tokens=5), dict(num_tokens=8, max_tokens=6), dict(num_tokens=2, min_tokens=0)])
def test_bad_adaptive_bounds_are_errors(options):
    with pytest.raises(ValueError, match="adaptive=false"):
        PromptLookupDrafter(**options)
    PromptLookupDrafter(adaptive=False, **options)  # a fixed length ignores the bounds


def test_periodic_continuation_repeats_a_loop_up_to_the_length():
    seq = torch.tensor([5, 1, 2, 1, 2, 1, 2])
    assert find_continuations(seq, 3, 5, 1) == [[1, 2]]  # the most recent match reaches the end
    assert find_continuations(seq, 3, 5, 1, periodic=True) == [[1, 2, 1, 2, 1]]
    seq = torch.tensor([7, 8, 9, 3, 7, 8, 9, 4, 6, 7, 8, 9])
    assert find_continuations(seq, 3, 2, 2, periodic=True) == [[4, 6], [3, 7]]  # long enough: unchanged
    assert find_continuations(seq, 3, 6, 2, periodic=True) == [[4, 6, 7, 8, 9, 4], [3, 7, 8, 9, 4, 6]]
    drafter = PromptLookupDrafter(num_tokens=6)
    assert drafter.propose(torch.tensor([3, 4, 5, 4, 5]), GREEDY, None).tokens.tolist() == [5, 4, 5, 4, 5, 4, 5]
    fixed = PromptLookupDrafter(num_tokens=6, periodic=False)
    assert fixed.propose(torch.tensor([3, 4, 5, 4, 5]), GREEDY, None).tokens.tolist() == [5, 4, 5]
