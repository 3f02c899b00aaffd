"""Speculative greedy decoding must equal plain greedy decoding token for token (fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ARCHS, VOCAB, random_prompt, tiny_model
from helpers import ScriptedDrafter, log_proposals

from selfdraft.drafters import DraftModelDrafter, PromptLookupDrafter, SuffixDrafter, layer_skip_drafter
from selfdraft.drafters.suffix import NgramTable
from selfdraft.generate import ContextLengthError, GenerationConfig, generate

NEW = 24


def plain(model, prompt, n=NEW, eos=()):
    return generate(model, prompt, None, GenerationConfig(max_new_tokens=n), eos_token_ids=eos)


def noisy_copy(model, scale: float, seed: int):
    """A draft model that agrees with the target often but not always."""
    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * scale * p.std())
    return draft


def prompts(count: int) -> list[list[int]]:
    """Mixed lengths, some with repetition so prompt lookup finds matches."""
    out = []
    for i in range(count):
        base = random_prompt(1 + (i * 7) % 40, i)
        out.append(base + base[: i % 5] if i % 3 == 0 else base)
    return out


def make_drafters(model, reference, seed):
    return {
        "oracle": ScriptedDrafter(reference, "oracle", VOCAB, seed=seed),
        "random": ScriptedDrafter(reference, "random", VOCAB, seed=seed),
        "partial": ScriptedDrafter(reference, "partial", VOCAB, seed=seed),
        "prompt_lookup": PromptLookupDrafter(max_candidates=3),
        "layer_skip": layer_skip_drafter(model, layers=2, gamma=3),
        "draft_model": DraftModelDrafter(noisy_copy(model, 0.3, seed), gamma=3),
        "suffix": SuffixDrafter(seeded_table(reference)),  # the reply itself: drafts mostly accepted
    }


def seeded_table(tokens: list[int]) -> NgramTable:
    table = NgramTable(4)
    table.add(tokens)
    return table


def test_plain_decoder_matches_hf_generate(models):
    """Guards the oracle itself: our plain loop must equal transformers' own greedy generate."""
    model = models["llama"]
    for i, prompt in enumerate(prompts(5)):
        ours = plain(model, prompt).tokens
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                            pad_token_id=0, min_new_tokens=NEW)[0, len(prompt):].tolist()
        assert ours == hf, f"prompt {i}: ours {ours} vs HF {hf}"


def test_every_drafter_equals_plain_greedy_over_30_prompts(models):
    """Guards the whole speculative path (tree mask, acceptance, compaction, drafter rollback) on llama."""
    model = models["llama"]
    taus = {}
    for i, prompt in enumerate(prompts(30)):
        ref = plain(model, prompt).tokens
        for name, drafter in make_drafters(model, prompt + ref, seed=i).items():
            out = generate(model, prompt, drafter, GenerationConfig(max_new_tokens=NEW))
            assert out.tokens == ref, f"prompt {i} drafter {name}: {out.tokens} != {ref}"
            taus.setdefault(name, []).append(out.stats.tau)
    mean = {k: sum(v) / len(v) for k, v in taus.items()}
    assert mean["oracle"] > 3.5, f"oracle drafts must be accepted: tau {mean}"
    assert mean["random"] < 1.2, f"random drafts must be rejected: tau {mean}"
    assert 1.2 < mean["partial"] < mean["oracle"], f"partial drafts partly accepted: tau {mean}"
    assert mean["suffix"] > 2.0, f"a table holding the reply drafts it: tau {mean}"


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "llama"])
def test_drafters_equal_plain_greedy_other_archs(models, arch):
    """Guards architecture-specific paths (qk-norm, sliding windows) under speculation."""
    model = models[arch]
    for i, prompt in enumerate(prompts(6)):
        ref = plain(model, prompt).tokens
        for name, drafter in make_drafters(model, prompt + ref, seed=i).items():
            out = generate(model, prompt, drafter, GenerationConfig(max_new_tokens=NEW))
            assert out.tokens == ref, f"{arch} prompt {i} drafter {name}: {out.tokens} != {ref}"


