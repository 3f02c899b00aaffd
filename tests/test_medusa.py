"""Medusa heads: identity at init, hand-computed loss, distinct parameters, exact greedy drafting, save/load."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, random_prompt, tiny_model

from selfdraft.drafters import build_drafter
from selfdraft.drafters.medusa import MedusaDrafter
from selfdraft.generate import GenerationConfig, generate
from selfdraft.heads import HeadMismatchError, MedusaConfig, MedusaHeads, load_head, save
from selfdraft.heads.medusa import medusa_loss


def make_heads(model, share=True, k=3, seed=0):
    torch.manual_seed(seed)
    cfg = MedusaConfig(model.config.hidden_size, model.config.vocab_size, num_heads=k, share_lm_head=share)
    return cfg, MedusaHeads(cfg, model.get_output_embeddings())


@pytest.mark.parametrize("share", [True, False])
def test_fresh_heads_equal_base_prediction(share):
    """Guards zero-init: before training every head reproduces the target's own lm_head."""
    model = tiny_model("llama")
    _, heads = make_heads(model, share)
    h = torch.randn(2, 5, model.config.hidden_size)
    want = model.lm_head(h)
    got = heads(h)
    assert got.shape == (3, 2, 5, VOCAB)
    assert (got - want).abs().max() < 1e-5


def test_heads_own_distinct_parameters():
    """Guards against module aliasing (all heads secretly sharing one block)."""
    model = tiny_model("llama")
    _, heads = make_heads(model, share=False)
    ptrs = [p.data_ptr() for p in heads.parameters()]
    assert len(ptrs) == len(set(ptrs)), "two head parameters share storage"
    assert not any(p is model.lm_head.weight for p in heads.parameters())


def test_medusa_loss_matches_hand_computation():
    """Guards the label shift: head k at position t is scored against token t+k+2, masked; and the
    vocabulary projection runs at the scored positions only (its rows are most of a training step)."""
    model = tiny_model("llama")
    _, heads = make_heads(model, share=False, k=2)
    for block in heads.blocks:  # not the identity, so each head's logits differ
        torch.nn.init.normal_(block[0].linear.weight, std=0.5)
    h = torch.randn(1, 6, model.config.hidden_size)
    ids = torch.randint(0, VOCAB, (1, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    projected = []
    for lm_head in heads.lm_heads:
        lm_head.register_forward_hook(lambda mod, args, out: projected.append(args[0].shape[0]))
    loss, losses, _ = medusa_loss(heads, h, ids, mask, decay=0.5)
    assert projected == [3, 2]
    with torch.no_grad():
        lp = torch.log_softmax(heads(h), -1)
    # head 0: positions t with mask[t+2]: t=0,1,2 -> targets ids[2..4]
    h0 = -(lp[0, 0, 0, ids[0, 2]] + lp[0, 0, 1, ids[0, 3]] + lp[0, 0, 2, ids[0, 4]]) / 3
    # head 1: shift 3: mask[3], mask[4], mask[5] -> t=0,1
    h1 = -(lp[1, 0, 0, ids[0, 3]] + lp[1, 0, 1, ids[0, 4]]) / 2
    assert torch.allclose(losses[0], h0, atol=1e-5) and torch.allclose(losses[1], h1, atol=1e-5)
    assert torch.allclose(loss, h0 + 0.5 * h1, atol=1e-5)


def test_medusa_drafting_is_exact_and_perturbed_heads_still_exact():
    """Guards the Medusa drafter under greedy verification: output equals plain greedy."""
    model = tiny_model("llama")
    _, heads = make_heads(model)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    for i in range(5):
        prompt = random_prompt(5 + 3 * i, i)
        ref = generate(model, prompt, None, GenerationConfig(max_new_tokens=20)).tokens
        out = generate(model, prompt, MedusaDrafter(heads.eval()), GenerationConfig(max_new_tokens=20))
        assert out.tokens == ref, f"prompt {i}"


def test_save_load_roundtrip_and_refuses_other_target(tmp_path):
    """Guards head folders: bit-identical tensors back, a mismatched target or a broken file refused."""
    model = tiny_model("llama")
    cfg, heads = make_heads(model, share=False)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p))
    path = save(tmp_path / "head", "medusa", cfg, heads, model, "tiny")
    kind, loaded, meta = load_head(path, model)
    assert kind == "medusa" and meta["target"]["name"] == "tiny"
    for (k, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    drafter = build_drafter("head", model, path=str(path))
    assert isinstance(drafter, MedusaDrafter)
    with pytest.raises(HeadMismatchError, match="fingerprint"):
        load_head(path, tiny_model("llama", seed=1))
    with pytest.raises(HeadMismatchError, match="model_type|vocab|hidden"):
        load_head(path, tiny_model("qwen3"))
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(HeadMismatchError, match="corrupt or truncated"):
        load_head(path, model)
