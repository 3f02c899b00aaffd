"""EAGLE-1 head: loss by hand, exact greedy drafting through the dynamic tree, save/load, no copies."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, random_prompt, tiny_model

from selfdraft.drafters.eagle import EagleDrafter
from selfdraft.generate import GenerationConfig, generate
from selfdraft.heads import Eagle1Config, Eagle1Head, load_head, save
from selfdraft.heads.eagle1 import eagle1_loss, next_rows, trained_positions


def make_head(model, seed=0, scale=1.0):
    torch.manual_seed(seed)
    head = Eagle1Head(Eagle1Config.for_target(model), model.get_input_embeddings(), model.get_output_embeddings())
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05 * scale)
    return head.eval()


def manual_predictions(head, features, ids):
    """Reference forward with an explicit loop over positions (no masks)."""
    b, s, _ = features.shape
    tok = torch.cat([ids[:, 1:], ids.new_zeros(b, 1)], 1)
    x = head.fc(torch.cat([head.embed(tok), features], -1))
    layer = head.layers[0]
    q, k, v = layer.self_attn.project(x, torch.arange(s)[None])
    out = torch.zeros_like(x)
    for t in range(s):
        allow = torch.ones(1, 1, 1, t + 1, dtype=torch.bool)
        h = x[:, t : t + 1] + layer.self_attn.attend(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], allow)
        out[:, t] = (h + layer.mlp(layer.post_attention_layernorm(h)))[:, 0]
    return out


def test_eagle1_loss_matches_hand_computation():
    """Guards the EAGLE-1 loss: feature shift, smooth-L1, soft CE through the target lm_head, masks."""
    model = tiny_model("llama")
    head = make_head(model)
    torch.manual_seed(1)
    b, s, hdim = 1, 6, model.config.hidden_size
    features = torch.randn(b, s, hdim)
    ids = torch.randint(3, VOCAB, (b, s))
    target_logits = torch.randn(b, s, VOCAB)
    lmask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    attn = torch.ones(b, s, dtype=torch.long)
    with torch.no_grad():
        loss, losses, accs = eagle1_loss(head, features, ids, target_logits, lmask, attn, 1.0, 0.25)
        pred = manual_predictions(head, features, ids)
    feat_terms, tok_terms, hits = [], [], []
    for t in range(s - 2):  # t+1 must be trained, t+2 must exist
        if lmask[0, t + 1]:
            feat_terms.append(torch.nn.functional.smooth_l1_loss(pred[0, t], features[0, t + 1], reduction="none"))
            p = torch.softmax(target_logits[0, t + 1], -1)
            logq = torch.log_softmax(head.logits(pred[0, t]), -1)
            tok_terms.append(-(p * logq).sum())
            hits.append(float(logq.argmax() == p.argmax()))
    want_feat = torch.cat(feat_terms).mean()
    want_tok = torch.stack(tok_terms).mean()
    assert torch.allclose(losses[0], want_feat, atol=1e-5), (losses[0], want_feat)
    assert torch.allclose(losses[1], want_tok, atol=1e-5), (losses[1], want_tok)
    assert torch.allclose(loss, want_feat + 0.25 * want_tok, atol=1e-5)
    assert abs(float(accs[0]) - sum(hits) / len(hits)) < 1e-6


def test_eagle1_loss_takes_the_rows_it_reads():
    """Guards training's shortcut: the target's logits given only at the rows the loss reads (t+1 of
    each trained position, row-major; what train.py projects) give the full-logits loss, padding included."""
    model = tiny_model("llama")
    head = make_head(model)
    torch.manual_seed(3)
    features = torch.randn(2, 7, model.config.hidden_size)
    ids = torch.randint(3, VOCAB, (2, 7))
    target_logits = torch.randn(2, 7, VOCAB)
    lmask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0]])
    attn = torch.tensor([[1] * 7, [1, 1, 1, 1, 1, 0, 0]])
    rows = next_rows(target_logits, trained_positions(lmask, attn))
    assert rows.shape[0] == 4 + 3  # t = 1..4 of the first; t = 0..2 of the second (t+2 = 4 its last real token)
    with torch.no_grad():
        full = eagle1_loss(head, features, ids, target_logits, lmask, attn, 1.0, 0.25)
        picked = eagle1_loss(head, features, ids, rows, lmask, attn, 1.0, 0.25)
    assert torch.allclose(full[0], picked[0]) and torch.allclose(full[1][1], picked[1][1])


def test_eagle1_training_steps_lower_loss():
    """Guards that gradients reach the head (and only the head): a few steps lower the loss."""
    model = tiny_model("llama")
    head = make_head(model).train()
    torch.manual_seed(2)
    ids = torch.randint(3, VOCAB, (2, 12))
    attn = torch.ones_like(ids)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=[-1])
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    before = [p.clone() for p in model.parameters()]
    losses = []
    for _ in range(15):
        loss, _, _ = head(out.hidden_states[-1], ids, out.logits, attn, attn)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "target weights changed"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_eagle1_tree_drafting_is_exact(models, arch):
    """Guards EAGLE-1 drafting (post-norm features, full-vocab lm_head): greedy equals plain greedy."""
    model = models[arch]
    head = make_head(model, scale=20.0)
    for i in range(5):
        prompt = random_prompt(3 + 6 * i, i)
        ref = generate(model, prompt, None, GenerationConfig(max_new_tokens=18)).tokens
        out = generate(model, prompt, EagleDrafter(head, depth=3, top_k=3, total_tokens=8),
                       GenerationConfig(max_new_tokens=18))
        assert out.tokens == ref, f"{arch} prompt {i}"


def test_eagle1_drafts_a_trained_continuation():
    """Guards the drafter wiring end to end: a head fit to the target's own features gets accepted."""
    model = tiny_model("llama")
    head = make_head(model).train()
    prompt = random_prompt(6, 5)
    ref = generate(model, prompt, None, GenerationConfig(max_new_tokens=40)).tokens
    ids = torch.tensor([prompt + ref])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=[-1])
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    attn = torch.ones_like(ids)
    for _ in range(150):
        loss, _, _ = head(out.hidden_states[-1], ids, out.logits, attn, attn, 1.0, 1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval()
    res = generate(model, prompt, EagleDrafter(head, depth=4, top_k=2, total_tokens=8), GenerationConfig(max_new_tokens=40))
    assert res.tokens == ref
    assert res.stats.tau > 2.0, f"a head fit to this very sequence should be accepted often, tau {res.stats.tau:.2f}"


def test_eagle1_save_load_round_trip(tmp_path):
    """Guards the EAGLE-1 head folder: bit-identical tensors, target embedding and lm_head never saved."""
    model = tiny_model("llama")
    head = make_head(model)
    path = save(tmp_path / "e1", "eagle1", head.cfg, head, model, "tiny")
    kind, loaded, _ = load_head(path, model)
    assert kind == "eagle1"
    keys = sorted(head.state_dict())
    assert keys == sorted(loaded.state_dict())
    assert all(torch.equal(head.state_dict()[k], loaded.state_dict()[k]) for k in keys)
    assert keys == sorted([
        "fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
        "layers.0.post_attention_layernorm.weight", "layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
    ]), keys
    assert loaded.lm_head is model.get_output_embeddings() and loaded.embed is model.get_input_embeddings()
