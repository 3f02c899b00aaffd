"""EAGLE draft layouts: EAGLE-3 (vLLM, SGLang, EAGLE reference) and EAGLE-1 (EAGLE reference, vLLM, SGLang).

Both are one Llama decoder layer in the engines (names ``fc``, ``midlayer.*``/``layers.0.*``), fed the
target's raw token embeddings; layouts read from vLLM ``llama_eagle3.py``/``llama_eagle.py``, SGLang
``llama_eagle3.py``/``llama_eagle.py`` and EAGLE ``cnets.py``/``cnets1.py``/``ea_model.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from selfdraft.formats import ExportError, Tensors, check_dims, dtype_name, float_dtype, rename
from selfdraft.heads.artifact import HeadMismatchError

SCALED_EMBEDDING_MODEL_TYPES = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text"})


def check_unscaled_embedding(target_meta: dict, target: nn.Module | None) -> None:
    """Refuse targets whose embedding module scales its output (Gemma: x sqrt(H)), from the target or its record."""
    scale = getattr(target.get_input_embeddings(), "embed_scale", 1.0) if target is not None else 1.0
    if target_meta.get("model_type") in SCALED_EMBEDDING_MODEL_TYPES or float(scale) != 1.0:
        raise ExportError(
            f"the target ({target_meta.get('model_type')}) scales its token embeddings and the head was trained on "
            "the scaled ones; the engines' Llama-style EAGLE drafts look up unscaled embeddings, so the export "
            "would draft differently; serve this head with selfdraft, or use a Medusa head for this target"
        )


def engine_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs vLLM, SGLang and EAGLE fuse for EAGLE-3: (2, L//2, L-3)."""
    return (2, num_layers // 2, num_layers - 3)


def _check_feature_layers(layers: list[int] | tuple[int, ...], num_layers: int) -> None:
    want = engine_feature_layers(num_layers)
    if not want[0] < want[1] < want[2]:
        raise ExportError(
            f"for a {num_layers}-layer target the engines' EAGLE-3 feature layers (2, L//2, L-3) = {want} are "
            "not three distinct increasing layers (the engines collect them in layer order, once each); "
            "EAGLE-3 export needs a target with at least 7 layers"
        )
    if tuple(layers) != want:
        raise ExportError(
            f"the head fuses target layers {tuple(layers)}, the engines fuse (2, L//2, L-3) = {want} and have no "
            f"setting for other ids; retrain with feature_layers={list(want)}"
        )


def _llama_config(c: dict, arch: str, dtype: torch.dtype) -> dict:
    """The Llama decoder-layer fields every EAGLE loader reads, from an EAGLE head config."""
    return {
        "architectures": [arch],
        "model_type": "llama",
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"],
        "head_dim": c["head_dim"],
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c["rms_norm_eps"],
        "rope_theta": c["rope_theta"],
        "rope_scaling": None,
        "max_position_embeddings": c["max_position_embeddings"],
        "vocab_size": c["vocab_size"],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": dtype_name(dtype),
    }


def _llama_dims(config: dict, where: str) -> dict:
    """The EAGLE head fields of a Llama-style draft config.json (the inverse of :func:`_llama_config`)."""
    try:
        heads = config["num_attention_heads"]
        scaling = config.get("rope_scaling") or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise HeadMismatchError(f"{where}: rope_scaling {config['rope_scaling']} is not supported by the heads here (plain RoPE)")
        if config.get("hidden_act", "silu") != "silu":
            raise HeadMismatchError(f"{where}: hidden_act {config['hidden_act']!r} is not supported (the heads use SiLU)")
        rope = config.get("rope_parameters") or {}
        return dict(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 8192)),
        )
    except KeyError as err:
        raise HeadMismatchError(f"{where}: config.json lacks {err}") from err


def _drop_target_embedding(tensors: Tensors, target: nn.Module, where: str) -> Tensors:
    """Released drafts may carry ``embed_tokens``: accepted only as an exact copy of the target's."""
    tensors = dict(tensors)
    emb = tensors.pop("embed_tokens.weight", None)
    if emb is not None:
        own = target.get_input_embeddings().weight
        if emb.shape != own.shape or not torch.equal(emb.to(own.dtype), own.detach().cpu()):
            raise HeadMismatchError(f"{where}: embed_tokens.weight is not the target's embedding; the head belongs to another target")
    return tensors


# -- EAGLE-3 ---------------------------------------------------------------------------------------

