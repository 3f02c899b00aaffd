"""Continuous batching: every row equals its prompt decoded alone (greedy, fp32) or follows p (sampling)."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, random_prompt, tiny_model
from helpers import ScriptedDrafter, log_proposals
from test_sampling import chi2_pvalue, exact_third_token

from selfdraft.adapter import new_cache, ragged_tree_forward, tree_forward
from selfdraft.batch import (
    SpeculationGate,
    TreePolicy,
    draft_budget,
    generate_batch,
    limit_nodes,
    prefill_groups,
)
from selfdraft.cache import RaggedCache
from selfdraft.drafters import PromptLookupDrafter, layer_skip_drafter
from selfdraft.drafters.base import Draft, StepResult
from selfdraft.generate import GenerationConfig, generate
from selfdraft.sampling import SamplingConfig, logits_to_probs
from selfdraft.tree import chain_tree, tree_from_parents

NEW = 12
BATCH_ARCHS = ("llama", "gemma3", "qwen3")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run 10-50x faster on one thread when the 2 cores are shared (OpenMP spin contention)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def mixed_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Short and long prompts (1..60 tokens), some with repeats so prompt lookup finds matches."""
    out = []
    for i in range(count):
        base = random_prompt(1 + (i * 23 + seed) % 60, seed * 100 + i)
        out.append(base + base[: i % 6] if i % 2 == 0 else base)
    return out


def plain(model, prompt, n=NEW, eos=()) -> list[int]:
    return generate(model, prompt, None, GenerationConfig(max_new_tokens=n), eos_token_ids=eos).tokens


class ReferenceScripted:
    """A ScriptedDrafter that finds its prompt's reference continuation at reset (factories take no args)."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, references: list[list[int]], mode: str, depth: int = 4):
        self.references, self.mode, self.depth = references, mode, depth
        self.inner: ScriptedDrafter | None = None

    def reset(self, step: StepResult) -> None:
        seq = step.tokens.tolist()
        ref = max((r for r in self.references if r[: len(seq)] == seq), key=len)
        self.inner = ScriptedDrafter(ref, self.mode, VOCAB, depth=self.depth, seed=len(seq))

    def propose(self, tokens, sampling, generator) -> Draft:
        return self.inner.propose(tokens, sampling, generator)

    def update(self, step: StepResult) -> None:
        pass


def factories(model, references):
    return {
        "plain": None,
        "prompt_lookup": lambda: PromptLookupDrafter(max_candidates=3, min_ngram=1),
        "oracle": lambda: ReferenceScripted(references, "oracle"),
        "partial": lambda: ReferenceScripted(references, "partial"),
        "layer_skip": lambda: layer_skip_drafter(model, layers=2, gamma=3),
    }


def ragged_prefill(model, prompts: list[list[int]], max_len: int = 64) -> RaggedCache:
    """A ragged cache holding each prompt's KV in its own row, prefilled in one right-padded forward."""
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    tokens = torch.tensor([p + [3] * (width - len(p)) for p in prompts])
    cache = RaggedCache(4, len(prompts), max_len)
    ragged_tree_forward(model, cache, tokens, [chain_tree(n - 1) for n in lengths])
    cache.compact(torch.zeros(len(prompts), dtype=torch.long), torch.arange(width).repeat(len(prompts), 1),
                  torch.tensor(lengths))
    return cache


def check_rows(results, prompts, refs, label, indices=None):
    want_order = list(range(len(prompts))) if indices is None else indices
    assert [r.index for r in results] == want_order, f"{label}: results out of order"
    for r, prompt, ref in zip(results, prompts, refs):
        assert r.ok, f"{label} row {r.index}: unexpected error {r.error}"
        assert r.tokens == ref, f"{label} row {r.index} (prompt len {len(prompt)}): {r.tokens} != {ref}"
        assert len(r.sources) == len(r.tokens) and r.stats.new_tokens == len(r.tokens)


