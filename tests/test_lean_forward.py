"""The lean decode forward (selfdraft/lean_forward.py): bit-identical to the Hugging Face forward with
the fused kernels where it applies, out of the way everywhere else."""

from __future__ import annotations

import pytest
import torch
from conftest import kernel_or_skip as kernel
from conftest import random_prompt, tiny_model
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import selfdraft.adapter as adapter
import selfdraft.lean_forward as lean
from selfdraft import kernels
from selfdraft.adapter import new_cache, shallow_view, tree_forward
from selfdraft.tree import chain_tree, tree_from_parents


@pytest.mark.parametrize("heads,d", [(4, 8), (9, 64), (3, 2)])
def test_rope_kernel_rounds_as_eager_bf16(heads, d):
    """The rotary kernel equals HF's apply_rotary_pos_emb in bf16 bit for bit (three roundings per
    element), for per-row and shared cos/sin."""
    k = kernel()
    g = torch.Generator().manual_seed(heads * d)
    for batch, cos_batch in ((1, 1), (2, 2), (2, 1)):
        x = (torch.randn(batch, 5, heads, d, generator=g) * 3).bfloat16()
        angles = torch.rand(cos_batch, 5, d // 2, generator=g) * 40
        cos, sin = torch.cat([angles.cos()] * 2, -1).bfloat16(), torch.cat([angles.sin()] * 2, -1).bfloat16()
        want, _ = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
        assert torch.equal(k.bf16_rope(x, cos, sin), want.transpose(1, 2))
    with pytest.raises(RuntimeError, match="positions, head_dim"):
        k.bf16_rope(x, cos[:, :4], sin[:, :4])
    with pytest.raises(RuntimeError, match="bfloat16"):
        k.bf16_rope(x.float(), cos, sin)


def forward_both(monkeypatch, model, prompt, trees, hidden_layers=(), last_logits_only=False):
    """Per tree: (HF forward's output and cache, lean forward's output and cache), each after the same
    prefill; counts the lean forwards actually taken."""
    taken = {"lean": 0}
    real = adapter.lean_forward

    def counting(*args, **kwargs):
        taken["lean"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(adapter, "lean_forward", counting)
    results = []
    for tree in trees:
        pair = []
        for on in ("0", "1"):
            monkeypatch.setenv(lean.LEAN_ENV, on)
            cache = new_cache(model, 96)
            with torch.inference_mode():
                tree_forward(model, cache, prompt, chain_tree(prompt.shape[1] - 1), last_logits_only=True)
                tokens = torch.tensor([random_prompt(tree.size, tree.size)])
                out = tree_forward(model, cache, tokens, tree, hidden_layers, last_logits_only)
            pair.append((out, cache))
        results.append(pair)
    return results, taken["lean"]


def assert_same(hf, lean_out):
    (a, cache_a), (b, cache_b) = hf, lean_out
    assert a.logits.dtype == b.logits.dtype == torch.bfloat16
    assert torch.equal(a.logits, b.logits)
    assert (a.hidden_states is None) == (b.hidden_states is None)
    if a.hidden_states is not None:
        assert sorted(a.hidden_states) == sorted(b.hidden_states)
        for i in a.hidden_states:
            assert torch.equal(a.hidden_states[i], b.hidden_states[i]), f"hidden state {i}"
    assert cache_a.length == cache_b.length
    for la, lb in zip(cache_a.layers, cache_b.layers):
        assert torch.equal(la.keys[:, :, : la.length], lb.keys[:, :, : lb.length])
        assert torch.equal(la.values[:, :, : la.length], lb.values[:, :, : lb.length])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "gemma3-softcap"])
