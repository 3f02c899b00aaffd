"""Export to serving-engine layouts and import back: exact manifests, bit-identical round trips, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, _common, char_tokenizer, random_prompt, tiny_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from selfdraft.config import ConfigError, from_dict
from selfdraft.export import (
    FORMATS,
    MANIFEST,
    ExportConfig,
    ExportError,
    detect_format,
    export_head,
    import_head,
    push_to_hub,
)
from selfdraft.generate import GenerationConfig, generate
from selfdraft.heads import (
    HEADS,
    Eagle1Config,
    Eagle1Head,
    Eagle3Config,
    Eagle3Head,
    HeadMismatchError,
    MedusaConfig,
    MedusaHeads,
    load_head,
    save,
)
from selfdraft.heads.artifact import read_head
from selfdraft.heads.eagle3 import select_draft_vocab

F32, I64, BOOL = torch.float32, torch.int64, torch.bool
# small trees: the round trips compare drafting, they do not measure it
DRAFTER_OPTIONS = {
    "eagle3": dict(depth=3, top_k=2, total_tokens=6),
    "eagle1": dict(depth=3, top_k=2, total_tokens=6),
    "medusa": dict(paths=[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]),
}


def llama8(seed: int = 0) -> torch.nn.Module:
    """Tiny llama with 8 layers, so the engines' EAGLE-3 feature layers (2, 4, 5) are distinct."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(**_common(head_dim=8, num_hidden_layers=8))
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return model.eval().requires_grad_(False)


def perturb(head: torch.nn.Module, scale: float, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * scale)
    return head.eval()


def build_head(name: str, model: torch.nn.Module, scale: float = 1.0):
    """(head type, config, module) for the named test head on ``model``, weights perturbed by ``scale``."""
    if name == "eagle3":
        head = perturb(Eagle3Head(Eagle3Config.for_target(model, 48), model.get_input_embeddings()), scale)
        head.set_draft_vocab(select_draft_vocab(torch.arange(VOCAB).flip(0).float(), 48))
        return "eagle3", head.cfg, head
    if name in ("eagle1", "eagle1-zero-bias", "eagle1-no-bias"):
        cfg = Eagle1Config.for_target(model)
        if name == "eagle1-no-bias":
            cfg = Eagle1Config(**{**cfg.__dict__, "fc_bias": False})
        head = perturb(Eagle1Head(cfg, model.get_input_embeddings(), model.get_output_embeddings()), 0.3 * scale)
        if name == "eagle1-zero-bias":
            with torch.no_grad():
                head.fc.bias.zero_()
        return "eagle1", cfg, head
    share = name == "medusa-shared"
    cfg = MedusaConfig(model.config.hidden_size, model.config.vocab_size, num_heads=3 if share else 2,
                       num_layers=1 if share else 2, share_lm_head=share)
    return "medusa", cfg, perturb(MedusaHeads(cfg, model.get_output_embeddings()), 0.3 * scale)


@pytest.fixture(scope="module")
def target():
    return llama8()


@pytest.fixture(scope="module")
def head_dirs(target, tmp_path_factory):
    """Own-format head folders for every test head on the 8-layer llama."""
    root = tmp_path_factory.mktemp("heads")
    names = ("eagle3", "eagle1", "eagle1-zero-bias", "eagle1-no-bias", "medusa-shared", "medusa-own")
    out = {}
    for name in names:
        kind, cfg, head = build_head(name, target)
        out[name] = save(root / name, kind, cfg, head, target, "tiny-llama-8")
    return out


# -- explicit expected layouts, written from the engines' loaders ---------------------------------

