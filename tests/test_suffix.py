"""Suffix decoding: a table of earlier replies drafts; output stays the target's greedy output."""

from __future__ import annotations

import json

import pytest
from conftest import random_prompt

from selfdraft.drafters import build_drafter, drafter_factory
from selfdraft.drafters.suffix import NgramTable, SuffixDrafter
from selfdraft.generate import GenerationConfig, generate
from selfdraft.sampling import SamplingConfig
from selfdraft.target import load_target

NEW = 32


def test_chain_follows_the_longest_context_while_its_share_holds():
    """Guards the table's lookup: longest context first, most frequent next token, min_prob stop."""
    table = NgramTable(4)
    table.add([1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3, 4, 5])
    assert table.tokens == 15
    # (1, 2) -> 3, (1, 2, 3) -> 4, (1, 2, 3, 4) -> 5 twice against 6 once, then on around the loop
    assert table.chain([9, 1, 2], 5, min_ngram=2, min_prob=0.4) == [3, 4, 5, 1, 2]
    assert table.chain([1, 2, 3, 4], 3, min_ngram=2, min_prob=0.7) == []  # 5 holds 2/3 < 0.7
    assert table.chain([7], 3, min_ngram=1, min_prob=0.0) == []  # unseen context
    assert table.chain([9, 4], 2, min_ngram=2, min_prob=0.0) == []  # (9, 4) unseen, 1-grams not allowed
    assert table.chain([9, 4], 2, min_ngram=1, min_prob=0.0) == [5, 1]
    with pytest.raises(ValueError, match="min_ngram"):
        SuffixDrafter(NgramTable(3), min_ngram=4)


def test_learns_finished_replies_and_equals_plain_greedy(models):
    """Guards learning across requests and exactness: one drafter over several prompts (table only,
    no prompt lookup) gives plain greedy output every time, and a prompt seen before is drafted from
    its earlier reply (most of it accepted)."""
    model = models["llama"]
    drafter = SuffixDrafter(NgramTable(6), lookup=0, num_tokens=4)
    prompts = [random_prompt(12, s) for s in (1, 2, 3)]
    plain = [generate(model, p, None, GenerationConfig(max_new_tokens=NEW)).tokens for p in prompts]
    first = [generate(model, p, drafter, GenerationConfig(max_new_tokens=NEW)) for p in prompts]
    assert [o.tokens for o in first] == plain
    assert first[0].stats.tau == 1.0  # nothing learned yet, no lookup: nothing drafted
    again = generate(model, prompts[0], drafter, GenerationConfig(max_new_tokens=NEW))
    assert again.tokens == plain[0]
    assert again.stats.tau > 2.0, again.stats.tau
    frozen = SuffixDrafter(NgramTable(6), lookup=0, learn=False)
    for p in prompts + prompts[:1]:
        assert generate(model, p, frozen, GenerationConfig(max_new_tokens=NEW)).stats.tau == 1.0
    assert frozen.table.tokens == 0


def test_sampling_with_suffix_drafts_runs_lossless_path(models):
    """Guards T > 0: deterministic suffix drafts go through rejection sampling (q None) and the
    output is the same length and reproducible for a seed."""
    model = models["llama"]
    table = NgramTable(6)
    prompt = random_prompt(12, 5)
    table.add(generate(model, prompt, None, GenerationConfig(max_new_tokens=NEW)).tokens)
    cfg = GenerationConfig(max_new_tokens=NEW, seed=3, sampling=SamplingConfig(temperature=0.7))
    a = generate(model, prompt, SuffixDrafter(table, learn=False), cfg)
    b = generate(model, prompt, SuffixDrafter(table, learn=False), cfg)
    assert a.tokens == b.tokens and len(a.tokens) == NEW


def test_registry_seeds_the_table_from_a_corpus_and_shares_it(tiny_target_dir, tmp_path):
    """Guards `suffix:corpus=FILE`: the assistant replies are tokenized with the target's tokenizer;
    drafters of one factory (the rows of a batch) share one table; a corpus without replies is an error."""
    target = load_target(str(tiny_target_dir))
    corpus = tmp_path / "replies.jsonl"
    corpus.write_text("\n".join(json.dumps({"conversations": [{"from": "human", "value": f"q{i}"},
                                                              {"from": "gpt", "value": "abcabc" * (i + 1)}]})
                                for i in range(3)))
    drafter = build_drafter("suffix", target.model, corpus=str(corpus), num_tokens=5)
    assert drafter.table.tokens == 6 * (1 + 2 + 3)
    ids = target.tokenizer.encode("abc", add_special_tokens=False)
    assert drafter.table.chain(ids, 3) == target.tokenizer.encode("abc", add_special_tokens=False)
    factory = drafter_factory("suffix", target.model, corpus=str(corpus))
    assert factory().table is factory().table
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"conversations": [{"from": "human", "value": "q"}]}))
    with pytest.raises(ValueError, match="no assistant replies|no usable"):
        build_drafter("suffix", target.model, corpus=str(empty))
    with pytest.raises(ValueError, match="bad options"):
        build_drafter("suffix", target.model, bogus=1)