@pytest.mark.parametrize("arch", BATCH_ARCHS)
def test_ragged_forward_equals_per_row_tree_forward(models, arch):
    """Guards the per-row mask, positions and cache slots: ragged prefill + tree logits equal batch-1 logits."""
    model = models[arch]
    prompts = [random_prompt(n, 40 + n) for n in (3, 17, 9)]
    trees = [tree_from_parents(p) for p in ([-1, 0, 0, 1, 2, 2], [-1], [-1, 0, 1, 2])]
    width = max(t.size for t in trees)
    tokens = torch.randint(3, VOCAB, (len(prompts), width), generator=torch.Generator().manual_seed(1))
    want = []
    with torch.no_grad():
        cache = ragged_prefill(model, prompts)
        for b, (prompt, tree) in enumerate(zip(prompts, trees)):
            own = new_cache(model, 64)
            tree_forward(model, own, torch.tensor([prompt]), chain_tree(len(prompt) - 1))
            want.append(tree_forward(model, own, tokens[b : b + 1, : tree.size], tree).logits[0])
        got = ragged_tree_forward(model, cache, tokens, trees).logits
    for b, tree in enumerate(trees):
        err = (got[b, : tree.size] - want[b]).abs().max().item()
        assert err < 1e-4, f"{arch} row {b}: ragged logits differ from batch-1 by {err:.2e}"


def test_ragged_compaction_keeps_each_rows_path(models):
    """Guards per-row compaction: after accepting different paths per row, the next step's logits are exact."""
    model = models["llama"]
    prompts = [random_prompt(5, 1), random_prompt(11, 2)]
    tree = tree_from_parents([-1, 0, 0, 1, 2, 3])
    tokens = torch.randint(3, VOCAB, (2, tree.size), generator=torch.Generator().manual_seed(3))
    paths = [torch.tensor([0, 2, 4]), torch.tensor([0, 1, 3, 5])]
    with torch.no_grad():
        cache = ragged_prefill(model, prompts)
        starts = cache.lengths.clone()
        ragged_tree_forward(model, cache, tokens, [tree, tree])
        keep = torch.tensor([[0, 2, 4, 0], [0, 1, 3, 5]])
        cache.compact(starts, keep, torch.tensor([3, 4]))
        nxt = torch.tensor([[7], [9]])
        got = ragged_tree_forward(model, cache, nxt, [chain_tree(0)] * 2).logits[:, 0]
        for b, prompt in enumerate(prompts):
            seq = prompt + tokens[b, paths[b]].tolist() + [int(nxt[b])]
            want = model(input_ids=torch.tensor([seq])).logits[0, -1]
            err = (got[b] - want).abs().max().item()
            assert err < 1e-4, f"row {b}: logits after compaction differ by {err:.2e}"
            assert int(cache.lengths[b]) == len(seq), f"row {b}: length {int(cache.lengths[b])} != {len(seq)}"


@pytest.mark.parametrize("arch", BATCH_ARCHS)
def test_rows_equal_plain_greedy(models, arch):
    """Guards the whole batched path (ragged masks, per-row acceptance/compaction, refill) against drift."""
    model = models[arch]
    prompts = mixed_prompts(5, seed=BATCH_ARCHS.index(arch))
    refs = [plain(model, p) for p in prompts]
    references = [p + r for p, r in zip(prompts, refs)]
    taus = {}
    for name, make in factories(model, references).items():
        for batch_size in (1, 2, 3):
            results = generate_batch(model, prompts, make, GenerationConfig(max_new_tokens=NEW), batch_size=batch_size)
            check_rows(results, prompts, refs, f"{arch} {name} batch {batch_size}")
            taus.setdefault(name, []).extend(r.stats.tau for r in results)
    mean = {k: round(sum(v) / len(v), 2) for k, v in taus.items()}
    assert mean["oracle"] > 2.5 and mean["plain"] == 1.0, f"drafts must be accepted where they are right: {mean}"


