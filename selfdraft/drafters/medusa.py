"""Medusa drafting: a static tree filled from per-head top-k (Cai et al., 2024).

The tree is data (``configs/trees/*.yaml``): Medusa choice paths such as ``[0, 1]`` = top-1 of
head 0, then top-2 of head 1. Every node at depth d with rank r gets the r-th most likely token of
head d-1, read from the target's final hidden state at the last accepted position. The children
are a deterministic function of that state, so sampling stays lossless (q is one-hot).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import yaml
from torch import Tensor

from selfdraft.drafters.base import Draft, StepResult
from selfdraft.heads.medusa import MedusaHeads
from selfdraft.kernels import fused_modules
from selfdraft.sampling import SamplingConfig
from selfdraft.tree import tree_from_paths

DEFAULT_PATHS = ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (1,), (0, 1), (2,), (1, 0))


def load_paths(path: str) -> list[tuple[int, ...]]:
    data = yaml.safe_load(Path(path).read_text()) if Path(path).is_file() else None
    if not isinstance(data, dict) or not isinstance(data.get("paths"), list):
        raise FileNotFoundError(f"tree file {path} not found or has no 'paths:' list")
    return [tuple(int(r) for r in p) for p in data["paths"]]


class MedusaDrafter:
    hidden_layers: tuple[int, ...] = (-1,)
    proposes_for_free = False

    def __init__(self, heads: MedusaHeads, paths: Sequence[Sequence[int]] | str = DEFAULT_PATHS):
        """paths: Medusa choice paths, or a YAML file holding them under ``paths:``."""
        self.heads = heads
        if isinstance(paths, str):
            paths = load_paths(paths)
        paths = [tuple(p) for p in paths if len(p) <= heads.cfg.num_heads]
        if not paths:
            raise ValueError(f"no tree path fits {heads.cfg.num_heads} Medusa heads")
        self.tree, rank = tree_from_paths(paths)
        self.width = int(rank.max()) + 1
        self.head_of = (self.tree.depth[1:] - 1).clamp(min=0)
        self.rank_of = rank[1:]
        self.hidden: Tensor | None = None

    def reset(self, step: StepResult) -> None:
        self.hidden = step.hidden_states[-1][0, -1]

    def update(self, step: StepResult) -> None:
        self.hidden = step.hidden_states[-1][0, -1]

    @torch.inference_mode()
    def propose(self, tokens: Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        with fused_modules(self.heads, self.heads.target_lm_head):
            logits = self.heads(self.hidden)  # (K, V)
        top = logits.topk(self.width, dim=-1).indices.cpu()  # (K, width)
        node_tokens = torch.cat([tokens[-1:], top[self.head_of, self.rank_of]])
        return Draft(self.tree, node_tokens)
