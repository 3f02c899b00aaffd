"""Export draft heads to the folder layouts serving engines load, and import such folders back.

A format is a pair of pure functions over ``(config.json, tensors)``: own head -> engine folder and
engine folder -> own head. The layouts were read off the engines' loaders (names, shapes and the
config fields they read); the code here is ours:

- ``eagle3``: EAGLE-3 draft for vLLM (``method="eagle3"``, ``llama_eagle3.py``), SGLang
  (``EAGLE3``, ``llama_eagle3.py``) and the EAGLE reference (``cnets.py``). ``LlamaForCausalLMEagle3``
  config with ``draft_vocab_size``; tensors ``fc.weight`` (H, 3T), ``midlayer.*``, ``norm.weight``,
  ``lm_head.weight`` (draft vocab, H), ``d2t`` (int64: target id = draft id + d2t[draft id]), ``t2d``
  (bool, vocab); no ``embed_tokens`` (every engine then shares the target's). ``"bias": false``
  because the EAGLE reference gives ``fc`` a bias unless the config says otherwise. The engines fuse
  the inputs of target layers (2, L//2, L-3) and have no field for other ids, so only heads trained
  on those export.
- ``eagle1``: EAGLE-1/2 draft for the EAGLE reference (``cnets1.py``: ``LlamaForCausalLM`` config,
  ``bias`` = whether ``fc`` has a bias) and vLLM ``method="eagle"`` (``llama_eagle.py``) when the
  head has no fc bias. Tensors ``fc.*`` (H, 2H), ``layers.0.*`` without ``input_layernorm``.
- ``eagle1-vllm``: the same for vLLM alone: vLLM's EAGLE-1 ``fc`` has no bias (a checkpoint's
  ``fc.bias`` is skipped) and it reads ``bias`` as the attention-bias flag, so a zero fc bias is
  dropped and a nonzero one is refused.
- ``eagle1-sglang``: SGLang ``LlamaForCausalLMEagle`` (its ``fc`` always has a bias: zeros are
  written when the head has none).
- ``medusa``: FasterDecoding/TGI: ``medusa_lm_head.safetensors`` with ``{k}.{j}.linear.weight/bias``
  (H, H)/(H,) and the per-head vocabulary projection ``{k}.{L}.weight`` (V, H), materialised from
  the target's lm_head when the head shares it; config ``medusa_num_heads``, ``medusa_num_layers``.
  TGI serves one-block heads (``MedusaHeadV2``) with the target's lm_head and ignores ``{k}.1.weight``,
  so there only ``share_lm_head`` heads draft as trained; FasterDecoding's ``medusa_model.py`` reads
  the same keys from ``medusa_lm_head.pt`` (``torch.save`` of this dict).
- ``medusa-vllm``: vLLM ``MedusaModel``: ``blocks.{k}.layers.{j}.weight/bias``, ``lm_heads.{k}.weight``
  (only ``lm_heads.0`` with ``original_lm_head: true`` when the head shares the target's lm_head),
  ``medusa_fc_bias: true``, ``num_heads``, ``num_hidden_layers``, ``truncated_vocab_size``.

Every export also writes ``selfdraft_export.json`` (source head type and config, the target it was
trained for, tensor list), from which :func:`import_head` restores the own folder bit for bit. A
released head without it is imported from its ``config.json``, its tensors and the target.
EAGLE drafts are Llama-style layers over the target's raw token embeddings, so heads for targets
that scale their embeddings (Gemma) are refused: the engines would feed the draft unscaled ones.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from selfdraft.config import opt
from selfdraft.formats import ExportError, Format, Tensors, dtype_name, float_dtype
from selfdraft.formats.eagle import eagle1_in, eagle1_out, eagle3_in, eagle3_out
from selfdraft.formats.medusa import medusa_in, medusa_out
from selfdraft.heads import HEADS
from selfdraft.heads.artifact import (
    HeadMismatchError,
    check_target,
    load_state_strict,
    read_head,
    replace_dir,
    save_head,
    target_info,
)

MANIFEST = "selfdraft_export.json"


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("eagle3", "eagle3", "vLLM method=eagle3, SGLang EAGLE3, EAGLE reference (cnets.py)",
               ("model.safetensors", "pytorch_model.bin"), eagle3_out, eagle3_in),
        Format("eagle1", "eagle1", "EAGLE reference (cnets1.py); vLLM method=eagle when the head has no fc bias",
               ("model.safetensors", "pytorch_model.bin"), eagle1_out("eagle"), eagle1_in("eagle")),
        Format("eagle1-vllm", "eagle1", "vLLM method=eagle (llama_eagle.py)",
               ("model.safetensors", "pytorch_model.bin"), eagle1_out("vllm"), eagle1_in("vllm")),
        Format("eagle1-sglang", "eagle1", "SGLang EAGLE (LlamaForCausalLMEagle, llama_eagle.py)",
               ("model.safetensors", "pytorch_model.bin"), eagle1_out("sglang"), eagle1_in("sglang")),
        Format("medusa", "medusa", "FasterDecoding Medusa, TGI (medusa_lm_head.safetensors)",
               ("medusa_lm_head.safetensors", "medusa_lm_head.pt"), medusa_out(False), medusa_in(False)),
        Format("medusa-vllm", "medusa", "vLLM method=medusa (MedusaModel, medusa.py)",
               ("model.safetensors", "pytorch_model.bin"), medusa_out(True), medusa_in(True)),
    )
}


def _format(name: str) -> Format:
    if name not in FORMATS:
        raise ExportError(f"unknown export format '{name}'; known: {', '.join(FORMATS)}")
    return FORMATS[name]


def _read_weights(folder: Path, names: tuple[str, ...]) -> Tensors:
    for name in names:
        path = folder / name
        if path.is_file():
            try:
                if path.suffix == ".safetensors":
                    return load_file(str(path))
                return torch.load(path, map_location="cpu", weights_only=True)
            except Exception as err:  # safetensors and torch raise their own types for truncated files
                raise HeadMismatchError(f"{path} is corrupt or truncated ({err}); export or download it again") from err
    raise HeadMismatchError(f"{folder}: no weights file ({' or '.join(names)})")


def _write_folder(out_dir: str | Path, files: dict[str, Any], weights: tuple[str, Tensors]) -> Path:
    """Write JSON files and one safetensors file to a temp folder, then swap it into place."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        name, tensors = weights
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / name), metadata={"format": "pt"})
        for fname, data in files.items():
            (tmp / fname).write_text(json.dumps(data, indent=2) + "\n")
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_head(head_dir: str | Path, fmt: str, out_dir: str | Path, target: nn.Module | None = None) -> Path:
    """Write the head folder ``head_dir`` in format ``fmt`` to ``out_dir`` (atomically); returns ``out_dir``.

    ``target`` is checked against the head when given; Medusa heads that share the target's lm_head
    need it (the formats store the projection). Raises :class:`ExportError` when the format cannot
    represent the head, :class:`HeadMismatchError` for a broken head folder or another target.
    """
    spec = _format(fmt)
    meta, tensors = read_head(head_dir)
    kind = meta.get("head_type")
    if kind != spec.head_type:
        fits = [f.name for f in FORMATS.values() if f.head_type == kind]
        raise ExportError(f"format '{fmt}' holds {spec.head_type} heads, {head_dir} is a {kind} head; formats for it: {fits}")
    if target is not None:
        check_target(meta, target)
    config, out = spec.to_engine(meta, tensors, target)
    manifest = {
        "selfdraft_export": 1,
        "format": fmt,
        "engines": spec.engines,
        "source": Path(head_dir).name,
        "head_type": kind,
        "head_config": meta["head_config"],
        "target": meta["target"],
        "own_extra": {k: v for k, v in meta.items() if k not in ("head_type", "head_config", "target")},
        "weights": {spec.weights[0]: {k: {"shape": list(v.shape), "dtype": dtype_name(v.dtype)} for k, v in sorted(out.items())}},
    }
    return _write_folder(out_dir, {"config.json": config, MANIFEST: manifest}, (spec.weights[0], out))


