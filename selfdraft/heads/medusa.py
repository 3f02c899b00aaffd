"""Medusa draft heads (Cai et al., 2024): K heads on the target's last hidden state.

Head k (0-based) predicts the token k+2 positions ahead of the position whose hidden state it reads
(the target's own lm_head predicts k = -1, the next token). Each head is a stack of residual blocks
``x + SiLU(W x + b)`` with W zero-initialised, so a fresh head starts as the base prediction,
followed by a vocabulary projection: either its own copy initialised from the target's lm_head
(Medusa's layout) or the target's lm_head itself (``share_lm_head``: no copy, much smaller).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from selfdraft.heads.layers import shared_projection


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    """Target hidden size."""
    vocab_size: int
    """Target vocabulary size."""
    num_heads: int = 4
    """K: how many future tokens are drafted (depths 1..K of the tree)."""
    num_layers: int = 1
    """Residual blocks per head."""
    share_lm_head: bool = True
    """Project with the target's lm_head (no copy) instead of a per-head vocabulary matrix."""


class ResBlock(nn.Module):
    """x + SiLU(W x + b), zero-initialised weight: the identity at init."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads. forward: (..., hidden) -> (K, ..., vocab) logits."""

    def __init__(self, cfg: MedusaConfig, target_lm_head: nn.Module | None = None):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(cfg.hidden_size) for _ in range(cfg.num_layers)]) for _ in range(cfg.num_heads)
        )
        self.lm_heads = None
        if not cfg.share_lm_head:
            self.lm_heads = nn.ModuleList(
                nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(cfg.num_heads)
            )
            if target_lm_head is not None:
                with torch.no_grad():
                    for head in self.lm_heads:
                        head.weight.copy_(target_lm_head.weight)
        # a plain attribute, not a submodule: the target's lm_head is shared, never saved with the head
        self.__dict__["target_lm_head"] = target_lm_head

    def attach(self, target_lm_head: nn.Module) -> None:
        """Point at the target's lm_head (after loading a saved head)."""
        self.__dict__["target_lm_head"] = target_lm_head

    def features(self, hidden: Tensor) -> list[Tensor]:
        return [block(hidden) for block in self.blocks]

    def forward(self, hidden: Tensor) -> Tensor:
        feats = self.features(hidden)
        if self.lm_heads is not None:
            return torch.stack([head(f) for head, f in zip(self.lm_heads, feats)])
        if self.target_lm_head is None:
            raise RuntimeError("MedusaHeads with share_lm_head=True needs attach(target.lm_head) first")
        return torch.stack([shared_projection(self.target_lm_head, f) for f in feats])


def medusa_loss(
    head_logits: Tensor, input_ids: Tensor, loss_mask: Tensor, decay: float = 0.8
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Medusa-1 loss: sum_k decay^k * CE(head k at t, token t+k+2), over positions whose target is trained.

    head_logits: (K, batch, seq, vocab); input_ids, loss_mask: (batch, seq).
    Returns (loss, per-head losses, per-head top-1 accuracies).
    """
    total = head_logits.new_zeros((), dtype=torch.float32)
    losses, accs = [], []
    for k in range(head_logits.shape[0]):
        shift = k + 2
        logits = head_logits[k, :, :-shift].float()
        labels = input_ids[:, shift:]
        mask = loss_mask[:, shift:].bool()
        if not bool(mask.any()):
            losses.append(total.new_zeros(()))
            accs.append(total.new_zeros(()))
            continue
        ce = nn.functional.cross_entropy(logits[mask], labels[mask])
        total = total + (decay**k) * ce
        losses.append(ce.detach())
        accs.append((logits[mask].argmax(-1) == labels[mask]).float().mean())
    return total, losses, accs