def test_lean_forward_is_bit_identical_to_the_hf_forward(monkeypatch, arch):
    """Decode steps, chains and branching trees after a prefill: same logits, hidden states (HF's
    numbering, negative indices included) and cache entries as the HF forward with the fused kernels.
    Qwen2 adds q/k/v biases; Gemma-3 q/k norms, sliding-window layers (the 50-token prefix is past the
    tiny model's window of 6), four norms per layer, scaled embeddings and optionally final logit
    soft-capping. The layer-skip view of the target takes it too. Where bf16 is native the HF forward
    gives products past 6 rows to oneDNN; here it keeps them on the kernel, as the lean forward does."""
    kernel()
    monkeypatch.setattr(kernels, "FUSED_MAX_ROWS_NATIVE", kernels.FUSED_MAX_ROWS)
    monkeypatch.setattr(kernels, "FUSED_MAX_ROWS_AVX512", kernels.FUSED_MAX_ROWS)
    model = tiny_model(arch.removesuffix("-softcap"), dtype=torch.bfloat16)
    if arch.endswith("-softcap"):
        model.config.final_logit_softcapping = 3.0  # HF's forward reads it per call; the plan is built after
    prompt = torch.tensor([random_prompt(kernels.FUSED_MAX_ROWS + 2, 1)])  # the prefill itself takes HF's forward
    trees = [chain_tree(0), chain_tree(3), tree_from_parents([-1, 0, 0, 1, 1, 3, 4]),
             tree_from_parents([-1, 0, 0, 1, 1, 2, 3, 3, 4, 6, 7, 7, 9, 10, 12, 13])]
    assert max(len(t.parents) for t in trees) <= lean.lean_max_rows()
    layers = model.config.num_hidden_layers
    for hidden, last_only in (((), False), ((0, 1, layers - 1, -1), False), ((2, layers), True)):
        results, taken = forward_both(monkeypatch, model, prompt, trees, hidden, last_only)
        assert taken == len(trees)  # one per tree: the lean one; the prefills and HF forwards are not
        for hf, lean_out in results:
            assert_same(hf, lean_out)
    view = shallow_view(model, 2)
    results, taken = forward_both(monkeypatch, view, prompt, trees[:2], (1, -1))
    assert taken == 2
    for hf, lean_out in results:
        assert_same(hf, lean_out)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_lean_forward_allocates_and_grows_the_cache_itself(monkeypatch, arch):
    """The decoder-stack kernel writes the cache buffers directly: a short prompt's first forward (lean,
    on a cache not yet allocated) and steps past the initial allocation of 4 positions give the same
    logits and cache as the HF forward."""
    kernel()
    model = tiny_model(arch, dtype=torch.bfloat16)
    taken, real = [], adapter.lean_forward
    monkeypatch.setattr(adapter, "lean_forward", lambda *a, **k: taken.append(1) or real(*a, **k))
    runs = []
    for on in ("0", "1"):
        monkeypatch.setenv(lean.LEAN_ENV, on)
        cache, logits = new_cache(model, 4), []
        with torch.inference_mode():
            for step, n in enumerate((6, 1, 4, 4)):
                tokens = torch.tensor([random_prompt(n, step)])
                logits.append(tree_forward(model, cache, tokens, chain_tree(n - 1)).logits)
        runs.append((logits, cache))
    (hf_logits, hf_cache), (lean_logits, lean_cache) = runs
    assert len(taken) == 4  # every forward of the second run
    assert all(torch.equal(a, b) for a, b in zip(hf_logits, lean_logits))
    assert hf_cache.length == lean_cache.length == 15
    for la, lb in zip(hf_cache.layers, lean_cache.layers):
        assert torch.equal(la.keys[:, :, :15], lb.keys[:, :, :15])
        assert torch.equal(la.values[:, :, :15], lb.values[:, :, :15])


def test_lean_forward_declines_other_architectures():
    """Qwen3 (q/k norms in a layer the plan does not describe) keeps HF's forward."""
    k = kernel()
    assert lean.lean_plan(tiny_model("qwen3", dtype=torch.bfloat16), k) is None