class Recording:
    """Wraps a drafter and records its draft tokens by committed sequence."""

    def __init__(self, inner, log: dict):
        self.inner, self.log = inner, log
        self.hidden_layers = inner.hidden_layers

    def reset(self, step: StepResult) -> None:
        self.inner.reset(step)

    def propose(self, tokens, sampling, generator) -> Draft:
        draft = self.inner.propose(tokens, sampling, generator)
        self.log[tuple(tokens.tolist())] = draft.tokens.tolist()
        return draft

    def update(self, step: StepResult) -> None:
        self.inner.update(step)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_eagle_rows_draft_as_they_would_alone(models, arch):
    """Guards per-row target features for heads: wrong rows/positions of hidden states change the drafts."""
    from test_eagle3 import make_head

    from selfdraft.drafters.eagle import EagleDrafter

    model = models[arch]
    head = make_head(model, scale=20.0)
    prompts = mixed_prompts(5, seed=6)
    cfg = GenerationConfig(max_new_tokens=NEW)
    alone: dict = {}
    refs = [generate(model, p, Recording(EagleDrafter(head, depth=3, top_k=3, total_tokens=8), alone), cfg).tokens
            for p in prompts]
    batched: dict = {}
    results = generate_batch(model, prompts, lambda: Recording(EagleDrafter(head, depth=3, top_k=3, total_tokens=8),
                                                               batched),
                             cfg, batch_size=3, policy=TreePolicy(max_step_tokens=None))
    check_rows(results, prompts, refs, f"{arch} eagle")
    assert len(alone) > 20 and batched.keys() == alone.keys()
    diff = [k for k in alone if alone[k] != batched[k]]
    assert not diff, f"{len(diff)} of {len(alone)} drafts differ from the batch-1 drafts"


def test_early_eos_and_max_new_tokens_edges(models):
    """Guards per-row stopping (EOS inside an accepted run, budgets 0/1/2) and streaming past a stop."""
    model = models["llama"]
    prompts = mixed_prompts(7, seed=5)
    long_refs = [plain(model, p, n=20) for p in prompts]
    references = [p + r for p, r in zip(prompts, long_refs)]
    eos = long_refs[0][3]  # row 0 stops at its 4th token, others wherever this token shows up (or not)
    refs = [plain(model, p, n=20, eos=[eos]) for p in prompts]
    assert len(refs[0]) == long_refs[0].index(eos) + 1
    make = lambda: ReferenceScripted(references, "oracle", depth=6)  # noqa: E731
    streamed: dict[int, list[int]] = {}
    results = generate_batch(model, prompts, make, GenerationConfig(max_new_tokens=20), eos_token_ids=[eos],
                             batch_size=3, on_tokens=lambda i, toks, _: streamed.setdefault(i, []).extend(toks))
    check_rows(results, prompts, refs, "eos")
    assert [streamed[i] for i in range(len(prompts))] == refs, "streamed tokens must be exactly the results"
    assert results[0].stop_reason == "eos"
    for n in (0, 1, 2):
        results = generate_batch(model, prompts, make, GenerationConfig(max_new_tokens=n), batch_size=2)
        check_rows(results, prompts, [r[:n] for r in long_refs], f"max_new_tokens={n}")
        assert all(r.stop_reason == "max_new_tokens" for r in results)


def test_row_over_context_limit_is_reported(models):
    """Guards against one bad request killing the batch: its error comes back, the others complete."""
    model = models["gemma3"]
    prompts = mixed_prompts(4, seed=2)
    prompts.insert(1, random_prompt(250, 9))  # 250 + 12 > 256 positions
    prompts.insert(3, [])
    results = generate_batch(model, prompts, lambda: PromptLookupDrafter(), GenerationConfig(max_new_tokens=NEW),
                             batch_size=2)
    assert results[1].stop_reason == "error" and "exceeds the target's context" in results[1].error
    assert results[3].stop_reason == "error" and "empty" in results[3].error
    good = [i for i in range(len(prompts)) if i not in (1, 3)]
    check_rows([results[i] for i in good], [prompts[i] for i in good],
               [plain(model, prompts[i]) for i in good], "context", good)