LLAMA_FIELDS = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "rope_scaling": None, "max_position_embeddings": 256, "vocab_size": 96,
    "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "float32",
}
EAGLE1_LAYER = {
    "layers.0.self_attn.q_proj.weight": ((32, 32), F32), "layers.0.self_attn.k_proj.weight": ((16, 32), F32),
    "layers.0.self_attn.v_proj.weight": ((16, 32), F32), "layers.0.self_attn.o_proj.weight": ((32, 32), F32),
    "layers.0.post_attention_layernorm.weight": ((32,), F32), "layers.0.mlp.gate_proj.weight": ((64, 32), F32),
    "layers.0.mlp.up_proj.weight": ((64, 32), F32), "layers.0.mlp.down_proj.weight": ((32, 64), F32),
}
EXPECTED = {
    ("eagle3", "eagle3"): ("model.safetensors", {
        "architectures": ["LlamaForCausalLMEagle3"], **LLAMA_FIELDS, "draft_vocab_size": 48, "bias": False,
    }, {
        "fc.weight": ((32, 96), F32), "midlayer.input_layernorm.weight": ((32,), F32),
        "midlayer.hidden_norm.weight": ((32,), F32), "midlayer.self_attn.q_proj.weight": ((32, 64), F32),
        "midlayer.self_attn.k_proj.weight": ((16, 64), F32), "midlayer.self_attn.v_proj.weight": ((16, 64), F32),
        "midlayer.self_attn.o_proj.weight": ((32, 32), F32), "midlayer.post_attention_layernorm.weight": ((32,), F32),
        "midlayer.mlp.gate_proj.weight": ((64, 32), F32), "midlayer.mlp.up_proj.weight": ((64, 32), F32),
        "midlayer.mlp.down_proj.weight": ((32, 64), F32), "norm.weight": ((32,), F32),
        "lm_head.weight": ((48, 32), F32), "d2t": ((48,), I64), "t2d": ((96,), BOOL),
    }),
    ("eagle1", "eagle1"): ("model.safetensors", {"architectures": ["LlamaForCausalLM"], **LLAMA_FIELDS, "bias": True},
                           {"fc.weight": ((32, 64), F32), "fc.bias": ((32,), F32), **EAGLE1_LAYER}),
    ("eagle1", "eagle1-no-bias"): ("model.safetensors", {"architectures": ["LlamaForCausalLM"], **LLAMA_FIELDS, "bias": False},
                                   {"fc.weight": ((32, 64), F32), **EAGLE1_LAYER}),
    ("eagle1-vllm", "eagle1-zero-bias"): ("model.safetensors", {"architectures": ["LlamaForCausalLM"], **LLAMA_FIELDS, "bias": False},
                                          {"fc.weight": ((32, 64), F32), **EAGLE1_LAYER}),
    ("eagle1-sglang", "eagle1-no-bias"): ("model.safetensors", {"architectures": ["LlamaForCausalLMEagle"], **LLAMA_FIELDS},
                                          {"fc.weight": ((32, 64), F32), "fc.bias": ((32,), F32), **EAGLE1_LAYER}),
    ("medusa", "medusa-shared"): ("medusa_lm_head.safetensors", {
        "medusa_num_heads": 3, "medusa_num_layers": 1, "base_model_name_or_path": "tiny-llama-8",
        "hidden_size": 32, "vocab_size": 96, "torch_dtype": "float32",
    }, {
        **{f"{i}.0.linear.weight": ((32, 32), F32) for i in range(3)},
        **{f"{i}.0.linear.bias": ((32,), F32) for i in range(3)},
        **{f"{i}.1.weight": ((96, 32), F32) for i in range(3)},
    }),
    ("medusa", "medusa-own"): ("medusa_lm_head.safetensors", {
        "medusa_num_heads": 2, "medusa_num_layers": 2, "base_model_name_or_path": "tiny-llama-8",
        "hidden_size": 32, "vocab_size": 96, "torch_dtype": "float32",
    }, {
        **{f"{i}.{j}.linear.weight": ((32, 32), F32) for i in range(2) for j in range(2)},
        **{f"{i}.{j}.linear.bias": ((32,), F32) for i in range(2) for j in range(2)},
        **{f"{i}.2.weight": ((96, 32), F32) for i in range(2)},
    }),
    ("medusa-vllm", "medusa-shared"): ("model.safetensors", {
        "architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": 3, "num_hidden_layers": 1,
        "hidden_size": 32, "vocab_size": 96, "truncated_vocab_size": 96, "medusa_fc_bias": True,
        "original_lm_head": True, "torch_dtype": "float32",
    }, {
        **{f"blocks.{i}.layers.0.weight": ((32, 32), F32) for i in range(3)},
        **{f"blocks.{i}.layers.0.bias": ((32,), F32) for i in range(3)},
        "lm_heads.0.weight": ((96, 32), F32),
    }),
    ("medusa-vllm", "medusa-own"): ("model.safetensors", {
        "architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": 2, "num_hidden_layers": 2,
        "hidden_size": 32, "vocab_size": 96, "truncated_vocab_size": 96, "medusa_fc_bias": True,
        "original_lm_head": False, "torch_dtype": "float32",
    }, {
        **{f"blocks.{i}.layers.{j}.weight": ((32, 32), F32) for i in range(2) for j in range(2)},
        **{f"blocks.{i}.layers.{j}.bias": ((32,), F32) for i in range(2) for j in range(2)},
        **{f"lm_heads.{i}.weight": ((96, 32), F32) for i in range(2)},
    }),
}


