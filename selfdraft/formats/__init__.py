"""The format protocol shared by the export layouts: a pair of pure functions and strict renaming.

A format turns (own config.json, own tensors, target) into (engine config.json, engine tensors) and
back; :mod:`selfdraft.export` holds the registry and the folder I/O, ``eagle.py`` and ``medusa.py``
the layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from selfdraft.heads.artifact import HeadMismatchError

Tensors = dict[str, Tensor]


class ExportError(ValueError):
    """The head cannot be written in the requested format; the message says why and what to do."""


@dataclass(frozen=True)
class Format:
    """One engine layout: its name, the head type it holds, and the two conversions."""

    name: str
    head_type: str
    """The own head type this format holds."""
    engines: str
    """Which loaders read it (documentation, copied into the manifest)."""
    weights: tuple[str, ...]
    """Weights file names: the first is written, any is read (older releases use the later ones)."""
    to_engine: Callable[[dict, Tensors, nn.Module | None], tuple[dict, Tensors]]
    """(own config.json, own tensors, target or None) -> (engine config.json, engine tensors)."""
    from_engine: Callable[[dict, Tensors, nn.Module, dict | None], tuple[dict, Tensors]]
    """(engine config.json, engine tensors, target, exported head_config or None) -> (head_config, own tensors)."""


def rename(tensors: Tensors, pairs: list[tuple[str, str]], where: str) -> Tensors:
    """Rename ``a -> b`` for every pair; any missing ``a`` or left-over tensor is an error."""
    left = dict(tensors)
    missing = [a for a, _ in pairs if a not in left]
    out = {b: left.pop(a) for a, b in pairs if a in left}
    if missing or left:
        detail = ([f"missing {missing[:5]}"] if missing else []) + ([f"unexpected {sorted(left)[:5]}"] if left else [])
        raise HeadMismatchError(f"{where}: tensors do not match the config: " + "; ".join(detail))
    return out


def swap(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The inverse renaming."""
    return [(b, a) for a, b in pairs]


def float_dtype(tensors: Tensors) -> torch.dtype:
    """The dtype of the first floating-point tensor (the head's weight dtype); float32 if none."""
    return next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> 'float32' (the ``torch_dtype`` spelling of HF configs)."""
    return str(dtype).removeprefix("torch.")


def check_dims(c: dict, target: nn.Module, where: str, fields: dict[str, str]) -> None:
    """Each head field must equal the target config field it names."""
    for mine, theirs in fields.items():
        have = getattr(target.config, theirs)
        if c[mine] != have:
            raise HeadMismatchError(f"{where}: config.json {mine} is {c[mine]}, the target's {theirs} is {have}: the head belongs to another target")