class FailingDrafter(PromptLookupDrafter):
    """Raises on its third proposal for sequences starting with ``poison`` (a drafter bug on one request)."""

    def __init__(self, poison: list[int]):
        super().__init__()
        self.poison, self.calls = poison, 0

    def reset(self, step: StepResult) -> None:
        self.calls = 0

    def propose(self, tokens, sampling, generator) -> Draft:
        self.calls += 1
        if self.calls == 3 and tokens[: len(self.poison)].tolist() == self.poison:
            raise IndexError("draft table out of range")
        return super().propose(tokens, sampling, generator)


def test_drafter_failure_fails_only_its_row(models):
    """Guards against one request's drafter exception losing the other rows (or their exactness)."""
    model = models["qwen3"]
    prompts = mixed_prompts(5, seed=4)
    refs = [plain(model, p) for p in prompts]
    results = generate_batch(model, prompts, lambda: FailingDrafter(prompts[1]), GenerationConfig(max_new_tokens=NEW),
                             batch_size=2)
    bad = results[1]
    assert bad.stop_reason == "error" and "IndexError: draft table out of range" in bad.error, bad
    assert bad.tokens == refs[1][: len(bad.tokens)] and len(bad.tokens) < NEW, bad.tokens
    good = [0, 2, 3, 4]
    check_rows([results[i] for i in good], [prompts[i] for i in good], [refs[i] for i in good], "drafter failure",
               good)


def test_stop_strings_per_row(models):
    """Guards per-row stop strings: a row stops at its own stop string, the others run to their budget."""

    class CharTokenizer:
        def decode(self, ids):
            return "".join(chr(97 + i % 26) for i in ids)

    model = models["llama"]
    prompts = mixed_prompts(4, seed=7)
    tok = CharTokenizer()
    full = [plain(model, p, n=20) for p in prompts]
    stop = tok.decode(full[2][6:8])
    refs = [generate(model, p, None, GenerationConfig(max_new_tokens=20, stop_strings=(stop,)), tokenizer=tok).tokens
            for p in prompts]
    results = generate_batch(model, prompts, lambda: PromptLookupDrafter(),
                             GenerationConfig(max_new_tokens=20, stop_strings=(stop,)), tokenizer=tok, batch_size=3)
    check_rows(results, prompts, refs, "stop strings")
    assert results[2].stop_reason == "stop_string"


def test_tree_policy_shrinks_trees_and_can_switch_off(models):
    """Guards the batch-size policy (budgets shrink, trimmed/off drafting stays exact) and prefill grouping."""
    assert draft_budget(1, TreePolicy(max_step_tokens=64)) == 63
    assert draft_budget(8, TreePolicy(max_step_tokens=64)) == 7
    assert draft_budget(64, TreePolicy(max_step_tokens=64)) == 0
    assert draft_budget(2, TreePolicy(max_step_tokens=None, max_draft_per_row=5)) == 5
    assert draft_budget(4, TreePolicy(speculate_up_to=3)) == 0
    assert draft_budget(3, TreePolicy(max_step_tokens=None)) is None
    assert prefill_groups([10, 100, 90, 12, 80]) == [[1, 2, 4], [3, 0]]
    assert prefill_groups([5, 5, 5]) == [[0, 1, 2]]
    tree = tree_from_parents([-1, 0, 1, 0, 3, 2])
    small = limit_nodes(Draft(tree, torch.arange(6)), 3)
    assert small.tokens.tolist() == [0, 1, 2, 3] and small.tree.parents.tolist() == [-1, 0, 1, 0]

    model = models["llama"]
    prompts = mixed_prompts(4, seed=3)
    refs = [plain(model, p) for p in prompts]
    references = [p + r for p, r in zip(prompts, refs)]
    make = lambda: ReferenceScripted(references, "oracle", depth=5)  # noqa: E731
    cfg = GenerationConfig(max_new_tokens=NEW)
    trimmed = generate_batch(model, prompts, make, cfg, batch_size=2,
                             policy=TreePolicy(max_step_tokens=None, max_draft_per_row=1))
    check_rows(trimmed, prompts, refs, "trimmed")
    lengths = [n for r in trimmed for n in r.stats.accept_lengths]
    assert max(lengths) == 2, f"one draft node per row: accept lengths {lengths}"
    off = generate_batch(model, prompts, make, cfg, batch_size=2, policy=TreePolicy(speculate_up_to=0))
    check_rows(off, prompts, refs, "off")
    assert all(r.stats.tau == 1.0 for r in off), "speculation must be off"