def test_every_format_has_an_expected_layout():
    """Guards against a format added to the registry without an explicit manifest test."""
    assert {fmt for fmt, _ in EXPECTED} == set(FORMATS), sorted(set(FORMATS) - {fmt for fmt, _ in EXPECTED})


@pytest.mark.parametrize("fmt,head", list(EXPECTED), ids=[f"{f}-{h}" for f, h in EXPECTED])
def test_export_matches_engine_layout(fmt, head, target, head_dirs, tmp_path):
    """Guards key names, shapes, dtypes and config fields the engines' loaders read (no extra or missing)."""
    out = export_head(head_dirs[head], fmt, tmp_path / "out", target)
    weights, config, tensors = EXPECTED[(fmt, head)]
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", MANIFEST, weights])
    assert json.loads((out / "config.json").read_text()) == config
    got = load_file(str(out / weights))
    assert {k: (tuple(v.shape), v.dtype) for k, v in got.items()} == tensors
    assert "embed_tokens.weight" not in got, "never ship a copy (or a random) embedding"
    own = read_head(head_dirs[head])[1]
    lm = target.get_output_embeddings().weight
    if head == "medusa-shared":  # the shared projection is materialised from the target's lm_head
        for k in [k for k in got if k.endswith(".1.weight") or k.startswith("lm_heads.")]:
            assert torch.equal(got[k], lm), k
    for k, v in own.items():  # tensors the engines keep under the same name are copied unchanged
        if k in got:
            assert torch.equal(got[k], v), k
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["format"] == fmt and manifest["target"] == read_head(head_dirs[head])[0]["target"]


def drafted(model, path, prompts, tokens):
    """Greedy outputs and tau of the head folder at ``path`` driven through its registry drafter."""
    kind, head, _ = load_head(path, model)
    outs = [generate(model, p, HEADS[kind].drafter(head, **DRAFTER_OPTIONS[kind]), GenerationConfig(max_new_tokens=tokens))
            for p in prompts]
    return [o.tokens for o in outs], [o.stats.tau for o in outs]


def round_trip(model, src, fmt, tmp_path) -> Path:
    """own -> fmt -> own; asserts the own folder comes back bit for bit (config.json and tensors)."""
    out = export_head(src, fmt, tmp_path / f"{fmt}-engine", model)
    assert detect_format(out) == fmt
    back = import_head(out, tmp_path / f"{fmt}-own", model)
    (m1, t1), (m2, t2) = read_head(src), read_head(back)
    assert m1 == m2, (m1, m2)
    assert t1.keys() == t2.keys(), sorted(set(t1) ^ set(t2))
    for k in t1:
        assert t1[k].dtype == t2[k].dtype and torch.equal(t1[k], t2[k]), k
    return back


def assert_round_trip(model, src, fmt, tmp_path, prompts, tokens=16):
    back = round_trip(model, src, fmt, tmp_path)
    ref = [generate(model, p, None, GenerationConfig(max_new_tokens=tokens)).tokens for p in prompts]
    tok1, tau1 = drafted(model, src, prompts, tokens)
    tok2, tau2 = drafted(model, back, prompts, tokens)
    assert tok1 == tok2 == ref, (tok1, tok2, ref)
    assert tau1 == tau2, (tau1, tau2)


