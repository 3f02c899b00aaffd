"""EAGLE-3 head: training-time-test masks, loss by hand, incremental drafting, exact greedy, save/load."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, kernel_or_skip, random_prompt, tiny_model

from selfdraft.drafters.eagle import EagleDrafter
from selfdraft.generate import GenerationConfig, generate
from selfdraft.heads import Eagle3Config, Eagle3Head, load_head, save
from selfdraft.heads.eagle3 import eagle3_loss, select_draft_vocab, ttt_attention, ttt_mask
from selfdraft.sampling import SamplingConfig


def make_head(model, draft_vocab=48, seed=0, scale=1.0):
    torch.manual_seed(seed)
    cfg = Eagle3Config.for_target(model, draft_vocab)
    head = Eagle3Head(cfg, model.get_input_embeddings())
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05 * scale)
    counts = torch.arange(VOCAB).flip(0).float()  # lower ids more frequent
    head.set_draft_vocab(select_draft_vocab(counts, draft_vocab))
    return head.eval()


def test_ttt_mask_matches_explicit_construction():
    """Guards the unrolled-step mask: causal over step 0, own position only for later steps."""
    seq, step = 5, 2
    want = torch.zeros(seq, seq * (step + 1), dtype=torch.bool)
    for t in range(seq):
        for s in range(seq):
            want[t, s] = s <= t
        for i in range(1, step + 1):
            want[t, i * seq + t] = True
    assert torch.equal(ttt_mask(seq, step), want)


@pytest.mark.parametrize("step", [0, 1, 3])
def test_ttt_attention_equals_sdpa_under_the_full_mask(step):
    """Guards the fast TTT attention: values and gradients equal SDPA over the materialised ttt_mask, with padding."""
    torch.manual_seed(step)
    b, h, s, d = 2, 3, 7, 8
    q = torch.randn(b, h, s, d, requires_grad=True)
    keys = [torch.randn(b, h, s, d, requires_grad=True) for _ in range(step + 1)]
    values = [torch.randn(b, h, s, d, requires_grad=True) for _ in range(step + 1)]
    key_mask = torch.ones(b, s, dtype=torch.bool)
    key_mask[1, 5:] = False  # right padding in the second row
    full = ttt_mask(s, step)[None, None] & key_mask.repeat(1, step + 1)[:, None, None, :]
    want = torch.nn.functional.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=full)
    got = ttt_attention(q, keys, values, key_mask)
    assert torch.allclose(got, want, atol=1e-5)
    weights = torch.randn_like(want)
    grads_want = torch.autograd.grad((want * weights).sum(), [q, *keys, *values])
    grads_got = torch.autograd.grad((got * weights).sum(), [q, *keys, *values])
    for a, b_ in zip(grads_got, grads_want, strict=True):
        assert torch.allclose(a, b_, atol=1e-5)


def test_draft_vocab_maps_round_trip():
    """Guards d2t/t2d: target id = draft id + d2t[draft id], t2d marks exactly the kept ids."""
    counts = torch.tensor([5, 0, 9, 1, 9, 3])
    ids = select_draft_vocab(counts, 3)
    assert ids.tolist() == [0, 2, 4]
    model = tiny_model("llama")
    head = make_head(model)
    d = torch.arange(head.cfg.draft_vocab_size)
    assert torch.equal(d + head.d2t, head.draft_ids)
    assert head.t2d.sum() == head.cfg.draft_vocab_size and bool(head.t2d[head.draft_ids].all())


def manual_step_outputs(head, features, ids, steps):
    """Reference TTT forward with explicit loops over positions (no masks)."""
    b, s, _ = features.shape
    feat = head.fuse(features)
    mid = head.midlayer
    keys, vals, outs = [], [], []
    for j in range(steps):
        tok = torch.cat([ids[:, 1 + j :], ids.new_zeros(b, 1 + j)], 1)
        pos = torch.arange(s)[None] + j
        q, k, v = mid.qkv(head.embed(tok), feat, pos)
        keys.append(k)
        vals.append(v)
        h = torch.zeros_like(feat)
        for t in range(s):
            ks = [keys[0][:, :, : t + 1]] + [kk[:, :, t : t + 1] for kk in keys[1:]]
            vs = [vals[0][:, :, : t + 1]] + [vv[:, :, t : t + 1] for vv in vals[1:]]
            allow = torch.ones(1, 1, 1, sum(x.shape[2] for x in ks), dtype=torch.bool)
            h[:, t] = mid.finish(feat[:, t : t + 1], q[:, :, t : t + 1], torch.cat(ks, 2), torch.cat(vs, 2), allow)[:, 0]
        outs.append(h)
        feat = h
    return outs


def test_eagle3_loss_matches_hand_computation():
    """Guards the TTT loss: label shift, draft-vocab restriction, step weights, mask handling."""
    model = tiny_model("llama")
    head = make_head(model, draft_vocab=40)
    torch.manual_seed(1)
    b, s = 1, 6
    features = torch.randn(b, s, 3 * model.config.hidden_size)
    ids = torch.randint(3, VOCAB, (b, s))
    target_logits = torch.randn(b, s, VOCAB)
    lmask = torch.tensor([[0, 1, 1, 1, 1, 1]])
    attn = torch.ones(b, s, dtype=torch.long)
    with torch.no_grad():
        loss, losses, _ = eagle3_loss(head, features, ids, target_logits, lmask, attn, steps=2, decay=0.5)
        outs = manual_step_outputs(head, features, ids, 2)
    want = []
    for j, h in enumerate(outs):
        terms = []
        for t in range(s - 2 - j):  # label position t+2+j must exist; loss mask at t+1+j
            if lmask[0, t + 1 + j]:
                p = torch.softmax(target_logits[0, t + 1 + j, head.draft_ids], -1)
                logq = torch.log_softmax(head.logits(h[0, t]), -1)
                terms.append(-(p * logq).sum())
        want.append(torch.stack(terms).mean())
    assert torch.allclose(losses[0], want[0], atol=1e-5), (losses[0], want[0])
    assert torch.allclose(losses[1], want[1], atol=1e-5), (losses[1], want[1])
    assert torch.allclose(loss, want[0] + 0.5 * want[1], atol=1e-5)
    with torch.no_grad():  # logits given at the draft ids only (what training computes) give the same loss
        restricted, _, _ = eagle3_loss(head, features, ids, target_logits[..., head.draft_ids], lmask, attn, steps=2, decay=0.5)
    assert torch.allclose(restricted, loss, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_eagle_tree_drafting_is_exact(models, arch):
    """Guards the dynamic tree + head cache rollback: greedy output equals plain greedy."""
    model = models[arch]
    head = make_head(model, scale=20.0)
    drafter = EagleDrafter(head, depth=3, top_k=3, total_tokens=8)
    from selfdraft.drafters.base import StepResult

    fwd_hidden = {i: torch.randn(1, 5, model.config.hidden_size) for i in head.cfg.feature_layers}
    drafter.reset(StepResult(torch.tensor(random_prompt(6, 0)), 0, fwd_hidden))
    draft = drafter.propose(torch.tensor(random_prompt(6, 0)), SamplingConfig(), None)
    assert draft.tree.size == 9 and draft.tree.max_depth <= 3, "budget: root + total_tokens nodes, depth <= 3"
    accepted = 0
    for i in range(6):
        prompt = random_prompt(4 + 5 * i, i)
        ref = generate(model, prompt, None, GenerationConfig(max_new_tokens=20)).tokens
        out = generate(model, prompt, EagleDrafter(head, depth=3, top_k=3, total_tokens=8),
                       GenerationConfig(max_new_tokens=20))
        assert out.tokens == ref, f"{arch} prompt {i}"
        accepted += out.stats.accepted


def test_eagle_sampling_runs_and_respects_budget(models):
    """Guards the sampling path with a dynamic tree (losslessness itself is proved in test_sampling)."""
    model = models["llama"]
    head = make_head(model)
    out = generate(model, random_prompt(8, 3), EagleDrafter(head),
                   GenerationConfig(max_new_tokens=15, sampling=SamplingConfig(1.0), seed=0))
    assert len(out.tokens) == 15


def test_incremental_pairs_equal_one_shot(models):
    """Guards the head cache: feeding committed pairs in chunks equals feeding them at once."""
    model = models["llama"]
    head = make_head(model)
    d1, d2 = EagleDrafter(head), EagleDrafter(head)
    n, hdim = 7, model.config.hidden_size
    feats = torch.randn(n, 3 * hdim)
    toks = torch.randint(3, VOCAB, (n,))
    emb = head.embed(toks)
    pos = torch.arange(n)
    with torch.no_grad():
        from selfdraft.drafters.base import StepResult

        fake = StepResult(torch.zeros(1, dtype=torch.long), 0, {i: torch.zeros(1, 1, hdim) for i in head.cfg.feature_layers})
        d1.reset(fake)
        d2.reset(fake)
        for d in (d1, d2):
            d.committed = 0
            d.kv.length = 0
        one = d1._run(emb, head.fuse(feats), pos, None)[0]
        d2._run(emb[:4], head.fuse(feats[:4]), pos[:4], None)
        two = d2._run(emb[4:5], head.fuse(feats[4:5]), pos[4:5], None)[0]  # one pair: no mask built
        three = d2._run(emb[5:], head.fuse(feats[5:]), pos[5:], None)[0]
    assert (one[4:5] - two).abs().max() < 1e-5
    assert (one[5:] - three).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
@pytest.mark.parametrize("outputs_from", [1, 5, 6])
def test_inputs_before_outputs_from_leave_the_keys_and_values_of_the_whole_layer(models, kind, outputs_from):
    """Guards the catch-up on committed pairs (``_run(..., outputs_from=n - 1)`` in ``expand``): the
    inputs whose outputs nothing reads leave in the cache the keys and values that running the whole
    layer over every input leaves, and the outputs and logits of the rest are the whole layer's."""
    from selfdraft.drafters.base import StepResult
    from selfdraft.heads import Eagle1Config, Eagle1Head

    model = models["llama"]
    if kind == "eagle3":
        head = make_head(model)
        width = 3 * model.config.hidden_size
    else:
        torch.manual_seed(0)
        head = Eagle1Head(Eagle1Config.for_target(model), model.get_input_embeddings(), model.get_output_embeddings())
        with torch.no_grad():
            for p in head.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        width = model.config.hidden_size
    n = 7
    feats, toks, pos = torch.randn(n, width), torch.randint(3, VOCAB, (n,)), torch.arange(n)
    fake = StepResult(torch.zeros(1, dtype=torch.long), 0, {i: torch.zeros(1, 1, width // len(head.feature_layers))
                                                            for i in head.feature_layers})
    whole, part = EagleDrafter(head), EagleDrafter(head)
    with torch.no_grad():
        results = []
        for d, start in ((whole, 0), (part, outputs_from)):
            d.reset(fake)
            d.committed = d.kv.length = 0
            results.append(d._run(head.embed(toks), feats, pos, None, fuse=True, outputs_from=start))
    (out, logits), (part_out, part_logits) = results
    assert part_out.shape[0] == part_logits.shape[0] == n - outputs_from
    assert part.kv.length == whole.kv.length == n
    for a, b in ((whole.kv.keys, part.kv.keys), (whole.kv.values, part.kv.values)):
        assert (a[:, :, :n] - b[:, :, :n]).abs().max() < 1e-5
    assert (out[outputs_from:] - part_out).abs().max() < 1e-5
    assert (logits[outputs_from:] - part_logits).abs().max() < 1e-4


class _AllChildren(EagleDrafter):
    """Generates top_k children of top_k frontier nodes at every depth (EAGLE-2's expansion in full)."""

    def children(self, depth: int) -> int:
        return self.top_k

    def frontier_width(self, depth: int) -> int:
        return self.top_k


@pytest.mark.parametrize("depth,top_k,total", [(1, 4, 1), (1, 4, 3), (2, 3, 2), (2, 4, 3), (3, 3, 4), (4, 4, 5),
                                               (3, 4, 8), (4, 2, 9)])
def test_nodes_that_could_not_be_kept_are_not_generated(models, depth, top_k, total):
    """Guards EagleDrafter.children and frontier_width: the draft is the one the full EAGLE-2
    expansion gives, with fewer nodes generated where the budget is below top_k + depth."""
    from selfdraft.drafters.base import StepResult

    model = models["llama"]
    head = make_head(model, scale=20.0)
    hidden = {i: torch.randn(1, 6, model.config.hidden_size) for i in head.cfg.feature_layers}
    tokens = torch.tensor(random_prompt(7, 1))
    capped, full = EagleDrafter(head, depth, top_k, total), _AllChildren(head, depth, top_k, total)
    generated = []
    for d in (capped, full):
        expand = d.expand
        d.expand = lambda *a: generated.append((out := expand(*a))[0].size) or out  # noqa: B023
        d.reset(StepResult(tokens, 0, hidden))
        draft = d.propose(tokens[:-1], SamplingConfig(), None)
        assert draft.tree.size == 1 + total
        if d is capped:
            first = draft
    assert torch.equal(first.tokens, draft.tokens) and torch.equal(first.tree.parents, draft.tree.parents)
    if total < top_k + depth - 1:
        assert generated[0] < generated[1]
    else:
        assert generated[0] == generated[1]


def test_eagle3_save_load_round_trip(tmp_path):
    """Guards the head folder for EAGLE-3: tensors (d2t/t2d included) come back bit-identical."""
    model = tiny_model("llama")
    head = make_head(model)
    path = save(tmp_path / "e3", "eagle3", head.cfg, head, model, "tiny")
    kind, loaded, _ = load_head(path, model)
    assert kind == "eagle3"
    for (k, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    assert "embed" not in " ".join(head.state_dict()), "the target embedding must not be saved with the head"


def test_eagle_drafter_catches_up_on_a_long_backlog_in_fp32(monkeypatch):
    """Guards the head's products over a long backlog of committed pairs (the prompt after prefill,
    or a stretch the gate decoded plainly): on a CPU without native bf16 they take the fp32 route
    (PyTorch's bf16 GEMM there is ~5x slower), a step of few pairs does not, only the last pair runs
    the whole layer, and the draft is the one the plain bf16 products give (the same tokens on this head)."""
    import selfdraft.kernels as kernels
    from selfdraft.drafters.base import StepResult

    monkeypatch.setattr(kernels, "native_bf16_matmul", lambda device_type="cpu": False)
    model = tiny_model("llama")
    head = make_head(model, scale=20.0).bfloat16()
    routed = []
    real = kernels.upcast_linear

    def spy(x, weight, bias, scratch):
        routed.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real(x, weight, bias, scratch)

    monkeypatch.setattr(kernels, "upcast_linear", spy)
    long = kernels.fused_max_rows() + 12 if kernels.fused_kernel() is not None else 20
    prompt = torch.tensor(random_prompt(long, 0))
    hidden = {i: torch.randn(1, long, model.config.hidden_size).bfloat16() for i in head.cfg.feature_layers}
    drafts = []
    for route in (True, False):
        if not route:
            monkeypatch.setattr("selfdraft.drafters.eagle.large_products", lambda *a: kernels.nullcontext())
        drafter = EagleDrafter(head, depth=2, top_k=2, total_tokens=4)
        drafter.reset(StepResult(prompt, 0, hidden))
        drafts.append(drafter.propose(prompt, SamplingConfig(), None))
        if route:
            # fc over every pair, keys and values over all but the last (nothing reads their outputs),
            # the last pair's layer a one-row step
            assert sorted(routed) == [long - 1, long - 1, long], f"the backlog's products must take the fp32 route: {routed}"
            routed.clear()
            step = {i: h[:, -1:] for i, h in hidden.items()}
            drafter.update(StepResult(torch.cat([prompt, prompt[-1:]]), 0, step))
            drafter.propose(torch.cat([prompt, prompt[-1:]]), SamplingConfig(), None)
            assert routed == [], "a step of one pair stays on the bf16 products"
    assert torch.equal(drafts[0].tokens, drafts[1].tokens) and torch.equal(drafts[0].tree.parents, drafts[1].tree.parents)


def test_sampled_eagle_draft_keeps_draw_order_and_carries_q(tmp_path):
    """Guards sample=True: at T > 0 each expanded node's children are distinct draws from the q the
    draft carries for it (full vocabulary, zero outside the draft vocabulary), the kept nodes are the
    first total_tokens in draw order, and a greedy step still drafts the deterministic tree."""
    from selfdraft.drafters.base import StepResult
    from selfdraft.sampling import draw_without_replacement

    q = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 1.0, 0.0]])
    got = draw_without_replacement(q, 3, torch.Generator().manual_seed(0))
    assert sorted(got[0].tolist()) == [0, 1, 2] and got[1].tolist() == [2, -1, -1]
    first = torch.stack([draw_without_replacement(q[:1], 2, torch.Generator().manual_seed(s))[0] for s in range(2000)])
    assert abs(float((first[:, 0] == 0).float().mean()) - 0.5) < 0.04, "first draw ~ q"
    second_after_0 = first[first[:, 0] == 0, 1]
    assert abs(float((second_after_0 == 1).float().mean()) - 0.6) < 0.06, "second draw ~ q without the first"

    model = tiny_model("llama")
    head = make_head(model, scale=2.0)
    sampling = SamplingConfig(temperature=1.0)
    prompt = torch.tensor(random_prompt(6, 0))
    hidden = {i: torch.randn(1, 6, model.config.hidden_size) for i in head.cfg.feature_layers}
    drafter = EagleDrafter(head, depth=2, top_k=3, total_tokens=5, sample=True)
    drafter.reset(StepResult(prompt, 0, hidden))
    draft = drafter.propose(prompt, sampling, torch.Generator().manual_seed(1))
    assert draft.q is not None and draft.q.shape == (draft.tree.size, model.config.vocab_size)
    assert draft.tree.size == 6 and draft.tree.parents[1:4].tolist() == [0, 0, 0], "the root's three draws come first"
    outside = torch.ones(model.config.vocab_size, dtype=torch.bool)
    outside[head.draft_ids] = False
    for node, kids in enumerate(draft.tree.children()):
        if kids:
            row = draft.q[node]
            assert abs(float(row.sum()) - 1) < 1e-5 and float(row[outside].sum()) == 0.0
            toks = draft.tokens[kids]
            assert len(set(toks.tolist())) == len(kids) and bool((row[toks] > 0).all())
    drafter = EagleDrafter(head, depth=2, top_k=3, total_tokens=5, sample=True)
    drafter.reset(StepResult(prompt, 0, hidden))
    assert drafter.propose(prompt, SamplingConfig(), None).q is None, "greedy steps keep the deterministic tree"
    from selfdraft.drafters import build_drafter

    folder = save(tmp_path / "head", "eagle3", head.cfg, head, model, "tiny")
    with pytest.raises(ValueError, match="deterministic"):
        build_drafter("head", model, path=str(folder), lookup=4, sample=True)