class UniformTreeDrafter:
    """A stochastic, model-free drafter: two root children drawn without replacement from a uniform q,
    one child under each; q is returned, so the rows exercise the residual rule with siblings."""

    hidden_layers: tuple[int, ...] = ()

    def reset(self, step: StepResult) -> None:
        pass

    def propose(self, tokens, sampling, generator) -> Draft:
        q = torch.full((VOCAB,), 1.0 / VOCAB)
        first = torch.multinomial(q, 2, replacement=False, generator=generator).tolist()
        second = torch.multinomial(q, 2, replacement=True, generator=generator).tolist()
        tree = tree_from_parents([-1, 0, 0, 1, 2])
        node_q = torch.stack([q, q, q, torch.zeros(VOCAB), torch.zeros(VOCAB)])
        return Draft(tree, torch.tensor([int(tokens[-1])] + first + second), node_q)

    def update(self, step: StepResult) -> None:
        pass


def drive_gate(gate, steps, outcome, rows=1):
    """Run ``steps`` gate decisions; ``outcome(step, speculative)`` -> (tokens, seconds) or None for a
    speculative step whose drafter proposed nothing (recorded as plain). Returns the decisions."""
    decisions = []
    for step in range(steps):
        spec = gate.speculate(rows)
        decisions.append(spec)
        result = outcome(step, spec)
        if result is None:
            gate.record(rows, False, rows, 1.0)
        else:
            gate.record(rows, spec, *result)
    return decisions


def test_speculation_gate_measures_both_modes_and_keeps_the_faster():
    """Guards the auto switch-off: it must measure both modes, then run the faster one, re-measuring
    plain steps while drafting wins."""
    gate = SpeculationGate(probe_every=8)
    for _ in range(2):  # nothing measured: try speculation first
        assert gate.speculate(2) is True
        gate.record(2, True, tokens=6, seconds=1.0)
    assert [gate.speculate(2), gate.speculate(2)] == [False, False]  # then measure plain steps
    gate.record(2, False, tokens=2, seconds=1.0)
    gate.record(2, False, tokens=2, seconds=1.0)
    decisions = drive_gate(gate, 30, lambda step, spec: (6 if spec else 2, 1.0), rows=2)
    plain_at = [i for i, d in enumerate(decisions) if not d]
    assert plain_at and all(b - a == 8 for a, b in zip(plain_at, plain_at[1:])), f"plain re-measured every 8th: {decisions}"
    assert gate.speeds()[2] == pytest.approx((6.0, 2.0)), gate.speeds()
    # drafting becomes useless (everything rejected, a step costs 3x): the gate switches to plain
    decisions = drive_gate(gate, 200, lambda step, spec: (2, 3.0) if spec else (2, 1.0), rows=2)
    assert sum(decisions[-100:]) <= 3, f"a losing drafter keeps drafting: {sum(decisions[-100:])} of 100 steps"
    assert gate.speculate(5) is True  # another batch size is measured on its own


def test_speculation_gate_keeps_a_noisy_drafter_that_pays_on_average():
    """Guards against switching off on a run of rejections: a drafter committing 1.5 tokens a step on
    average at 1.15x a plain step's cost pays (1.30x), even though most of its steps commit one token
    and they come in runs. The old gate (5-step moving averages) drafted on a minority of such steps."""
    pattern = [1, 1, 1, 1, 1, 1, 3, 2, 2, 2]  # mean 1.5, six rejections in a row

    def outcome(step, spec):
        return (pattern[step % len(pattern)], 1.15) if spec else (1, 1.0)

    decisions = drive_gate(SpeculationGate(), 400, outcome)
    assert sum(decisions) / len(decisions) > 0.9, f"drafted on {sum(decisions)} of {len(decisions)} steps"


