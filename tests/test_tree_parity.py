"""Tree attention parity and cache compaction on tiny random models of every supported architecture."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, VOCAB, random_prompt, tiny_model

from selfdraft.adapter import UnsupportedModelError, check_supported, new_cache, tree_forward
from selfdraft.tree import chain_tree, tree_from_parents


def random_parents(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


def plain_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_logits_equal_path_logits(models, arch, seed):
    """Guards against wrong tree masks/positions: each node's logits must equal a causal forward on its path."""
    model = models[arch]
    prompt = random_prompt(9, seed)
    tree = tree_from_parents(random_parents(12, seed))
    tokens = torch.randint(3, VOCAB, (tree.size,), generator=torch.Generator().manual_seed(seed + 100))
    cache = new_cache(model, 64)
    with torch.no_grad():
        tree_forward(model, cache, torch.tensor([prompt[:-1]]), chain_tree(len(prompt) - 2))
        tokens[0] = prompt[-1]
        got = tree_forward(model, cache, tokens[None], tree).logits[0]
    for node in range(tree.size):
        path_tokens = tokens[tree.path_to(node)].tolist()
        want = plain_logits(model, prompt[:-1] + path_tokens)[-1]
        err = (got[node] - want).abs().max().item()
        assert err < 1e-4, f"{arch}: node {node} (depth {int(tree.depth[node])}) logits differ by {err:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("leaf", [7, 6, 2, 0])
def test_compacted_cache_equals_rerun(models, arch, leaf):
    """Guards against compaction keeping the wrong KV entries or in the wrong order: paths with gaps
    (root -> 1 -> 2 -> 5 -> 7, root -> 3 -> 6: entries move) and paths already in place (root -> 1 -> 2,
    the root alone: only the length changes)."""
    model = models[arch]
    prompt = random_prompt(7, 3)
    tree = tree_from_parents([-1, 0, 1, 0, 1, 2, 3, 5])
    tokens = torch.randint(3, VOCAB, (tree.size,), generator=torch.Generator().manual_seed(5))
    tokens[0] = prompt[-1]
    cache = new_cache(model, 32)
    with torch.no_grad():
        tree_forward(model, cache, torch.tensor([prompt[:-1]]), chain_tree(len(prompt) - 2))
        prefix = cache.length
        tree_forward(model, cache, tokens[None], tree)
        keep = tree.path_to(leaf)
        cache.compact(prefix, keep)
        ref = new_cache(model, 32)
        accepted = prompt[:-1] + tokens[keep].tolist()
        tree_forward(model, ref, torch.tensor([accepted]), chain_tree(len(accepted) - 1))
    assert cache.length == ref.length == len(accepted), f"lengths {cache.length} vs {ref.length}"
    for layer in range(model.config.num_hidden_layers):
        k, v = cache.key_value(layer)
        rk, rv = ref.key_value(layer)
        err = max((k - rk).abs().max().item(), (v - rv).abs().max().item())
        assert err < 1e-5, f"{arch}: layer {layer} KV differs by {err:.2e} after compaction"


def test_cache_grows_past_initial_allocation(models):
    """Guards against a silent overflow when a sequence outgrows the preallocated cache."""
    model = models["llama"]
    prompt = random_prompt(20, 4)
    cache = new_cache(model, 4)
    with torch.no_grad():
        got = tree_forward(model, cache, torch.tensor([prompt]), chain_tree(len(prompt) - 1)).logits[0]
    want = plain_logits(model, prompt)
    assert cache.length == 20
    assert (got - want).abs().max().item() < 1e-4


def test_unsupported_architecture_raises():
    """Guards against silently running tree masks on a model that would ignore them."""
    model = tiny_model("llama")
    model.config.model_type = "gpt2"
    with pytest.raises(UnsupportedModelError, match="not supported"):
        check_supported(model)
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UnsupportedModelError, match="sdpa"):
        check_supported(model)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("length", [20, 40])
def test_prefill_skips_the_mask_only_where_attention_is_causal(models, arch, length, monkeypatch):
    """Guards the mask-free prefill: a chain of more than FUSED_ATTENTION_MAX_QUERIES tokens on an
    empty cache within the sliding window (gemma3's widened to 32 here) runs without a mask and equals
    the masked forward in logits, states and KV; a longer prompt under a window, a tree on an empty
    cache, a chain after a prefix and a short prompt keep their masks."""
    import selfdraft.adapter as adapter

    model = models[arch]
    if arch == "gemma3":
        model = tiny_model(arch)
        model.config.sliding_window = 32
    prompt = random_prompt(length, 7)
    masks = []
    forward = type(model).forward

    def spy(self, *args, **kwargs):
        masks.append(kwargs.get("attention_mask"))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", spy)  # on the class: the shared model keeps no attribute
    chain = chain_tree(length - 1)
    with torch.no_grad():
        cache = new_cache(model, 64)
        got = tree_forward(model, cache, torch.tensor([prompt]), chain, (0, -1))
        causal = length <= (getattr(model.config, "sliding_window", None) or length)
        assert (masks[-1] is None) == causal, f"{arch}: prompt of {length} ran with mask {type(masks[-1])}"
        ref = new_cache(model, 64)
        with monkeypatch.context() as m:
            m.setattr(adapter, "within_window", lambda model, n: False)
            want = tree_forward(model, ref, torch.tensor([prompt]), chain, (0, -1))
        assert masks[-1] is not None
        assert torch.equal(got.logits, want.logits)
        assert all(torch.equal(got.hidden_states[i], want.hidden_states[i]) for i in (0, -1))
        for layer in range(model.config.num_hidden_layers):
            assert all(torch.equal(a, b) for a, b in zip(cache.key_value(layer), ref.key_value(layer)))
        tree_forward(model, cache, torch.tensor([prompt]), chain)  # after a prefix
        assert masks[-1] is not None
        tree = tree_from_parents(list(range(-1, length - 2)) + [length - 3])
        assert not tree.is_chain
        tree_forward(model, new_cache(model, 64), torch.tensor([prompt]), tree)  # a tree, empty cache
        assert masks[-1] is not None
        tree_forward(model, new_cache(model, 64), torch.tensor([prompt[:16]]), chain_tree(15))  # short
        assert masks[-1] is not None