def _drafts_through(monkeypatch, model, head, lean: str, options: dict, sampling: SamplingConfig):
    """Every expand of a generation (tree parents, tokens, scores, q) with the lean step on or off, and
    how many head runs took it."""
    import selfdraft.heads.lean_step as lean_step

    monkeypatch.setenv(lean_step.LEAN_STEP_ENV, lean)
    drafter = EagleDrafter(head, **options)
    seen, runs = [], {"lean": 0}
    expand, run = drafter.expand, drafter._run

    def recording_expand(*a):
        out = expand(*a)
        seen.append((out[0].parents, out[1], out[2], out[3]))
        return out

    def counting_run(emb, *a, **k):
        runs["lean"] += drafter.step is not None and emb.shape[0] <= 16
        return run(emb, *a, **k)

    drafter.expand, drafter._run = recording_expand, counting_run
    # 20 prompt tokens: the first catch-up (past FUSED_ATTENTION_MAX_QUERIES rows) runs through the modules
    out = generate(model, random_prompt(20, 4), drafter, GenerationConfig(max_new_tokens=24, sampling=sampling, seed=3))
    return out.tokens, seen, runs["lean"]


@pytest.mark.parametrize("options,temperature", [
    (dict(depth=1, top_k=4, total_tokens=1), 0.0),
    (dict(depth=3, top_k=3, total_tokens=6), 0.0),
    (dict(depth=4, top_k=4, total_tokens=12), 0.0),
    (dict(depth=3, top_k=3, total_tokens=6, sample=True), 1.0),
])
def test_lean_step_drafts_what_the_head_modules_draft(monkeypatch, options, temperature):
    """Guards the lean step (selfdraft/heads/lean_step.py, csrc/eagle3_step.cpp): a bf16 head's every
    draft (tree, tokens, scores, q) and the generation are bit-identical to its modules' path under the
    fused kernels, with committed stretches of one and of several pairs and trees up to four deep."""
    kernel_or_skip()
    model = tiny_model("llama", dtype=torch.bfloat16)
    head = make_head(model, scale=20.0).to(torch.bfloat16)
    sampling = SamplingConfig(temperature)
    tokens_off, off, lean_off = _drafts_through(monkeypatch, model, head, "0", options, sampling)
    tokens_on, on, lean_on = _drafts_through(monkeypatch, model, head, "1", options, sampling)
    assert lean_off == 0 and lean_on >= len(on) - 1 > 3  # every run but the first catch-up
    assert tokens_on == tokens_off and len(on) == len(off)
    for a, b in zip(on, off):
        assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3]))
        assert (a[3] is None and b[3] is None) or torch.equal(a[3], b[3])


def test_lean_step_follows_the_head_weights():
    """Guards the step's cache: it is rebuilt when the head's weights move (``head.to``), absent for
    an fp32 head, for another head type and with the kernels switched off."""
    from selfdraft.heads.eagle1 import Eagle1Config, Eagle1Head
    from selfdraft.heads.lean_step import LEAN_STEP_ENV, lean_step
    kernel_or_skip()
    model = tiny_model("llama", dtype=torch.bfloat16)
    head = make_head(model).to(torch.bfloat16)
    step = lean_step(head)
    assert step is not None and lean_step(head) is step
    head.float()
    assert lean_step(head) is None
    head.bfloat16()
    assert lean_step(head) not in (None, step)
    assert lean_step(Eagle1Head(Eagle1Config.for_target(model), model.get_input_embeddings()).bfloat16()) is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LEAN_STEP_ENV, "0")
        assert lean_step(head) is None