def test_speculation_gate_probes_a_losing_drafter_rarely_and_picks_it_up_when_it_improves():
    """Guards probing: a drafter that loses is re-measured now and then (less often the more it loses),
    and once it starts to win the gate switches back to it within a few dozen steps."""
    def losing(ratio):
        return lambda step, spec: (1, ratio) if spec else (1, 1.0)

    narrow = sum(drive_gate(SpeculationGate(), 1000, losing(1.2)))
    wide = sum(drive_gate(SpeculationGate(), 1000, losing(3.0)))
    assert 10 < narrow < 250 and wide < narrow / 2, f"probes: {narrow} at 1.2x cost, {wide} at 3x"
    gate = SpeculationGate()
    drive_gate(gate, 300, losing(1.5))
    # the drafter now accepts 3 tokens a step: 4 tokens for 1.5 plain steps' time
    decisions = drive_gate(gate, 200, lambda step, spec: (4, 1.5) if spec else (1, 1.0))
    first = decisions.index(True)
    assert first < 60 and sum(decisions[first:]) / len(decisions[first:]) > 0.9, decisions


def test_speculation_gate_probe_that_drafted_nothing_counts_as_plain():
    """Guards the bookkeeping of a drafting step whose drafter proposed nothing (prompt lookup without a
    match): it is a plain step, so it neither counts as a rejected draft nor stops drafting."""
    gate = SpeculationGate()
    # lookup-like: a match on every third step, accepting 4 tokens at 1.3x a plain step's cost
    decisions = drive_gate(gate, 300, lambda step, spec: ((5, 1.3) if step % 3 == 0 else None) if spec else (1, 1.0))
    assert sum(decisions[30:]) / len(decisions[30:]) > 0.9, decisions
    mean, _ = gate.stats[(1, None)].mean_std()
    assert mean == pytest.approx(5.0), mean


def test_speculation_gate_decides_per_kind_against_one_plain_time():
    """Guards the per-kind gate (a head merged with prompt lookup): steps where lookup has a match pay
    (5 tokens for 1.5 plain steps' time), the head-only steps lose (1 token for 1.3); the gate must
    keep drafting the first kind and mostly stop the second, where one estimate for both (kind None)
    would average them. Plain time is measured once for both kinds."""
    gate = SpeculationGate(probe_every=16)

    def kind_of(step):
        return "match" if step % 5 == 0 else "head"

    decisions = {"match": [], "head": []}
    for step in range(600):
        kind = kind_of(step)
        spec = gate.speculate(1, kind)
        decisions[kind].append(spec)
        tokens, seconds = ((5, 1.5) if kind == "match" else (1, 1.3)) if spec else (1, 1.0)
        gate.record(1, spec, tokens, seconds, kind)
    match, head = decisions["match"][20:], decisions["head"][80:]
    assert sum(match) / len(match) > 0.85, f"copied spans drafted on {sum(match)} of {len(match)} steps"
    assert sum(head) / len(head) < 0.2, f"the losing head drafted on {sum(head)} of {len(head)} steps"
    assert gate.plain[1].plain_steps == sum(not d for ds in decisions.values() for d in ds)
    assert gate.speeds("match")[1] == pytest.approx((5 / 1.5, 1.0), rel=0.05)
    assert gate.speeds("head")[1][1] == pytest.approx(1.0) and gate.speeds() == {}


def test_speculation_gate_ignores_a_slow_first_step():
    """Guards the warm-up: the first drafting step often pays one-off costs (allocation, a lazy
    initialisation); taking it at face value must not switch a paying drafter off."""
    decisions = drive_gate(SpeculationGate(), 100, lambda step, spec: ((2, 20.0) if step == 0 else (2, 1.2)) if spec else (1, 1.0))
    assert sum(decisions[3:]) / len(decisions[3:]) > 0.9, decisions


