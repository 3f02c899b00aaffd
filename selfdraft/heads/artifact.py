"""Head folders: ``model.safetensors`` + ``config.json``, written atomically, loaded with checks.

config.json records the head type, its hyperparameters, and what it was trained for: the target's
name, architecture, hidden size, vocabulary and a fingerprint of its shared tensors (embedding and
lm_head). Loading refuses a head whose target does not match, naming the field that differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

FORMAT_VERSION = 1


class HeadMismatchError(ValueError):
    """A saved head does not belong to the given target, or its folder is incomplete or corrupt."""


def fingerprint(model: nn.Module) -> str:
    """A dtype-independent hash of a strided sample of the target's embedding and lm_head."""
    h = hashlib.sha256()
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        w = module.weight.detach().flatten()
        idx = torch.arange(4096) * max(1, w.numel() // 4096) % w.numel()
        # bf16 rounding makes the same weights loaded in fp32 or bf16 give the same bytes
        sample = w[idx].to(torch.bfloat16).view(torch.int16)
        h.update(str(tuple(module.weight.shape)).encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def weights_fingerprint(model: nn.Module) -> str:
    """A hash of a strided sample of every parameter: tells a fine-tuned (e.g. Medusa-2) target from its base."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if "lora_" in name:
            continue
        w = p.detach().flatten()
        idx = torch.arange(256) * max(1, w.numel() // 256) % w.numel()
        h.update(name.replace(".base_layer", "").encode())
        h.update(w[idx].to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def weights_digest(model: nn.Module) -> str:
    """sha256 over every tensor's bytes (proves a frozen target unchanged); LoRA tensors are skipped and
    peft's ``base_layer`` names folded, so a Medusa-2 target is compared by its base weights."""
    h = hashlib.sha256()
    items = {}
    for name, tensor in model.state_dict().items():
        if "lora_" in name:
            continue
        key = name.replace(".base_layer", "").replace("base_model.model.", "")
        items[key] = tensor
    for name in sorted(items):
        h.update(name.encode())
        h.update(items[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def target_info(model: nn.Module, name: str) -> dict[str, Any]:
    cfg = model.config
    return {
        "name": name,
        "architecture": type(model).__name__,
        "model_type": cfg.model_type,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "fingerprint": fingerprint(model),
    }


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` atomically (a temp file in the same folder, then a rename); makes the folder.

    Readers see the old file or the new one, never a partial write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; keep the usual umask-based mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a fully written folder into place; an existing one is swapped out first, then removed.

    At every moment ``final`` is either the old complete folder or the new one.
    """
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def save_head(path: str | Path, head_type: str, config: Any, module: nn.Module, target: dict, extra: dict | None = None) -> Path:
    """Write the head folder atomically (temp folder, then rename over any old one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        tensors = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "selfdraft"})
        meta = {
            "format_version": FORMAT_VERSION,
            "head_type": head_type,
            "head_config": dataclasses.asdict(config),
            "target": target,
            **(extra or {}),
        }
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_head(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, tensors) of a head folder, with clear errors for missing or corrupt files."""
    path = Path(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    for f in (cfg_file, weights):
        if not f.is_file():
            raise HeadMismatchError(f"{path} is not a head folder: {f.name} is missing")
    meta = json.loads(cfg_file.read_text())
    try:
        tensors = load_file(str(weights))
    except Exception as err:  # safetensors raises its own error types for truncated files
        raise HeadMismatchError(f"{weights} is corrupt or truncated ({err}); re-export or retrain the head") from err
    return meta, tensors


def check_target(meta: dict, model: nn.Module) -> None:
    """Raise if the head was trained for another target, naming the first differing field."""
    want = meta.get("target", {})
    have = target_info(model, want.get("name", ""))
    for key in ("model_type", "hidden_size", "vocab_size", "num_hidden_layers", "fingerprint"):
        if key in want and want[key] != have[key]:
            raise HeadMismatchError(
                f"head was trained for another target: {key} is {want[key]} in the head, {have[key]} in "
                f"the target '{want.get('name', '?')}' vs the one given; load the matching target"
            )
    if "weights_fingerprint" in want and want["weights_fingerprint"] != weights_fingerprint(model):
        raise HeadMismatchError(
            f"head was trained with an adapted target (Medusa-2): its weights differ from the one given; "
            f"load the target saved with it ({want.get('name', '?')})"
        )


def load_state_strict(module: nn.Module, tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """Load every tensor, refusing missing, unexpected or mis-shaped ones (no silent partial load)."""
    own = module.state_dict()
    missing = sorted(set(own) - set(tensors))
    extra = sorted(set(tensors) - set(own))
    shapes = [k for k in own if k in tensors and tuple(own[k].shape) != tuple(tensors[k].shape)]
    if missing or extra or shapes:
        detail = []
        if missing:
            detail.append(f"missing {missing[:5]}")
        if extra:
            detail.append(f"unexpected {extra[:5]}")
        if shapes:
            detail.append("wrong shape " + ", ".join(f"{k} {tuple(tensors[k].shape)} != {tuple(own[k].shape)}" for k in shapes[:5]))
        raise HeadMismatchError(f"{path}: tensors do not match the head config: " + "; ".join(detail))
    module.load_state_dict(tensors, strict=True)
