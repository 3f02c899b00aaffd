"""selfdraft tune: the acceptance profile predicts smaller trees exactly, Medusa tree order, end to end."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_prompt, tiny_model

from selfdraft.drafters import build_drafter
from selfdraft.drafters.eagle import EagleDrafter
from selfdraft.generate import GenerationConfig, generate
from selfdraft.heads import Eagle1Config, Eagle1Head, save
from selfdraft.tune import (
    TIE,
    ProfileRecorder,
    TuneConfig,
    main,
    medusa_best_paths,
    read_tuned,
    tau_from_profile,
    tree_key,
)


@pytest.fixture(scope="module")
def fitted():
    """A tiny llama and an EAGLE-1 head fit to the target's own greedy continuations (accepted often)."""
    model = tiny_model("llama")
    torch.manual_seed(0)
    head = Eagle1Head(Eagle1Config.for_target(model), model.get_input_embeddings(), model.get_output_embeddings())
    seqs = []
    for i in range(6):
        p = random_prompt(5 + i, 100 + i)
        seqs.append(p + generate(model, p, None, GenerationConfig(max_new_tokens=24)).tokens)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    for _ in range(120):
        for s in seqs:
            ids = torch.tensor([s])
            with torch.no_grad():
                out = model(input_ids=ids, output_hidden_states=[-1])
            attn = torch.ones_like(ids)
            loss, _, _ = head(out.hidden_states[-1], ids, out.logits, attn, attn, 1.0, 1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model, head.eval().requires_grad_(False), seqs


def test_profile_predicts_first_step_accept_length_exactly(fitted):
    """Guards the tuner's core: accept lengths of smaller (budget, depth) trees read off one big-tree step."""
    model, head, seqs = fitted
    checked = 0
    for i in range(8):
        # prefixes of the sequences the head was fit on (accepted often) and one unseen prompt
        prompt = seqs[i % 6][: 5 + i % 6 + 2 * (i // 6)] if i < 7 else random_prompt(9, 7)
        recorder = ProfileRecorder(EagleDrafter(head, depth=4, top_k=3, total_tokens=1000), max_nodes=1000)
        generate(model, prompt, recorder, GenerationConfig(max_new_tokens=12))
        first = recorder.steps[:1]  # the first step's context is the same for every tree
        for depth, budget in [(1, 1), (2, 2), (2, 5), (3, 4), (4, 8), (4, 20)]:
            real = generate(model, prompt, EagleDrafter(head, depth, 3, budget), GenerationConfig(max_new_tokens=12))
            predicted = tau_from_profile(first, budget, depth)
            assert predicted == real.stats.accept_lengths[0], (i, depth, budget, predicted, real.stats.accept_lengths[:3])
            checked += real.stats.accept_lengths[0] > 1
    assert checked > 5, "the fitted head should get some first steps accepted, or the test proves nothing"


def test_medusa_paths_in_acceptance_order():
    """Guards Medusa tree construction: best-first by product of per-depth accuracies, prefix-closed."""
    acc = torch.tensor([[0.6, 0.2], [0.5, 0.1]])
    ranked = medusa_best_paths(acc, 5)
    paths = [p for p, _ in ranked]
    assert paths == [(0,), (0, 0), (1,), (1, 0), (0, 1)], paths
    assert [round(v, 4) for _, v in ranked] == [0.6, 0.3, 0.2, 0.1, 0.06]
    for i, p in enumerate(paths):
        assert len(p) == 1 or p[:-1] in paths[:i], f"{p} listed before its parent"


def tune_setup(fitted, target_dir, tmp_path, prompts: list[str], **options):
    """The tiny target, the fitted head saved for it, and a TuneConfig over ``prompts`` (small sizes)."""
    from selfdraft.target import load_target

    _, head, _ = fitted
    target = load_target(str(target_dir), dtype="float32")
    # the fitted head belongs to tiny_model("llama"), which is the same seed-0 model target_dir holds
    head_dir = save(tmp_path / "head", "eagle1", head.cfg, head, target.model, str(target_dir))
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in prompts))
    cfg = TuneConfig(head=str(head_dir), target=str(target_dir), dtype="float32", prompts=str(path), limit=2,
                     max_new_tokens=16, max_nodes=8, max_depth=3, top_ks="1 2", context=16, reps=2, **options)
    return target, head_dir, cfg


def test_tune_end_to_end_saves_and_is_used(fitted, tiny_target_dir, tmp_path, capsys):
    """Guards the command's contract: measure, choose, save tune.json, and head drafters pick it up."""
    target, head_dir, cfg = tune_setup(fitted, tiny_target_dir, tmp_path, ["abc abc abc", "hello there"],
                                       out=str(tmp_path / "tune_full.json"))
    result = main(cfg)
    opts = read_tuned(head_dir)
    assert opts == result["drafter_options"] and set(opts) == {"depth", "top_k", "total_tokens"}
    full = json.loads((tmp_path / "tune_full.json").read_text())
    best = max(c["expected_tokens_per_s"] for c in full["candidates"])
    assert result["expected_tokens_per_s"] == best, "the saved budget must be the best candidate"
    assert all(c["drafter_options"]["total_tokens"] <= 8 and c["drafter_options"]["depth"] <= 3 for c in full["candidates"])
    drafter = build_drafter("head", target.model, path=str(head_dir))
    assert (drafter.depth, drafter.top_k, drafter.total_tokens) == (opts["depth"], opts["top_k"], opts["total_tokens"])
    override = build_drafter("head", target.model, path=str(head_dir), total_tokens=1)
    assert override.total_tokens == 1, "explicit options must win over tune.json"
    assert "tuned for this machine" in capsys.readouterr().err


def test_tune_with_lookup_decodes_the_merged_trees_and_saves_the_fastest(fitted, tiny_target_dir, tmp_path, capsys):
    """Guards --lookup: the one-token draft and the best head-alone trees are decoded merged with
    lookup (every trial commits the same greedy tokens), the fastest is saved under "lookup", and
    head:path=DIR,lookup=N drafts with it while lookup=M (untuned) falls back to the head-alone tree."""
    from selfdraft.drafters import MergedDrafter

    target, head_dir, cfg = tune_setup(fitted, tiny_target_dir, tmp_path, ["abc abc abc abc", "hello there hello there"],
                                       lookup=4, measure=2)
    result = main(cfg)
    merged = result["lookup"]
    trials = merged["trials"]
    assert trials[0]["drafter_options"] == {"depth": 1, "top_k": 1, "total_tokens": 1} and 2 <= len(trials) <= 3
    assert len({tree_key(t["drafter_options"]) for t in trials}) == len(trials), "trials must be distinct trees"
    tokens = {t["tokens"] for t in trials} | {r["tokens"] for r in merged["reference"].values()}
    assert len(tokens) == 1 and tokens.pop() > 0, "greedy decoding commits the same tokens whatever the drafter"
    assert merged["reference"]["plain"]["tau"] == 1.0, "a plain step commits one token (the prefill's is not a step)"
    fastest = max(t["tokens_per_s"] for t in trials)
    tied = [t for t in trials if t["tokens_per_s"] * (1 + TIE) >= fastest]
    assert merged["drafter_options"] == min(tied, key=lambda t: (t["nodes"], -t["tokens_per_s"]))["drafter_options"]
    assert merged["num_tokens"] == 4
    assert read_tuned(head_dir, lookup=4) == merged["drafter_options"]
    drafter = build_drafter("head", target.model, path=str(head_dir), lookup=4)
    assert isinstance(drafter, MergedDrafter) and drafter.drafters[1].num_tokens == 4
    assert drafter.drafters[0].total_tokens == merged["drafter_options"]["total_tokens"]
    capsys.readouterr()
    assert read_tuned(head_dir, lookup=7) == result["drafter_options"]
    assert "not merged with lookup=7" in capsys.readouterr().err


def test_tune_at_a_temperature_decodes_sampled_trials_and_sampling_runs_use_them(fitted, tiny_target_dir, tmp_path, capsys):
    """Guards --temperature: the one-token draft and the best tree are decoded sampling at T, each with
    top-k children and with children drawn from q (sample=true); the fastest (smallest within TIE) is
    saved under "sampled"; head drafters built for sampling use it, greedy ones keep the greedy tree,
    another temperature uses it with a message, and a decoder spec cannot set the temperature."""
    from selfdraft.benchmark import parse_decoder

    target, head_dir, cfg = tune_setup(fitted, tiny_target_dir, tmp_path, ["abc abc abc abc", "hello there hello there"],
                                       temperature=1.0, measure=1)
    result = main(cfg)
    sampled = result["sampled"]
    trials = sampled["trials"]
    options = [t["drafter_options"] for t in trials]
    assert options[:2] == [{"depth": 1, "top_k": 1, "total_tokens": 1}, {"depth": 1, "top_k": 1, "total_tokens": 1, "sample": True}]
    assert len(trials) in (2, 4) and all(o.get("sample") for o in options[1::2]) and not any(o.get("sample") for o in options[::2])
    assert all(t["tokens"] > 0 and t["tau"] >= 1.0 for t in trials) and sampled["reference"]["plain"]["tau"] == 1.0
    fastest = max(t["tokens_per_s"] for t in trials)
    tied = [t for t in trials if t["tokens_per_s"] * (1 + TIE) >= fastest]
    assert sampled["drafter_options"] == min(tied, key=lambda t: (t["nodes"], -t["tokens_per_s"]))["drafter_options"]
    assert sampled["temperature"] == 1.0
    capsys.readouterr()
    assert read_tuned(head_dir, temperature=1.0) == sampled["drafter_options"]
    assert read_tuned(head_dir) == result["drafter_options"], "greedy runs keep the greedy choice"
    assert capsys.readouterr().err == ""
    assert read_tuned(head_dir, temperature=0.7) == sampled["drafter_options"]
    assert "tuned for temperature 1.0" in capsys.readouterr().err
    drafter = build_drafter("head", target.model, 1.0, path=str(head_dir))
    assert (drafter.total_tokens, drafter.sample) == (sampled["drafter_options"]["total_tokens"],
                                                      sampled["drafter_options"].get("sample", False))
    with pytest.raises(ValueError, match="--temperature"):
        parse_decoder(f"head:path={head_dir},temperature=1")


def test_read_tuned_picks_the_section_for_the_run(tmp_path, capsys):
    """Guards read_tuned's choice among tune.json's sections: greedy alone, merged with lookup (greedy
    or sampled: a merged tree is deterministic), sampled alone; at T > 0 without a sampled tune, the
    greedy tree with the command that tunes for T."""
    from selfdraft.kernels import cpu_report
    from selfdraft.tune import TUNE_FILE

    greedy, merged, sampled = ({"depth": 2, "top_k": 2, "total_tokens": 4}, {"depth": 1, "top_k": 1, "total_tokens": 1},
                               {"depth": 1, "top_k": 2, "total_tokens": 2, "sample": True})
    tune = {"drafter_options": greedy, "tuned_for": cpu_report()}
    (tmp_path / TUNE_FILE).write_text(json.dumps(tune))
    assert read_tuned(tmp_path, temperature=0.8) == greedy
    assert "--temperature 0.8" in capsys.readouterr().err
    tune |= {"lookup": {"num_tokens": 10, "drafter_options": merged}, "sampled": {"temperature": 1.0, "drafter_options": sampled}}
    (tmp_path / TUNE_FILE).write_text(json.dumps(tune))
    assert read_tuned(tmp_path) == greedy
    assert read_tuned(tmp_path, temperature=1.0) == sampled
    assert read_tuned(tmp_path, lookup=10) == merged
    assert read_tuned(tmp_path, lookup=10, temperature=1.0) == merged
    assert capsys.readouterr().err == ""


def test_tree_key_tells_apart_only_different_trees():
    """Guards the merged trials' dedup: top_k does not change a depth-1 tree of total_tokens children
    (picked from top_k >= total_tokens), but does change deeper trees."""
    assert tree_key({"depth": 1, "top_k": 8, "total_tokens": 1}) == tree_key({"depth": 1, "top_k": 1, "total_tokens": 1})
    assert tree_key({"depth": 1, "top_k": 8, "total_tokens": 2}) != tree_key({"depth": 1, "top_k": 8, "total_tokens": 1})
    assert tree_key({"depth": 2, "top_k": 2, "total_tokens": 3}) != tree_key({"depth": 2, "top_k": 4, "total_tokens": 3})


def test_a_tune_from_another_cpu_setup_is_ignored(tmp_path, capsys):
    """Guards read_tuned: a tree tuned where products ran on other kernels (no fused kernel, native bf16)
    says nothing about this machine's timings, so it is ignored with a message; a matching one is used."""
    from selfdraft.kernels import cpu_report
    from selfdraft.tune import TUNE_FILE, setup_differences

    here = cpu_report()
    options = {"depth": 2, "top_k": 2, "total_tokens": 4}
    (tmp_path / TUNE_FILE).write_text(json.dumps({"drafter_options": options, "tuned_for": {"target": "x", **here}}))
    assert read_tuned(tmp_path) == options
    other = {**here, "fused_bf16_kernel": not here["fused_bf16_kernel"]}
    (tmp_path / TUNE_FILE).write_text(json.dumps({"drafter_options": options, "tuned_for": other}))
    assert read_tuned(tmp_path) == {}
    assert "different CPU setup" in capsys.readouterr().err
    older = {k: v for k, v in here.items() if k != "fused_bf16_kernel"}  # recorded before the kernel existed
    assert setup_differences(older, here) == ({"fused_bf16_kernel": (False, True)} if here["fused_bf16_kernel"] else {})
    assert setup_differences({"target": "x"}, here) == {}


def test_verify_latency_times_the_sizes_in_turns(monkeypatch):
    """Guards the timing order: sizes take turns round by round (a drift of the machine's speed then
    hits every size alike), a warm-up round is not counted, and the cache is back at the context after
    each forward."""
    import selfdraft.tune as tune

    model = tiny_model("llama")
    calls = []
    real = tune.tree_forward

    def spy(model, cache, tokens, tree, **kw):
        calls.append((tokens.shape[1], cache.length))
        greedy.append(kw.get("argmax_only", False))
        seen.append(tokens[0].tolist())
        return real(model, cache, tokens, tree, **kw)

    greedy, seen = [], []

    monkeypatch.setattr(tune, "tree_forward", spy)
    text = [5, 6, 7, 8, 9]
    out = tune.verify_latency(model, [3, 1, 5], context=8, reps=2, text=text)
    assert sorted(out) == [1, 3, 5] and all(t > 0 for t in out.values()), out
    assert calls[0] == (8, 0), calls  # the context prefill
    assert calls[1:] == [(3, 8), (1, 8), (5, 8)] * 3, calls
    assert greedy == [False] + [True] * 9, greedy  # timed as generate's greedy steps run (screened lm_head)
    # context and timed tokens read from the text, repeated where it is short (the screen's cost depends on it)
    assert seen[0] == (text * 3)[:8] and seen[1:4] == [(text * 3)[8:11], (text * 3)[8:9], (text * 3)[8:13]], seen
    calls.clear()
    greedy.clear()
    entered = []
    routes = {"a": lambda: entered.append("a"), "b": lambda: entered.append("b")}
    out = tune.forward_latency(model, [2, 4], context=8, reps=1, routes=routes)
    assert sorted(out) == ["a", "b"] and all(sorted(per) == [2, 4] for per in out.values()), out
    assert calls[1:] == [(2, 8), (2, 8), (4, 8), (4, 8)] * 2, calls  # each size under every route in turn
    assert entered == ["a", "b"] * 4, entered
    assert not any(greedy), greedy  # full logits unless asked