@pytest.mark.parametrize("stop_at", [0, 1, 5, 13])
def test_eos_inside_accepted_run_stops_there(models, stop_at):
    """Guards against emitting tokens after an EOS that lands in the middle of an accepted draft."""
    model = models["llama"]
    prompt = random_prompt(10, 77)
    ref = plain(model, prompt, n=40).tokens
    eos = ref[stop_at]
    first = ref.index(eos)
    want = ref[: first + 1]
    assert plain(model, prompt, n=40, eos=[eos]).tokens == want
    drafter = ScriptedDrafter(prompt + ref, "oracle", VOCAB, depth=6)
    out = generate(model, prompt, drafter, GenerationConfig(max_new_tokens=40), eos_token_ids=[eos])
    assert out.tokens == want and out.stop_reason == "eos", f"{out.tokens} vs {want}"


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7])
def test_max_new_tokens_is_exact(models, n):
    """Guards against overshooting max_new_tokens when a long draft is fully accepted."""
    model = models["llama"]
    prompt = random_prompt(6, 8)
    ref = plain(model, prompt, n=20).tokens
    drafter = ScriptedDrafter(prompt + ref, "oracle", VOCAB, depth=5)
    out = generate(model, prompt, drafter, GenerationConfig(max_new_tokens=n))
    assert out.tokens == ref[:n], f"max_new_tokens={n}: got {len(out.tokens)} tokens"


def test_context_limit_errors_or_truncates(models):
    """Guards against running past max_position_embeddings (RoPE garbage) without telling the user."""
    model = models["llama"]
    prompt = random_prompt(250, 9)
    with pytest.raises(ContextLengthError, match="exceeds the target's context"):
        generate(model, prompt, None, GenerationConfig(max_new_tokens=10))
    out = generate(model, prompt, PromptLookupDrafter(),
                   GenerationConfig(max_new_tokens=10, on_context_overflow="truncate"))
    assert len(out.tokens) == 256 - 250


def test_stop_strings_end_generation():
    """Guards stop-string handling: the text ends with the stop string and nothing after it."""

    class CharTokenizer:
        def decode(self, ids):
            return "".join(chr(97 + i % 26) for i in ids)

    model = tiny_model("llama")
    prompt = random_prompt(8, 10)
    ref = plain(model, prompt, n=30).tokens
    tok = CharTokenizer()
    stop = tok.decode(ref[9:11])
    text = tok.decode(ref)
    want_len = text.index(stop) + len(stop)
    out = generate(model, prompt, PromptLookupDrafter(), GenerationConfig(max_new_tokens=30, stop_strings=(stop,)),
                   tokenizer=tok)
    assert out.stop_reason == "stop_string" and tok.decode(out.tokens) == text[:want_len]


class SlowRandomDrafter(ScriptedDrafter):
    """Random drafts (never accepted) that take 30 ms each: speculation can only lose."""

    def propose(self, tokens, sampling, generator):
        import time

        time.sleep(0.03)
        return super().propose(tokens, sampling, generator)