@pytest.mark.parametrize("amx", [False, True])
def test_verification_trees_past_the_prompt_limit_stay_on_the_kernels(monkeypatch, amx):
    """Guards greedy identity for large trees where bf16 is native: a verification of more nodes than
    a prompt forward keeps on the kernels (lean_max_rows(): 16, 24 on AMX) still takes the lean forward,
    and every row's logits are the bits of the one-token step plain decoding runs there; a prompt of
    that size takes the model's own forward. (Until the forty-fourth session such a tree went through
    the model's forward, whose products past 16 rows oneDNN rounds differently: an EAGLE head's
    default 17-node tree drifted from plain decoding on an AVX512-BF16 CPU.)"""
    kernel()
    monkeypatch.setattr(kernels, "native_bf16_matmul", lambda device_type="cpu": True)
    monkeypatch.setattr(kernels, "amx_bf16_products", lambda: amx)
    model = tiny_model("llama", dtype=torch.bfloat16)
    n = lean.lean_max_rows() + 4
    prompt = torch.tensor([random_prompt(n, 3)])
    tokens = torch.tensor([random_prompt(n, 4)])
    taken = []
    real = adapter.lean_forward
    monkeypatch.setattr(adapter, "lean_forward", lambda *a, **kw: taken.append(a[3].shape[-1]) or real(*a, **kw))
    with torch.inference_mode():
        cache = new_cache(model, 3 * n)
        tree_forward(model, cache, prompt, chain_tree(n - 1), last_logits_only=True)
        assert taken == []  # the prompt: the model's own forward
        tree = tree_from_parents([-1] + [i // 2 for i in range(n - 1)])  # a branching tree of n nodes
        verified = tree_forward(model, cache, tokens, tree).logits[0]
        assert taken == [n]
        for node in range(n):  # each node as a one-token step after its own path
            path = [node]
            while tree.parents[path[-1]] >= 0:
                path.append(tree.parents[path[-1]])
            step_cache = new_cache(model, 3 * n)
            tree_forward(model, step_cache, prompt, chain_tree(n - 1), last_logits_only=True)
            for i in reversed(path):
                step = tree_forward(model, step_cache, tokens[:, i : i + 1], chain_tree(0)).logits[0, 0]
            assert torch.equal(verified[node], step), f"node {node} of {n}"


def test_lean_forward_applies_only_where_it_reproduces_the_forward(monkeypatch):
    k = kernel()
    model = tiny_model("llama", dtype=torch.bfloat16)
    cache = new_cache(model, 64)
    small, wide = torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, kernels.FUSED_MAX_ROWS + 1, dtype=torch.long)
    with torch.inference_mode():
        assert lean.lean_applies(model, cache, small) is not None
        assert lean.lean_applies(model, cache, wide) is None  # too many rows for a prompt on the kernels
        assert lean.lean_applies(model, cache, wide, verification=True) is not None  # a verification: any size
        batch = torch.zeros(2, 12, dtype=torch.long)  # 24 rows: past the limit where bf16 is native (not on AMX)
        for native, amx in ((True, False), (True, True), (False, False)):
            with monkeypatch.context() as m:
                m.setattr(kernels, "native_bf16_matmul", lambda device_type="cpu", native=native: native)
                m.setattr(kernels, "amx_bf16_products", lambda amx=amx: amx)
                limit = kernels.FUSED_MAX_ROWS if not native else lean.LEAN_MAX_ROWS_AMX if amx else lean.LEAN_MAX_ROWS_NATIVE
                assert lean.lean_max_rows() == limit
                assert lean.lean_applies(model, cache, wide[:, :16]) is not None
                # a prompt of more tokens than the HF route's attention kernel takes stays on the kernels
                tree = wide[:, : kernels.FUSED_ATTENTION_MAX_QUERIES + 8]
                assert (lean.lean_applies(model, cache, tree) is None) == (native and not amx)
                assert (lean.lean_applies(model, new_cache(model, 64), batch) is None) == (native and not amx)
                assert (lean.lean_applies(model, cache, wide[:, : lean.LEAN_MAX_ROWS_AMX + 1]) is None) == native
        monkeypatch.setenv(lean.LEAN_ENV, "0")
        assert lean.lean_applies(model, cache, small) is None
        monkeypatch.delenv(lean.LEAN_ENV)
        from selfdraft.cache import RaggedCache

        assert lean.lean_applies(model, RaggedCache(model.config.num_hidden_layers, 1, 64), small) is None
    assert lean.lean_applies(model, cache, small) is None  # gradients on (training, say)
    assert lean.lean_plan(tiny_model("llama"), k) is None  # fp32 weights: no bf16 kernels
    # a module whose forward is replaced (a hook, an adapter): declined, and not remembered as declined
    other = tiny_model("llama", seed=1, dtype=torch.bfloat16)
    proj = other.model.layers[0].mlp.up_proj
    vars(proj)["forward"] = lambda x: x
    assert lean.lean_plan(other, k) is None
    del vars(proj)["forward"]
    assert lean.lean_plan(other, k) is not None
