"""Suffix decoding: a table of earlier replies drafts; output stays the target's greedy output."""

from __future__ import annotations

import json

import pytest
import torch
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


def test_bounded_table_holds_exactly_the_most_recent_additions():
    """Guards max_tokens: past the bound the oldest additions (whole sequences or a reply's increments)
    are subtracted, and what is left counts exactly what a table of the remaining additions counts."""
    g = torch.Generator().manual_seed(0)
    additions = []
    for _ in range(12):
        seq = torch.randint(0, 5, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        additions.append((seq, int(torch.randint(0, 3, (1,), generator=g))))
    table = NgramTable(3, max_tokens=20)
    for k, (seq, start) in enumerate(additions):
        table.add(seq, start)
        kept, size = [], 0
        for seq_, start_ in reversed(additions[: k + 1]):  # newest first, while the bound holds
            if kept and size + len(seq_) - start_ > 20:
                break
            kept.insert(0, (seq_, start_))
            size += len(seq_) - start_
        want = NgramTable(3)
        for seq_, start_ in kept:
            want.add(seq_, start_)
        assert table.tokens == want.tokens and table._next == want._next, k
        for ctx, (best, count, total) in table._best.items():
            counts = want._next[ctx]
            assert count == counts[best] == max(counts.values()) and total == sum(counts.values()), (k, ctx)
    assert table.tokens <= 20 and len(table._next) == len(table._best)


def test_learns_replies_as_committed_and_equals_plain_greedy(models):
    """Guards learning and exactness: one drafter over several prompts (table only, no prompt lookup)
    gives plain greedy output every time, the table holds exactly the replies' tokens (pairs counted
    once, as they are committed), and a prompt seen before is drafted from its earlier reply (most of
    it accepted), by the same drafter or a fresh one sharing the table."""
    model = models["llama"]
    drafter = SuffixDrafter(NgramTable(6), lookup=0, num_tokens=4)
    prompts = [random_prompt(12, s) for s in (1, 2, 3)]
    plain = [generate(model, p, None, GenerationConfig(max_new_tokens=NEW)).tokens for p in prompts]
    first = [generate(model, p, drafter, GenerationConfig(max_new_tokens=NEW)) for p in prompts]
    assert [o.tokens for o in first] == plain
    table = drafter.table  # the replies but the last step of each (generation ends without an update)
    assert 3 * (NEW - 5) <= table.tokens <= 3 * NEW, table.tokens
    full = NgramTable(6)
    for reply in plain:
        full.add(reply)
    pairs = sum(sum(c.values()) for ctx, c in table._next.items() if len(ctx) == 1)
    assert pairs == table.tokens - 3  # each pair counted once: n - 1 per reply
    assert all(n <= full._next[ctx][t] for ctx, c in table._next.items() for t, n in c.items())
    again = generate(model, prompts[0], drafter, GenerationConfig(max_new_tokens=NEW))
    assert again.tokens == plain[0]
    assert again.stats.tau > 2.0, again.stats.tau
    fresh = generate(model, prompts[1], SuffixDrafter(drafter.table, lookup=0, num_tokens=4), GenerationConfig(max_new_tokens=NEW))
    assert fresh.tokens == plain[1] and fresh.stats.tau > 2.0, fresh.stats.tau
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


def test_head_spec_with_suffix_merges_a_shared_table_and_equals_plain_greedy(tiny_target_dir, tmp_path):
    """Guards head:path=DIR,lookup=N,suffix=FILE|true: the head is merged with a suffix drafter (the
    corpus seeds its table, the factory's drafters share it, its lookup drafts N tokens); the merged
    drafter gives plain greedy output and drafts a prompt seen before from its earlier reply."""
    from test_eagle3 import make_head

    from selfdraft.drafters import MergedDrafter
    from selfdraft.drafters.eagle import EagleDrafter
    from selfdraft.heads import save

    target = load_target(str(tiny_target_dir))
    model = target.model
    head = make_head(model, scale=20.0)
    save(tmp_path / "head", "eagle3", head.cfg, head, model, "tiny-llama")
    corpus = tmp_path / "replies.jsonl"
    corpus.write_text(json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "abcabc"}]}))
    tree = dict(depth=2, top_k=2, total_tokens=3)
    factory = drafter_factory("head", model, path=str(tmp_path / "head"), lookup=4, suffix=str(corpus), **tree)
    drafter = factory()
    assert isinstance(drafter, MergedDrafter) and isinstance(drafter.drafters[0], EagleDrafter)
    member = drafter.drafters[1]
    assert isinstance(member, SuffixDrafter) and member._lookup.num_tokens == 4 and member.table.tokens == 6
    assert factory().drafters[1].table is member.table

    factory = drafter_factory("head", model, path=str(tmp_path / "head"), suffix=True, **tree)
    drafter = factory()
    assert drafter.drafters[1].table.tokens == 0 and drafter.drafters[1]._lookup is None  # lookup=0: the table only
    prompt = random_prompt(12, 7)
    plain = generate(model, prompt, None, GenerationConfig(max_new_tokens=NEW)).tokens
    alone = generate(model, prompt, EagleDrafter(head, **tree), GenerationConfig(max_new_tokens=NEW))
    first = generate(model, prompt, drafter, GenerationConfig(max_new_tokens=NEW))
    again = generate(model, prompt, factory(), GenerationConfig(max_new_tokens=NEW))  # a new row, the same table
    assert first.tokens == plain and again.tokens == plain
    assert again.stats.accepted > alone.stats.accepted + NEW // 2, (alone.stats.accepted, again.stats.accepted)
    with pytest.raises(ValueError, match="suffix must be"):
        drafter_factory("head", model, path=str(tmp_path / "head"), suffix=3)
    with pytest.raises(ValueError, match="deterministic"):
        drafter_factory("head", model, path=str(tmp_path / "head"), suffix=True, sample=True)