@pytest.mark.parametrize("fmt,head", list(EXPECTED), ids=[f"{f}-{h}" for f, h in EXPECTED])
def test_round_trip_is_bit_identical_and_drafts_the_same(fmt, head, target, head_dirs, tmp_path):
    """Guards own -> format -> own: identical tensors, config.json, greedy tokens and tau."""
    assert_round_trip(target, head_dirs[head], fmt, tmp_path, [random_prompt(6, 0), random_prompt(9, 1)])


@pytest.mark.parametrize("fmt,name", [("eagle3", "eagle3"), ("eagle1-sglang", "eagle1-no-bias"), ("medusa", "medusa-shared")])
def test_bf16_heads_export_as_bf16_and_come_back_exactly(fmt, name, target, tmp_path):
    """Guards dtype handling: a bf16 head exports bf16 tensors (torch_dtype bfloat16) and imports without upcasting."""
    kind, cfg, head = build_head(name, target)
    src = save(tmp_path / "head", kind, cfg, head.to(torch.bfloat16), target, "tiny-llama-8")
    out = export_head(src, fmt, tmp_path / "engine", target)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    weights = load_file(str(next(p for p in out.iterdir() if p.suffix == ".safetensors")))
    assert {v.dtype for v in weights.values() if v.is_floating_point()} == {torch.bfloat16}
    round_trip(target, src, fmt, tmp_path)


@pytest.mark.parametrize("fmt,arch", [("medusa", "gemma3"), ("medusa-vllm", "qwen2"), ("eagle1", "qwen3")])
def test_round_trip_on_non_llama_targets(fmt, arch, tmp_path):
    """Guards heads trained on Qwen/Gemma targets: exported in the Llama-style layout, restored exactly."""
    model = tiny_model(arch)
    kind, cfg, head = build_head({"medusa": "medusa-shared", "medusa-vllm": "medusa-own", "eagle1": "eagle1"}[fmt], model)
    src = save(tmp_path / "head", kind, cfg, head, model, f"tiny-{arch}")
    assert_round_trip(model, src, fmt, tmp_path, [random_prompt(7, 2)], tokens=12)


