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

    def project(self, k: int, feature: Tensor) -> Tensor:
        """Head ``k``'s vocabulary logits of its states ``feature``."""
        if self.lm_heads is not None:
            return self.lm_heads[k](feature)
        if self.target_lm_head is None:
            raise RuntimeError("MedusaHeads with share_lm_head=True needs attach(target.lm_head) first")
        return shared_projection(self.target_lm_head, feature)

    def forward(self, hidden: Tensor, select: list[Tensor] | None = None) -> Tensor | list[Tensor]:
        """(..., hidden) -> (K, ..., vocab) logits. With ``select`` (one boolean mask per head over
        hidden's leading dims): a list of (n_k, vocab) logits of head k at its selected positions only
        (training: the vocabulary projection, most of a step's cost, runs where the loss reads it)."""
        if select is not None:
            return [self.project(k, block(hidden[m])) for k, (block, m) in enumerate(zip(self.blocks, select))]
        return torch.stack([self.project(k, f) for k, f in enumerate(self.features(hidden))])


def medusa_loss(
    heads: nn.Module, hidden: Tensor, input_ids: Tensor, loss_mask: Tensor, decay: float = 0.8
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Medusa-1 loss: sum_k decay^k * CE(head k at t, token t+k+2), over positions whose target is trained.

    heads: MedusaHeads, or a wrapper whose forward is theirs (DDP); hidden: (batch, seq, hidden)
    target last hidden states; input_ids, loss_mask: (batch, seq). Each head is projected at the
    positions it is scored on only. Returns (loss, per-head losses, per-head top-1 accuracies).
    """
    num_heads = getattr(heads, "module", heads).cfg.num_heads
    select, labels = [], []
    for k in range(num_heads):
        shift = k + 2
        trained = loss_mask[:, shift:].bool()
        m = torch.zeros_like(loss_mask, dtype=torch.bool)
        m[:, : max(0, m.shape[1] - shift)] = trained
        select.append(m)
        labels.append(input_ids[:, shift:][trained])
    total = hidden.new_zeros((), dtype=torch.float32)
    losses, accs = [], []
    for k, (logits, target) in enumerate(zip(heads(hidden, select), labels)):
        if target.numel() == 0:
            losses.append(total.new_zeros(()))
            accs.append(total.new_zeros(()))
            continue
        logits = logits.float()
        ce = nn.functional.cross_entropy(logits, target)
        total = total + (decay**k) * ce
        losses.append(ce.detach())
        accs.append((logits.argmax(-1) == target).float().mean())
    return total, losses, accs
