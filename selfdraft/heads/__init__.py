"""Draft heads trained on a frozen target, and a registry that builds, saves and loads them."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from selfdraft.heads.artifact import (
    HeadMismatchError,
    check_target,
    load_state_strict,
    read_head,
    save_head,
    target_info,
)
from selfdraft.heads.eagle1 import Eagle1Config, Eagle1Head
from selfdraft.heads.eagle3 import Eagle3Config, Eagle3Head
from selfdraft.heads.medusa import MedusaConfig, MedusaHeads
from selfdraft.hugepages import move_to_huge_pages


@dataclass(frozen=True)
class HeadType:
    config_cls: Callable[..., object]
    """Builds the head config from config.json's ``head_config`` (keyword arguments)."""
    build: Callable[[object, nn.Module], nn.Module]
    """(config, target model) -> head module referencing the target's shared weights."""
    drafter: Callable[..., object]
    """(head module, **options) -> Drafter."""


def _medusa_drafter(head: MedusaHeads, **options):
    from selfdraft.drafters.medusa import MedusaDrafter

    return MedusaDrafter(head, **options)


def _eagle_drafter(head: Eagle1Head | Eagle3Head, **options):
    from selfdraft.drafters.eagle import EagleDrafter

    return EagleDrafter(head, **options)


def _eagle3_config(**data) -> Eagle3Config:
    return Eagle3Config(**{**data, "feature_layers": tuple(data["feature_layers"])})


HEADS: dict[str, HeadType] = {
    "medusa": HeadType(MedusaConfig, lambda cfg, target: MedusaHeads(cfg, target.get_output_embeddings()), _medusa_drafter),
    "eagle1": HeadType(
        Eagle1Config,
        lambda cfg, target: Eagle1Head(cfg, target.get_input_embeddings(), target.get_output_embeddings()),
        _eagle_drafter,
    ),
    "eagle3": HeadType(_eagle3_config, lambda cfg, target: Eagle3Head(cfg, target.get_input_embeddings()), _eagle_drafter),
}


def head_type(name: str) -> HeadType:
    if name not in HEADS:
        raise KeyError(f"unknown head type '{name}'; known: {', '.join(sorted(HEADS))}")
    return HEADS[name]


def build_head(meta: dict, tensors: dict, target: nn.Module, path: str | Path) -> tuple[str, object, nn.Module]:
    """(head type, config, module) from a head folder's config.json and tensors, checked against
    ``target``, every tensor loaded strictly; the module keeps its parameters' dtype and grad flags."""
    kind = meta.get("head_type")
    spec = head_type(kind)
    check_target(meta, target)
    cfg = spec.config_cls(**meta["head_config"])
    head = spec.build(cfg, target)
    load_state_strict(head, tensors, path)
    return kind, cfg, head


def load_head(path: str | Path, target: nn.Module) -> tuple[str, nn.Module, dict]:
    """Load a head folder for ``target`` (checked) for drafting; returns (head type, module, config.json)."""
    meta, tensors = read_head(path)
    kind, _, head = build_head(meta, tensors, target, path)
    dtype = target.get_input_embeddings().weight.dtype
    head.to(dtype=dtype, device=next(target.parameters()).device).eval().requires_grad_(False)
    # the head's own weights (the target's embedding and lm_head are referenced, not parameters here)
    move_to_huge_pages(head)
    n = sum(p.numel() for p in head.parameters())
    total = sum(p.numel() for p in target.parameters())
    print(f"[head {kind}: {n / 1e6:.2f}M parameters = {100 * n / total:.1f}% of the target's {total / 1e6:.1f}M]", file=sys.stderr)
    return kind, head, meta


def save(path: str | Path, kind: str, cfg: object, head: nn.Module, target: nn.Module, target_name: str) -> Path:
    return save_head(path, kind, cfg, head, target_info(target, target_name))


__all__ = ["HEADS", "Eagle1Config", "Eagle1Head", "Eagle3Config", "Eagle3Head", "HeadMismatchError", "MedusaConfig", "MedusaHeads", "build_head", "head_type", "load_head", "save"]