def detect_format(src_dir: str | Path) -> str:
    """The format of an engine folder: from its export manifest, else from config.json's fields."""
    src = Path(src_dir)
    if (src / MANIFEST).is_file():
        return json.loads((src / MANIFEST).read_text())["format"]
    if not (src / "config.json").is_file():
        raise HeadMismatchError(f"{src} is not a draft-head folder: config.json is missing")
    config = json.loads((src / "config.json").read_text())
    archs = config.get("architectures") or []
    if "medusa_num_heads" in config:
        return "medusa"
    if "MedusaModel" in archs or config.get("model_type") == "medusa":
        return "medusa-vllm"
    if any("Eagle3" in a for a in archs) or "draft_vocab_size" in config:
        return "eagle3"
    if "LlamaForCausalLMEagle" in archs:
        return "eagle1-sglang"
    if archs == ["LlamaForCausalLM"] and config.get("num_hidden_layers") == 1:
        return "eagle1"
    raise HeadMismatchError(f"{src}: cannot tell the draft format from config.json (architectures {archs}); pass the format")


def import_head(src_dir: str | Path, out_dir: str | Path, target: nn.Module, fmt: str | None = None,
                target_name: str = "") -> Path:
    """Convert an engine folder back to this project's head folder at ``out_dir``; returns ``out_dir``.

    With the export manifest the own folder comes back bit for bit (config.json included) after
    checking the target's fingerprint; without it (a released head) the head config is rebuilt from
    config.json and the target, recorded as ``target_name``. Missing, extra or mis-shaped tensors,
    a truncated file or another target raise :class:`HeadMismatchError`; nothing is written then.
    """
    src = Path(src_dir)
    spec = _format(fmt or detect_format(src))
    manifest = json.loads((src / MANIFEST).read_text()) if (src / MANIFEST).is_file() else None
    if manifest is not None and manifest.get("head_type") != spec.head_type:
        raise HeadMismatchError(f"{src}: the manifest holds a {manifest.get('head_type')} head, format '{spec.name}' a {spec.head_type} head")
    if not (src / "config.json").is_file():
        raise HeadMismatchError(f"{src} is not a draft-head folder: config.json is missing")
    config = json.loads((src / "config.json").read_text())
    tensors = _read_weights(src, spec.weights)
    if manifest is not None:
        check_target(manifest, target)
    exported = manifest["head_config"] if manifest is not None else None
    c, own = spec.from_engine(config, tensors, target, exported)
    if exported is not None:
        for key, value in c.items():  # config.json must agree with the manifest on every field it holds
            if json.loads(json.dumps(value)) != exported.get(key):
                raise HeadMismatchError(f"{src}: config.json gives {key}={value}, the export manifest {exported.get(key)}")
        c = exported
    head_spec = HEADS[spec.head_type]
    cfg = head_spec.config_cls(**c)
    head = head_spec.build(cfg, target).to(float_dtype(own))
    load_state_strict(head, own, src)
    info = manifest["target"] if manifest is not None else target_info(target, target_name)
    extra = manifest.get("own_extra", {}) if manifest is not None else {}
    extra = {k: v for k, v in extra.items() if k != "format_version"}  # save_head writes the current one
    return save_head(out_dir, spec.head_type, cfg, head, info, extra=extra)