EAGLE3_NAMES = [
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    *[f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"],
    "midlayer.post_attention_layernorm.weight",
    *[f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")],
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
]


def eagle3_out(meta: dict, tensors: Tensors, target: nn.Module | None) -> tuple[dict, Tensors]:
    """Own EAGLE-3 head -> ``LlamaForCausalLMEagle3`` folder (names are already the engines')."""
    c = meta["head_config"]
    check_unscaled_embedding(meta["target"], target)
    _check_feature_layers(c["feature_layers"], meta["target"]["num_hidden_layers"])
    config = _llama_config(c, "LlamaForCausalLMEagle3", float_dtype(tensors))
    config["draft_vocab_size"] = c["draft_vocab_size"]
    config["bias"] = False
    if c["target_hidden_size"] != c["hidden_size"]:
        config["target_hidden_size"] = c["target_hidden_size"]
    return config, rename(tensors, [(k, k) for k in EAGLE3_NAMES], "head")


def eagle3_in(config: dict, tensors: Tensors, target: nn.Module, exported: dict | None) -> tuple[dict, Tensors]:
    """EAGLE-3 folder -> own head; feature layers are the engines' default for this target."""
    where = "eagle3 folder"
    c = _llama_dims(config, where)
    c["target_hidden_size"] = config.get("target_hidden_size", c["hidden_size"])
    c["draft_vocab_size"] = config.get("draft_vocab_size") or c["vocab_size"]
    n = target.config.num_hidden_layers
    c["feature_layers"] = engine_feature_layers(n)
    check_dims(c, target, where, {"target_hidden_size": "hidden_size", "hidden_size": "hidden_size", "vocab_size": "vocab_size"})
    tensors = _drop_target_embedding(tensors, target, where)
    if "d2t" not in tensors and c["draft_vocab_size"] == c["vocab_size"]:  # full vocabulary: identity map
        tensors["d2t"] = torch.zeros(c["vocab_size"], dtype=torch.long)
    if "t2d" not in tensors and "d2t" in tensors:  # vLLM and SGLang ignore t2d, so releases may omit it
        d2t = tensors["d2t"].long()
        tensors["t2d"] = torch.zeros(c["vocab_size"], dtype=torch.bool)
        tensors["t2d"][d2t + torch.arange(d2t.numel())] = True
    return c, rename(tensors, [(k, k) for k in EAGLE3_NAMES], where)


# -- EAGLE-1 ---------------------------------------------------------------------------------------


def _eagle1_pairs(fc_bias: bool) -> list[tuple[str, str]]:
    """EAGLE-1 tensor names (own = engine): fc, then layer 0 without input_layernorm."""
    names = ["fc.weight", *(["fc.bias"] if fc_bias else [])]
    names += [f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]
    names += ["layers.0.post_attention_layernorm.weight"]
    names += [f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    return [(k, k) for k in names]


def eagle1_out(flavour: str) -> Callable[[dict, Tensors, nn.Module | None], tuple[dict, Tensors]]:
    """flavour: 'eagle' (EAGLE reference, vLLM without fc bias), 'vllm' or 'sglang'."""

    def out(meta: dict, tensors: Tensors, target: nn.Module | None) -> tuple[dict, Tensors]:
        c = meta["head_config"]
        check_unscaled_embedding(meta["target"], target)
        dtype = float_dtype(tensors)
        arch = "LlamaForCausalLMEagle" if flavour == "sglang" else "LlamaForCausalLM"
        config = _llama_config(c, arch, dtype)
        tensors = dict(tensors)
        keep_bias = c["fc_bias"]
        if flavour == "eagle":
            if c["head_dim"] * c["num_attention_heads"] != c["hidden_size"]:
                raise ExportError(
                    f"head_dim {c['head_dim']} x {c['num_attention_heads']} heads != hidden_size {c['hidden_size']}: the "
                    "EAGLE reference derives head_dim as hidden_size // num_attention_heads; export --format eagle1-vllm or eagle1-sglang"
                )
            config["bias"] = c["fc_bias"]
        elif flavour == "vllm":
            bias = tensors.pop("fc.bias", None)
            if bias is not None and bool(bias.any()):
                raise ExportError(
                    "vLLM's EAGLE-1 draft (llama_eagle.py) has no fc bias and would silently drop this head's nonzero "
                    "one; export --format eagle1 (EAGLE reference) or eagle1-sglang, or train with fc_bias=false"
                )
            config["bias"] = False
            keep_bias = False
        elif not c["fc_bias"]:  # SGLang's fc always has a bias
            tensors["fc.bias"] = torch.zeros(c["hidden_size"], dtype=dtype)
            keep_bias = True
        return config, rename(tensors, _eagle1_pairs(keep_bias), "head")

    return out


def eagle1_in(flavour: str) -> Callable[[dict, Tensors, nn.Module, dict | None], tuple[dict, Tensors]]:
    """The inverse of :func:`eagle1_out` for the same flavour."""

    def inp(config: dict, tensors: Tensors, target: nn.Module, exported: dict | None) -> tuple[dict, Tensors]:
        where = f"eagle1 folder ({flavour})"
        c = _llama_dims(config, where)
        check_dims(c, target, where, {"hidden_size": "hidden_size", "vocab_size": "vocab_size"})
        tensors = _drop_target_embedding(tensors, target, where)
        # what the folder holds: the EAGLE reference says so in config.json (default: a bias),
        # vLLM never has one, SGLang always has one
        c["fc_bias"] = {"eagle": bool(config.get("bias", True)), "vllm": False, "sglang": True}[flavour]
        own = rename(tensors, _eagle1_pairs(c["fc_bias"]), where)
        if exported is not None and exported.get("fc_bias") != c["fc_bias"]:
            # the export added a zero bias (SGLang) or dropped one (vLLM): undo it exactly
            if c["fc_bias"]:
                if bool(own["fc.bias"].any()):
                    raise HeadMismatchError(f"{where}: fc.bias is nonzero but the exported head had no fc bias")
                del own["fc.bias"]
            else:
                own["fc.bias"] = torch.zeros(c["hidden_size"], dtype=float_dtype(own))
            c["fc_bias"] = exported["fc_bias"]
        return c, own

    return inp
