"""Medusa layouts: FasterDecoding/TGI (``medusa_lm_head.safetensors``) and vLLM (``MedusaModel``).

Read from FasterDecoding ``medusa/model/medusa_model.py``, TGI ``server/text_generation_server/layers/medusa.py``
and vLLM ``vllm/model_executor/models/medusa.py`` + ``transformers_utils/configs/medusa.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from selfdraft.formats import ExportError, Tensors, check_dims, dtype_name, float_dtype, rename, swap
from selfdraft.heads.artifact import HeadMismatchError


def _medusa_block_pairs(k: int, n: int, vllm: bool) -> list[tuple[str, str]]:
    """Own residual-block names -> engine names for k heads of n blocks."""
    pairs = []
    for i in range(k):
        for j in range(n):
            for p in ("weight", "bias"):
                theirs = f"blocks.{i}.layers.{j}.{p}" if vllm else f"{i}.{j}.linear.{p}"
                pairs.append((f"blocks.{i}.{j}.linear.{p}", theirs))
    return pairs


def _target_lm_head(target: nn.Module | None, dtype: torch.dtype, why: str) -> Tensor:
    """The target's (vocab, hidden) lm_head weight on CPU in ``dtype``, for heads that share it."""
    if target is None:
        raise ExportError(f"this Medusa head projects with the target's lm_head, which {why}: pass the target so it can be copied in")
    return target.get_output_embeddings().weight.detach().to("cpu", dtype)


def medusa_out(vllm: bool) -> Callable[[dict, Tensors, nn.Module | None], tuple[dict, Tensors]]:
    """Own Medusa heads -> vLLM ``MedusaModel`` folder (``vllm``) or FasterDecoding/TGI folder."""

    def out(meta: dict, tensors: Tensors, target: nn.Module | None) -> tuple[dict, Tensors]:
        c = meta["head_config"]
        k, n, share = c["num_heads"], c["num_layers"], c["share_lm_head"]
        dtype = float_dtype(tensors)
        lm = [] if share else [(f"lm_heads.{i}.weight", f"lm_heads.{i}.weight" if vllm else f"{i}.{n}.weight") for i in range(k)]
        out = rename(tensors, _medusa_block_pairs(k, n, vllm) + lm, "head")
        if vllm:
            if share:  # one copy, loaded as the shared projection of every head
                out["lm_heads.0.weight"] = _target_lm_head(target, dtype, "vLLM loads from the draft folder").clone()
            config = {
                "architectures": ["MedusaModel"],
                "model_type": "medusa",
                "num_heads": k,
                "num_hidden_layers": n,
                "hidden_size": c["hidden_size"],
                "vocab_size": c["vocab_size"],
                "truncated_vocab_size": c["vocab_size"],
                "medusa_fc_bias": True,
                "original_lm_head": share,
                "torch_dtype": dtype_name(dtype),
            }
            return config, out
        if share:
            w = _target_lm_head(target, dtype, "the medusa format stores once per head")
            out.update({f"{i}.{n}.weight": w.clone() for i in range(k)})
        config = {
            "medusa_num_heads": k,
            "medusa_num_layers": n,
            "base_model_name_or_path": meta["target"].get("name", ""),
            "hidden_size": c["hidden_size"],
            "vocab_size": c["vocab_size"],
            "torch_dtype": dtype_name(dtype),
        }
        return config, out

    return out


def medusa_in(vllm: bool) -> Callable[[dict, Tensors, nn.Module, dict | None], tuple[dict, Tensors]]:
    """The inverse of :func:`medusa_out`; a shared lm_head is recognised by bit equality with the target's."""

    def inp(config: dict, tensors: Tensors, target: nn.Module, exported: dict | None) -> tuple[dict, Tensors]:
        where = "medusa-vllm folder" if vllm else "medusa folder"
        try:
            k = config["num_heads"] if vllm else config["medusa_num_heads"]
            n = config["num_hidden_layers"] if vllm else config["medusa_num_layers"]
        except KeyError as err:
            raise HeadMismatchError(f"{where}: config.json lacks {err}") from err
        tc = target.config
        c = dict(hidden_size=config.get("hidden_size", tc.hidden_size), vocab_size=config.get("vocab_size", tc.vocab_size), num_heads=k, num_layers=n)
        check_dims(c, target, where, {"hidden_size": "hidden_size", "vocab_size": "vocab_size"})
        if vllm and config.get("truncated_vocab_size", c["vocab_size"]) != c["vocab_size"]:
            raise HeadMismatchError(f"{where}: truncated_vocab_size (token_map) is not supported by the Medusa heads here")
        tensors = dict(tensors)
        if vllm and config.get("original_lm_head"):
            names = ["lm_heads.0.weight"]
        else:
            names = [f"lm_heads.{i}.weight" if vllm else f"{i}.{n}.weight" for i in range(k)]
        missing = [x for x in names if x not in tensors]
        if missing:
            raise HeadMismatchError(f"{where}: tensors do not match the config: missing {missing[:5]}")
        projections = [tensors.pop(x) for x in names]
        base = target.get_output_embeddings().weight.detach().cpu()
        same = [w.shape == base.shape and torch.equal(w, base.to(w.dtype)) for w in projections]
        share = all(same) if exported is None else exported["share_lm_head"]
        if vllm and config.get("original_lm_head") and not share:
            projections = projections * k  # one projection shared by all heads, but not the target's
        if share and not all(same):
            raise HeadMismatchError(f"{where}: the exported head shares the target's lm_head but the vocabulary projections differ from it")
        c["share_lm_head"] = share
        own = rename(tensors, swap(_medusa_block_pairs(k, n, vllm)), where)
        if not share:
            own.update({f"lm_heads.{i}.weight": w.clone() for i, w in enumerate(projections)})
        return c, own

    return inp