def push_to_hub(folder: str | Path, repo_id: str, token: str | None = None) -> str:
    """Upload an exported folder to a Hugging Face Hub model repo (created if needed); returns the commit URL."""
    from huggingface_hub import HfApi, get_token

    token = token or get_token()
    if not token:
        raise ExportError(f"cannot push to {repo_id}: no Hugging Face token; run `hf auth login` or set HF_TOKEN")
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, exist_ok=True)
        commit = api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message="Upload draft head exported by selfdraft")
    except Exception as err:  # offline, auth and HTTP errors all mean the same to the user
        raise ExportError(f"upload of {folder} to {repo_id} failed: {err}") from err
    return str(commit)


# -- command-line configs (wired by selfdraft.cli) ---------------------------------------------------


@dataclass(frozen=True)
class ExportConfig:
    head: str = opt("", "Head folder to export (this project's format).")
    format: str = opt("eagle3", f"Engine layout: {', '.join(FORMATS)}.")
    out: str = opt("", "Output folder (replaced atomically).")
    target: str = opt("", "Target (hub id, folder or alias) to check the head against; needed for Medusa heads sharing its lm_head.")
    push_to_hub: str = opt("", "Upload the exported folder to this Hugging Face Hub repo (needs a token).")


@dataclass(frozen=True)
class ImportConfig:
    src: str = opt("", "Folder with a draft head in an engine layout (exported here or released).")
    out: str = opt("", "Output head folder (this project's format).")
    target: str = opt("smollm2", "Target the head belongs to (hub id, folder or alias); checked against the head.")
    format: str = opt("", f"Layout of src ({', '.join(FORMATS)}); empty: detect it.")


def run_export(cfg: ExportConfig) -> Path:
    """Export (and optionally push) as ``cfg`` says; loads the target only when one is named."""
    target = None
    if cfg.target:
        from selfdraft.target import load_target

        target = load_target(cfg.target).model
    path = export_head(cfg.head, cfg.format, cfg.out, target)
    if cfg.push_to_hub:
        push_to_hub(path, cfg.push_to_hub)
    return path


def run_import(cfg: ImportConfig) -> Path:
    from selfdraft.target import load_target

    target = load_target(cfg.target)
    return import_head(cfg.src, cfg.out, target.model, cfg.format or None, target_name=target.name)