def test_auto_off_policy_stays_exact(models):
    """Guards the auto switch-off path: steps that skip drafting keep rows equal to plain greedy."""
    model = models["gemma3"]
    prompts = mixed_prompts(6, seed=8)
    refs = [plain(model, p) for p in prompts]
    results = generate_batch(model, prompts, lambda: layer_skip_drafter(model, layers=2, gamma=3),
                             GenerationConfig(max_new_tokens=NEW), batch_size=3,
                             policy=TreePolicy(auto_off=True, probe_every=3))
    check_rows(results, prompts, refs, "auto_off")


def test_sampled_rows_follow_target_distribution():
    """Guards batched sampling against bias: x2 and x3 of ragged batched rows match the exact marginals."""
    model = tiny_model("llama", seed=3)
    cfg = SamplingConfig(temperature=1.5, top_k=40)
    short, long = random_prompt(6, 11), random_prompt(19, 12)
    want3, want2 = exact_third_token(model, short, cfg)
    with torch.no_grad():
        p1 = logits_to_probs(model(input_ids=torch.tensor([long])).logits[0, -1], cfg)
        p2 = logits_to_probs(model(input_ids=torch.tensor([long + [a] for a in range(VOCAB)])).logits[:, -1], cfg)
    want2_long = p1 @ p2
    prompts = [short, long] * 800
    results = generate_batch(model, prompts, UniformTreeDrafter, GenerationConfig(max_new_tokens=3, sampling=cfg, seed=0),
                             batch_size=8)
    accepted = sum(r.stats.accepted for r in results)
    assert accepted > 50, f"the drafter must get tokens accepted for this test to mean anything ({accepted})"
    checks = [("short x2", 0, 1, want2), ("short x3", 0, 2, want3), ("long x2", 1, 1, want2_long)]
    for name, parity, pos, want in checks:
        counts = torch.bincount(torch.tensor([r.tokens[pos] for r in results if r.index % 2 == parity]),
                                minlength=VOCAB).float()
        pval = chi2_pvalue(counts, want)
        tv = 0.5 * (counts / counts.sum() - want).abs().sum().item()
        assert pval > 1e-3, f"batched {name} marginal differs from the target's (chi2 p={pval:.2e}, TV={tv:.3f})"


def test_bench_batch_runs_every_decoder_and_batch_size(models):
    """Guards the batch benchmark program: every (decoder, batch size) row, speculation identical to plain."""
    import runpy
    from pathlib import Path
    from types import SimpleNamespace

    from selfdraft.target import Target

    bench = SimpleNamespace(**runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "bench_batch.py")))
    target = Target(model=models["llama"], tokenizer=None, name="tiny-llama")
    prompts = mixed_prompts(5, seed=9)
    rows = bench.bench_batch(target, prompts, [1, 2, 4], ["hf", "plain", "prompt_lookup"], max_new_tokens=8)
    assert [(r["decoder"], r["batch_size"]) for r in rows] == [
        (d, b) for b in (1, 2, 4) for d in ("plain", "hf", "prompt_lookup")
    ]
    for r in rows:
        assert r["new_tokens"] == 5 * 8 and r["tokens_per_s"] > 0, r
        assert r["same_as_plain"] == 1.0, f"{r['decoder']} at batch {r['batch_size']} differs from plain: {r}"
    assert "batch" in bench.format_table(rows) and "speculation" in bench.crossover(rows)


def test_shadow_accepted_walks_the_draft_tree():
    """Guards shadow scoring: the accepted depth of a draft tree against the committed continuation."""
    from selfdraft.gate import shadow_accepted

    # root 0 -> 5 -> 6 -> 7 ; root -> 8 -> 9
    tree = tree_from_parents([-1, 0, 1, 2, 0, 4])
    children, tokens = tree.children(), [0, 5, 6, 7, 8, 9]
    assert shadow_accepted(children, tokens, []) is None
    assert shadow_accepted(children, tokens, [5]) is None  # still matching, deeper nodes undecided
    assert shadow_accepted(children, tokens, [5, 6, 1]) == 2
    assert shadow_accepted(children, tokens, [5, 6, 7]) == 3  # a leaf: everything accepted
    assert shadow_accepted(children, tokens, [5, 6, 7, 4, 4]) == 3
    assert shadow_accepted(children, tokens, [8, 9]) == 2
    assert shadow_accepted(children, tokens, [3]) == 0