def test_speculation_gate_keeps_output_and_switches_a_losing_drafter_off(models):
    """Guards the batch-1 gate (auto_off): output stays plain greedy's; a drafter that only costs time stops
    drafting after the first probes, while an all-accepted drafter keeps drafting."""
    model = models["llama"]
    prompt = random_prompt(12, 5)
    n = 60
    ref = plain(model, prompt, n).tokens
    cfg = GenerationConfig(max_new_tokens=n, auto_off=True, probe_every=8)
    slow = generate(model, prompt, SlowRandomDrafter(prompt + ref, "random", VOCAB, seed=1), cfg)
    oracle = generate(model, prompt, ScriptedDrafter(prompt + ref, "oracle", VOCAB, seed=1), cfg)
    assert slow.tokens == ref and oracle.tokens == ref
    s, o = slow.stats, oracle.stats
    assert s.draft_steps <= 1 + s.steps // 8 + 1, f"losing drafter drafted {s.draft_steps} of {s.steps} steps"
    # plain steps allowed: the gate's two warm-up plain steps, one re-measurement per 8, a last step with no room to draft
    assert o.draft_steps >= o.steps - (3 + o.steps // 8), f"oracle drafted only {o.draft_steps} of {o.steps} steps"
    from selfdraft.benchmark import DecoderResult

    res = DecoderResult(decoder="oracle")
    res.add_stats(o)
    row = res.summary(None)
    assert row["drafted_frac"] == o.draft_steps / o.steps
    assert abs(row["tau_drafting"] - (1 + o.accepted / o.draft_steps)) < 1e-9, row["tau_drafting"]
    # tau pools every step of every prompt (tokens / forwards), not a mean of per-prompt ratios
    res.add_stats(s)
    row = res.summary(None)
    pooled = (o.steps + o.accepted + s.steps + s.accepted) / (o.steps + s.steps)
    assert row["tau"] == pytest.approx(pooled) and row["tau_prompt_mean"] == pytest.approx((o.tau + s.tau) / 2), row


def test_a_gate_carried_across_replies_skips_the_warm_up_it_has_done(models):
    """Guards generate(gate=...): a gate kept over replies (chat, bench) does not draft a losing drafter
    again at the start of the next reply, as a fresh gate must (WARMUP drafting steps), keeps an
    all-accepted drafter drafting, leaves the output plain greedy's, and refuses another drafter or
    sampling configuration."""
    from selfdraft.gate import WARMUP, SpeculationGate
    from selfdraft.sampling import SamplingConfig

    model = models["llama"]
    prompts = [random_prompt(12, 5), random_prompt(9, 6)]
    n = 40
    refs = [plain(model, p, n).tokens for p in prompts]
    cfg = GenerationConfig(max_new_tokens=n, auto_off=True, probe_every=8)
    slow = SlowRandomDrafter(prompts[0] + refs[0], "random", VOCAB, seed=1)
    gate = SpeculationGate(cfg.probe_every)
    first = generate(model, prompts[0], slow, cfg, gate=gate)
    fresh = generate(model, prompts[1], slow, cfg)
    carried = generate(model, prompts[1], slow, cfg, gate=gate)
    assert first.tokens == refs[0] and fresh.tokens == carried.tokens == refs[1]
    assert fresh.stats.draft_steps >= WARMUP > carried.stats.draft_steps, (fresh.stats.draft_steps, carried.stats.draft_steps)
    oracle_gate = SpeculationGate(cfg.probe_every)
    oracle = ScriptedDrafter(prompts[0] + refs[0], "oracle", VOCAB, seed=1)
    generate(model, prompts[0], oracle, cfg, gate=oracle_gate)
    again = generate(model, prompts[0], oracle, cfg, gate=oracle_gate)
    assert again.tokens == refs[0]
    # no second round of warm-up plain steps: plain only for the 1-in-8 re-measurements and a last step
    assert again.stats.draft_steps >= again.stats.steps - (again.stats.steps // 8 + 1), again.stats
    with pytest.raises(ValueError, match="one gate per"):
        generate(model, prompts[1], oracle, cfg, gate=gate)  # the gate measured `slow`
    sampled = GenerationConfig(max_new_tokens=n, auto_off=True, sampling=SamplingConfig(1.0), seed=0)
    with pytest.raises(ValueError, match="one gate per"):
        generate(model, prompts[1], slow, sampled, gate=gate)


def test_shadow_drafts_score_what_verification_accepts(models, monkeypatch):
    """Guards the gate's shadow drafts (a free drafter proposing while plain steps run): each shadow
    score equals what verifying the same draft accepts, and the output stays plain greedy's."""
    from selfdraft import gate as gate_module

    model = models["llama"]
    prompt = random_prompt(10, 7) * 3  # repeats, so prompt lookup finds matches
    n = 48
    ref = plain(model, prompt, n).tokens
    cfg = GenerationConfig(max_new_tokens=n, auto_off=True, probe_every=1000)

    def run(always: bool):
        proposed, scores = [], []
        # fixed, unextended drafts: the runs are compared draft by draft at the same roots. An adaptive
        # length follows each run's own steps (verified or plain) to different drafts; periodic drafts
        # are all full-length here, so the verified run moves 11 tokens a draft and the shadowed one 10,
        # and their roots drift apart after the first
        drafter = log_proposals(PromptLookupDrafter(adaptive=False, periodic=False), proposed)
        monkeypatch.setattr(gate_module.SpeculationGate, "pick", lambda self, rows, kinds: 0 if always else None)
        real_record = gate_module.SpeculationGate.record
        monkeypatch.setattr(gate_module.SpeculationGate, "record", lambda self, rows, spec, tokens, s, kind=None, idle=():
                            (scores.append(tokens) if spec else None, real_record(self, rows, spec, tokens, s, kind, idle)))
        monkeypatch.setattr(gate_module.SpeculationGate, "record_shadow", lambda self, rows, tokens, kind=None: scores.append(tokens))
        out = generate(model, prompt, drafter, cfg)
        assert out.tokens == ref
        return dict(zip(proposed, scores))  # committed length at the draft's root -> tokens committed

    verified, shadowed = run(True), run(False)
    common = set(verified) & set(shadowed)
    assert len(shadowed) >= 3 and len(common) >= 2, (verified, shadowed)
    assert any(verified[p] > 1 for p in common), "no accepted draft among the compared ones"
    for p in common:
        assert shadowed[p] == verified[p], (p, shadowed[p], verified[p])