@pytest.mark.parametrize("fmt,name", [("eagle3", "eagle3"), ("eagle1", "eagle1"), ("eagle1-sglang", "eagle1")])
def test_eagle_export_refuses_scaled_embedding_target(fmt, name, tmp_path):
    """Guards Gemma heads: the engines would feed the EAGLE draft unscaled embeddings, so refuse."""
    model = tiny_model("gemma3")
    kind, cfg, head = build_head(name, model)
    src = save(tmp_path / "head", kind, cfg, head, model, "tiny-gemma3")
    with pytest.raises(ExportError, match="scales its token embeddings"):
        export_head(src, fmt, tmp_path / "out", model)
    with pytest.raises(ExportError, match="scales its token embeddings"):  # refused from the recorded model_type too
        export_head(src, fmt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_eagle3_export_refuses_non_default_feature_layers(target, tmp_path):
    """Guards EAGLE-3 feature ids: the engines fuse (2, L//2, L-3) only, so other ids must not export."""
    cfg = Eagle3Config(**{**Eagle3Config.for_target(target, 48).__dict__, "feature_layers": (1, 4, 6)})
    head = Eagle3Head(cfg, target.get_input_embeddings())
    src = save(tmp_path / "head", "eagle3", cfg, head, target, "tiny")
    with pytest.raises(ExportError, match=r"fuses target layers \(1, 4, 6\).*\(2, 4, 5\)"):
        export_head(src, "eagle3", tmp_path / "out", target)
    small = tiny_model("llama")  # 4 layers: (2, 2, 1) are not three distinct layers
    kind, cfg, head = build_head("eagle3", small)
    src = save(tmp_path / "small", kind, cfg, head, small, "tiny4")
    with pytest.raises(ExportError, match="not three distinct"):
        export_head(src, "eagle3", tmp_path / "out", small)


def test_export_refusals_name_the_reason(target, head_dirs, tmp_path):
    """Guards the export preconditions: vLLM fc bias, shared lm_head without target, head type, format name."""
    with pytest.raises(ExportError, match="no fc bias"):
        export_head(head_dirs["eagle1"], "eagle1-vllm", tmp_path / "a", target)
    with pytest.raises(ExportError, match="pass the target"):
        export_head(head_dirs["medusa-shared"], "medusa", tmp_path / "b")
    with pytest.raises(ExportError, match="holds eagle3 heads"):
        export_head(head_dirs["medusa-own"], "eagle3", tmp_path / "c", target)
    with pytest.raises(ExportError, match="unknown export format"):
        export_head(head_dirs["eagle3"], "onnx", tmp_path / "d", target)
    with pytest.raises(HeadMismatchError, match="another target"):
        export_head(head_dirs["eagle3"], "eagle3", tmp_path / "e", llama8(seed=1))
    out = export_head(head_dirs["medusa-own"], "medusa", tmp_path / "f")  # own projections: no target needed
    assert (out / "medusa_lm_head.safetensors").is_file()
    assert not any((tmp_path / x).exists() for x in "abcde")


def edit_weights(folder: Path, fn) -> None:
    path = next(p for p in folder.iterdir() if p.name.endswith(".safetensors"))
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def cut_first_matrix(tensors: dict) -> None:
    name = next(k for k in sorted(tensors) if tensors[k].dim() == 2)
    tensors[name] = tensors[name][:, :-1].contiguous()


BAD_INPUTS = {
    "missing": (lambda t: t.pop(sorted(t)[0]), "missing"),
    "extra": (lambda t: t.__setitem__("extra.weight", torch.zeros(3)), "unexpected"),
    "shape": (cut_first_matrix, "wrong shape"),
}


@pytest.mark.parametrize("fmt,head", [("eagle3", "eagle3"), ("eagle1-sglang", "eagle1"), ("medusa", "medusa-own"),
                                      ("medusa-vllm", "medusa-shared")])
@pytest.mark.parametrize("bad", ["missing", "extra", "shape", "truncated", "other-target", "no-manifest-other-vocab"])
def test_import_refuses_bad_input(fmt, head, bad, target, head_dirs, tmp_path):
    """Guards import: missing/extra/mis-shaped tensors, truncated files, other targets fail loudly, write nothing."""
    out = export_head(head_dirs[head], fmt, tmp_path / "engine", target)
    model = target
    if bad in BAD_INPUTS:
        fn, pattern = BAD_INPUTS[bad]
        edit_weights(out, fn)
    elif bad == "truncated":
        path = next(p for p in out.iterdir() if p.name.endswith(".safetensors"))
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        pattern = "corrupt or truncated"
    elif bad == "other-target":
        model, pattern = llama8(seed=1), "another target"
    else:  # a released head (no manifest) for a target with another vocabulary
        (out / MANIFEST).unlink()
        torch.manual_seed(0)
        cfg = LlamaConfig(**_common(head_dim=8, num_hidden_layers=8, vocab_size=128))
        model, pattern = AutoModelForCausalLM.from_config(cfg).eval(), "vocab_size.*another target"
    with pytest.raises(HeadMismatchError, match=pattern) as err:
        import_head(out, tmp_path / "own", model)
    assert "\n" not in str(err.value), "one-line error"
    assert not (tmp_path / "own").exists(), "no partial head folder"


@pytest.mark.parametrize("fmt,head", [("eagle3", "eagle3"), ("medusa", "medusa-shared"), ("medusa-vllm", "medusa-own"),
                                      ("eagle1-sglang", "eagle1")])
def test_import_released_head_without_manifest(fmt, head, target, head_dirs, tmp_path):
    """Guards importing heads released by others: config rebuilt from config.json + target, tensors exact."""
    out = export_head(head_dirs[head], fmt, tmp_path / "engine", target)
    (out / MANIFEST).unlink()
    assert detect_format(out) == fmt
    back = import_head(out, tmp_path / "own", target, target_name="tiny-llama-8")
    (m1, t1), (m2, t2) = read_head(head_dirs[head]), read_head(back)
    assert m1["head_config"] == m2["head_config"], (m1["head_config"], m2["head_config"])
    assert t1.keys() == t2.keys() and all(torch.equal(t1[k], t2[k]) for k in t1)


def test_import_accepts_only_the_targets_own_embedding(target, head_dirs, tmp_path):
    """Guards released EAGLE drafts carrying embed_tokens: an exact copy is dropped, another one refused."""
    out = export_head(head_dirs["eagle3"], "eagle3", tmp_path / "engine", target)
    emb = target.get_input_embeddings().weight.detach().clone()
    edit_weights(out, lambda t: t.__setitem__("embed_tokens.weight", emb))
    import_head(out, tmp_path / "own", target)
    edit_weights(out, lambda t: t.__setitem__("embed_tokens.weight", torch.randn_like(emb)))
    with pytest.raises(HeadMismatchError, match="embed_tokens.weight is not the target's"):
        import_head(out, tmp_path / "own2", target)


def test_push_to_hub_without_token_is_a_clear_error(tmp_path, monkeypatch):
    """Guards --push-to-hub: no token gives a one-line how-to, not a stack trace from the HTTP layer."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(ExportError, match="no Hugging Face token"):
        push_to_hub(tmp_path, "someone/head")


def test_run_export_and_import_load_the_named_target(tiny_target_dir, tmp_path):
    """Guards the entry points the CLI calls: the target is loaded by name and the round trip is exact."""
    from selfdraft.export import ImportConfig, run_export, run_import

    model = tiny_model("llama")
    kind, cfg, head = build_head("medusa-shared", model)
    src = save(tmp_path / "head", kind, cfg, head, model, str(tiny_target_dir))
    out = run_export(ExportConfig(head=str(src), format="medusa", out=str(tmp_path / "engine"), target=str(tiny_target_dir)))
    back = run_import(ImportConfig(src=str(out), out=str(tmp_path / "own"), target=str(tiny_target_dir)))
    (m1, t1), (m2, t2) = read_head(src), read_head(back)
    assert m1 == m2 and all(torch.equal(t1[k], t2[k]) for k in t1)


def test_export_config_is_typed():
    """Guards the CLI schema: known fields build the config, unknown keys are errors."""
    cfg = from_dict(ExportConfig, {"head": "h", "format": "medusa", "out": "o"})
    assert cfg.format == "medusa" and cfg.push_to_hub == ""
    with pytest.raises(ConfigError):
        from_dict(ExportConfig, {"fromat": "medusa"})


@pytest.mark.slow
def test_round_trips_on_smollm2(tmp_path):
    """Guards every format on a real target (SmolLM2: 30 layers, GQA, rope 1e5, tied lm_head): exact round trips.

    Every format must give the own folder back bit for bit; one imported head per head type then
    drafts (2 prompts x 24 tokens) and must reproduce plain greedy with the same tau as the original
    head (the other copies are bit-identical to it, checked above; drafting each would take minutes).
    """
    from selfdraft.target import load_target

    t = load_target("smollm2", dtype="float32")
    model = t.model
    prompts = [t.encode_chat("Write a haiku about the sea."), t.encode_chat("List three prime numbers.")]
    ref = [generate(model, p, None, GenerationConfig(max_new_tokens=24)).tokens for p in prompts]
    drafted_formats = {"eagle3": "eagle3", "eagle1": "eagle1-sglang", "medusa-shared": "medusa"}
    for name, drafted_format in drafted_formats.items():
        kind, cfg, head = build_head(name, model, scale=0.02)  # fresh head, lightly perturbed
        src = save(tmp_path / name, kind, cfg, head, model, "smollm2")
        for fmt in [f for f in FORMATS if FORMATS[f].head_type == kind and f != "eagle1-vllm"]:  # fc bias is nonzero
            back = round_trip(model, src, fmt, tmp_path / fmt)
            if fmt == drafted_format:
                tokens, tau = drafted(model, back, prompts, 24)
                assert tokens == ref, (fmt, tau, tokens, ref)
                # the original head drafts the very same trees: same tokens and the same tau
                orig_tokens, orig_tau = drafted(model, src, prompts, 24)
                assert (orig_tokens, orig_tau) == (tokens, tau), (fmt, orig_tau, tau)


def llama_no_gqa() -> torch.nn.Module:
    """Tiny llama as the 2024 reference packages expect it: rope base 10000, as many KV heads as heads."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**_common(num_key_value_heads=4))).eval().requires_grad_(False)


@pytest.mark.slow
def test_medusa_export_loads_in_the_medusa_llm_package(tmp_path):
    """Guards the medusa layout against FasterDecoding's own head module (pip medusa-llm 0.1): same logits.

    Its from_pretrained loads the base through a vendored transformers-4 Llama that cannot read a
    transformers-5 config, so the head module is built on our HF base and loaded as it loads it
    (torch.load of medusa_lm_head.pt), with strict=True instead of its strict=False.
    """
    medusa_model = pytest.importorskip("medusa.model.medusa_model", reason="pip install --no-deps medusa-llm==0.1")
    model = llama_no_gqa()
    # one block per head: the package repeats a single block object num_layers times
    cfg = MedusaConfig(32, VOCAB, num_heads=2, num_layers=1, share_lm_head=False)
    head = perturb(MedusaHeads(cfg, model.get_output_embeddings()), 0.3)
    src = save(tmp_path / "head", "medusa", cfg, head, model, "tiny")
    out = export_head(src, "medusa", tmp_path / "engine", model)
    torch.save(load_file(str(out / "medusa_lm_head.safetensors")), out / "medusa_lm_head.pt")
    model.save_pretrained(tmp_path / "base")
    char_tokenizer().save_pretrained(tmp_path / "base")
    theirs = medusa_model.MedusaModel(model, cfg.num_heads, cfg.num_layers, str(tmp_path / "base"))
    theirs.medusa_head.load_state_dict(torch.load(out / "medusa_lm_head.pt"), strict=True)
    ids = torch.tensor([random_prompt(9, 0)])
    with torch.no_grad():
        want = head(model.model(ids).last_hidden_state)
        got = theirs(ids)
    assert (got - want).abs().max() == 0, (got - want).abs().max()


@pytest.mark.slow
def test_eagle1_export_loads_in_the_eagle_llm_package(tmp_path):
    """Guards the eagle1 layout against the EAGLE reference draft module (pip eagle-llm 1.2.1): same features.

    The package's own loader wants pytorch_model.bin with an embed_tokens copy (strict=True) and a
    transformers-4 base model; here its draft ``Model`` is built from the exported config.json and
    loaded strictly with the target's embedding added, which is what its loader would do.
    """
    cnets = pytest.importorskip("eagle.model.cnets", reason="pip install --no-deps eagle-llm==1.2.1")
    from eagle.model.configs import EConfig

    model = llama_no_gqa()
    kind, cfg, head = build_head("eagle1", model)
    src = save(tmp_path / "head", kind, cfg, head, model, "tiny")
    out = export_head(src, "eagle1", tmp_path / "engine", model)
    config = EConfig.from_pretrained(str(out / "config.json"))
    config.rope_scaling = None  # transformers 5 turns rope_theta into a rope_scaling dict this 2024 code cannot read
    theirs = cnets.Model(config, bias=json.loads((out / "config.json").read_text())["bias"]).eval()
    tensors = load_file(str(out / "model.safetensors"))
    theirs.load_state_dict({**tensors, "embed_tokens.weight": model.get_input_embeddings().weight.clone()}, strict=True)
    s = 9
    features, tokens = torch.randn(1, s, 32), torch.tensor([random_prompt(s, 1)])
    with torch.no_grad():
        got = theirs(features, tokens)
        residual, q, k, v = head.project(model.get_input_embeddings()(tokens), features, torch.arange(s)[None])
        want = head.complete(residual, q, k, v, torch.tril(torch.ones(s, s, dtype=torch.bool))[None, None])
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()


def test_list_options_take_one_value_or_many():
    """Guards key=value overrides of list options: YAML reads a lone ``1`` as an int, which must
    become a one-item list (it raised TypeError), and a space-separated string splits."""
    from selfdraft.benchmark import BenchConfig
    from selfdraft.config import load

    assert load(BenchConfig, None, ["decoders=plain"]).decoders == ("plain",)
    assert load(BenchConfig, None, ["decoders=1"]).decoders == ("1",)
    assert load(BenchConfig, None, ["decoders=plain prompt_lookup"]).decoders == ("plain", "prompt_lookup")
    assert from_dict(BenchConfig, {"decoders": 7}).decoders == ("7",)