def test_speculation_gate_switches_back_on_from_shadow_scores():
    """Guards shadow drafts: a free drafter whose first drafts fail is switched off; once its shadow
    scores show it would pay, drafting resumes within a few steps instead of waiting for the aged
    estimate to force a probe (which takes far longer than a generation)."""
    def outcome(step, spec):
        if spec:
            return (1, 2.3) if step < 10 else (6, 2.3)  # 10-token chains: all rejected, then copying
        return (1, 1.0)

    for shadows in (False, True):
        gate = SpeculationGate(probe_every=64)
        decisions = []
        for step in range(60):
            spec = gate.speculate(1)
            decisions.append(spec)
            gate.record(1, spec, *outcome(step, spec))
            if shadows and not spec and step >= 10:
                gate.record_shadow(1, 6)
        later = decisions[10:]
        if shadows:
            assert later.index(True) <= 3 and sum(later[10:]) >= 38, decisions
        else:
            assert sum(later) <= 2, f"without shadows the aged estimate should rarely probe: {decisions}"


def test_batched_shadow_drafts_score_what_verification_accepts(models, monkeypatch):
    """Guards shadow drafts in the batched loop: with one slot, each step's shadow score equals what
    verifying the same draft accepts; with several slots a step reports the mean over the rows it
    scored, and every row stays plain greedy's."""
    from selfdraft import gate as gate_module

    model = models["llama"]
    prompts = [random_prompt(9, 40 + i) * 3 for i in range(3)]  # repeats, so prompt lookup finds matches
    n = 40
    refs = [plain(model, p, n) for p in prompts]
    cfg = GenerationConfig(max_new_tokens=n)

    def run(always: bool, slots: int, prompts=prompts, refs=refs):
        proposed, scores = [], []

        def make():
            # fixed, unextended drafts: the runs are compared draft by draft (see test_greedy_equivalence)
            return log_proposals(PromptLookupDrafter(adaptive=False, periodic=False), proposed)

        monkeypatch.setattr(gate_module.SpeculationGate, "speculate", lambda self, rows: always)
        real_record = gate_module.SpeculationGate.record
        monkeypatch.setattr(gate_module.SpeculationGate, "record", lambda self, rows, spec, tokens, s:
                            (scores.append(tokens / rows) if spec else None, real_record(self, rows, spec, tokens, s)))
        monkeypatch.setattr(gate_module.SpeculationGate, "record_shadow", lambda self, rows, tokens: scores.append(tokens))
        results = generate_batch(model, prompts, make, cfg, batch_size=slots,
                                 policy=TreePolicy(auto_off=True, probe_every=1000))
        check_rows(results, prompts, refs, f"shadow always={always} slots={slots}")
        return proposed, scores

    # one prompt, one slot: shadow and verified scores of the same drafts, keyed by where they were proposed
    verified = dict(zip(*run(True, 1, prompts[:1], refs[:1])))
    shadowed = dict(zip(*run(False, 1, prompts[:1], refs[:1])))
    common = set(verified) & set(shadowed)
    assert len(shadowed) >= 3 and len(common) >= 2, (verified, shadowed)
    assert any(verified[p] > 1 for p in common), "no accepted draft among the compared ones"
    for p in common:
        assert shadowed[p] == verified[p], (p, shadowed[p], verified[p])

    # three rows at once: shadow scores are reported (means of 1 + accepted depth) and rows stay exact
    _, scores = run(False, 3)
    assert scores and all(1.0 <= s <= 1 + 10 for s in scores) and max(scores) > 1.0, scores
