"""Medusa-2 (Cai et al., 2024): Medusa heads trained jointly with the target through LoRA adapters.

The target's base weights stay frozen; peft injects low-rank adapters into its attention (and
optionally MLP) projections, and the adapters and the heads train together on

    loss = lm_weight * CE(target logits at t, token t+1) + sum_k decay^k * CE(head k at t, token t+k+2)

over assistant tokens. The result is a new target (the base with the adapter merged, or the adapter
saved on its own) and heads that read that new target's hidden states; they are saved together and
the head records a fingerprint of the merged weights, so it refuses to load on the base target.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from selfdraft.heads.medusa import MedusaHeads, medusa_loss


def attach_lora(model: nn.Module, rank: int, alpha: int, dropout: float, modules: Sequence[str]) -> nn.Module:
    """Wrap ``model`` with peft LoRA adapters on ``modules``; only the adapters are trainable."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(modules),
                        bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def lm_loss(logits: Tensor, input_ids: Tensor, loss_mask: Tensor) -> Tensor:
    """Next-token cross-entropy on trained (assistant) tokens. logits: (b, s, V); ids, mask: (b, s)."""
    mask = loss_mask[:, 1:].bool()
    if not bool(mask.any()):
        return logits.sum() * 0.0
    return nn.functional.cross_entropy(logits[:, :-1][mask].float(), input_ids[:, 1:][mask])


class Medusa2(nn.Module):
    """The LoRA-wrapped target and the Medusa heads as one trainable module (one DDP wrapper)."""

    def __init__(self, backbone: nn.Module, heads: MedusaHeads):
        super().__init__()
        self.backbone = backbone
        self.heads = heads

    def forward(self, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor, decay: float = 0.8,
                lm_weight: float = 1.0) -> tuple[Tensor, dict[str, Tensor], list[Tensor]]:
        """Combined loss, named parts (lm, head k) and per-head top-1 accuracies."""
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=[-1])
        head_total, losses, accs = medusa_loss(self.heads, out.hidden_states[-1], input_ids, loss_mask, decay)
        lm = lm_loss(out.logits, input_ids, loss_mask)
        parts = {"lm": lm.detach(), **{f"head{k}": v for k, v in enumerate(losses)}}
        return lm_weight * lm + head_total, parts, accs

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]
