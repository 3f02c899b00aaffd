"""EAGLE-1 draft head (Li et al., 2024): feature-level autoregression with one decoder layer.

At position t the head reads ``x = fc(cat(embed(token_{t+1}), f_t))``, where ``f_t`` is the target's
final (post-norm) hidden state, and one Llama-style decoder layer sized from the target's config
turns it into a prediction of ``f_{t+1}``. Tokens come from the target's own lm_head applied to the
predicted feature: the embedding and lm_head are the target's (referenced, never copied or saved).
When drafting deeper, the head's predicted feature stands in for the target's.

As in the EAGLE reference layout, the layer has no input norm (the fused input goes straight into
attention) and the head has no final norm (the target's feature is already normed). Parameter names
follow that layout (``fc``, ``layers.0.*``) so the export is a renaming-free copy.

Training loss: smooth-L1 regression of ``f_{t+1}`` plus a weighted soft cross-entropy between the
target's next-token distribution at t+1 and the lm_head of the predicted feature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from selfdraft.heads.layers import MLP, Attention, RMSNorm, shared_projection, target_dims


@dataclass(frozen=True)
class Eagle1Config:
    hidden_size: int
    """Target (and draft) hidden size."""
    intermediate_size: int
    """MLP width of the draft decoder layer."""
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    """Target vocabulary size (drafting uses the target's full lm_head)."""
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    fc_bias: bool = True
    """The fusion layer has a bias, as in the EAGLE-1 reference checkpoints."""

    @staticmethod
    def for_target(model: nn.Module) -> Eagle1Config:
        return Eagle1Config(**target_dims(model))


class Eagle1Layer(nn.Module):
    """Llama decoder layer without the input norm: x + attn(x), then h + mlp(norm(h))."""

    def __init__(self, cfg: Eagle1Config):
        super().__init__()
        self.self_attn = Attention(cfg.hidden_size, cfg.hidden_size, cfg.num_attention_heads,
                                   cfg.num_key_value_heads, cfg.head_dim, cfg.rope_theta)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)


class Eagle1Head(nn.Module):
    """EAGLE-1 head. The target's embedding and lm_head are referenced (not submodules, never saved)."""

    def __init__(self, cfg: Eagle1Config, target_embedding: nn.Module | None = None,
                 target_lm_head: nn.Module | None = None):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.layers = nn.ModuleList([Eagle1Layer(cfg)])
        self.__dict__["embed"] = target_embedding
        self.__dict__["lm_head"] = target_lm_head

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target's final normed hidden state."""
        return (-1,)

    @property
    def draft_ids(self) -> None:
        """Drafting is over the full target vocabulary (no reduced map)."""
        return None

    def fuse(self, features: Tensor) -> Tensor:
        """The target feature is used as it is: (…, H) -> (…, H)."""
        return features

    def project(self, emb: Tensor, feature: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Drafting step, first half: (b, s, H) embeddings and features -> (residual, q, k, v)."""
        x = self.fc(torch.cat([emb, feature], -1))
        return (x, *self.layers[0].self_attn.project(x, positions))

    def key_values(self, emb: Tensor, feature: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`project`'s keys and values alone, for committed inputs whose outputs nothing reads."""
        return self.layers[0].self_attn.project_kv(self.fc(torch.cat([emb, feature], -1)), positions)

    def complete(self, residual: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """Drafting step, second half: attend over the (cached) keys -> (b, s, H) predicted feature."""
        layer = self.layers[0]
        h = residual + layer.self_attn.attend(q, k, v, mask)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, h: Tensor) -> Tensor:
        """Target-vocabulary logits of a predicted feature, through the target's lm_head."""
        return shared_projection(self.lm_head, h)

    def forward(self, features: Tensor, input_ids: Tensor, target_logits: Tensor, loss_mask: Tensor,
                attention_mask: Tensor, feature_weight: float = 1.0, token_weight: float = 0.1,
                noise: float = 0.0):
        """Training forward (so DDP wrappers see it): the :func:`eagle1_loss` triple."""
        return eagle1_loss(self, features, input_ids, target_logits, loss_mask, attention_mask,
                           feature_weight, token_weight, noise)


def trained_positions(loss_mask: Tensor, attention_mask: Tensor) -> Tensor:
    """(b, s) positions t that EAGLE-1 trains: token t+1 is trained (assistant) and t+2 exists."""
    b = loss_mask.shape[0]
    valid = torch.cat([loss_mask[:, 1:], loss_mask.new_zeros(b, 1)], 1).bool()
    return valid & torch.cat([attention_mask[:, 2:], attention_mask.new_zeros(b, 2)], 1).bool()


def next_rows(x: Tensor, trained: Tensor) -> Tensor:
    """(b, s, ...) -> (n, ...): x at t+1 for each position t of the :func:`trained_positions` mask
    ``trained``, row-major (the target feature and logits the loss reads; the last position is never
    trained)."""
    return x[:, 1:][trained[:, :-1]]


def eagle1_loss(
    head: Eagle1Head,
    features: Tensor,
    input_ids: Tensor,
    target_logits: Tensor,
    loss_mask: Tensor,
    attention_mask: Tensor,
    feature_weight: float = 1.0,
    token_weight: float = 0.1,
    noise: float = 0.0,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """EAGLE-1 loss: feature_weight * SmoothL1(f̂_{t+1}, f_{t+1}) + token_weight * CE(p_{t+1}, q_{t+1}).

    features: (b, s, H) target post-norm hidden states; input_ids, loss_mask, attention_mask: (b, s);
    target_logits: (b, s, V), or (n, V): the rows the loss reads only (:func:`next_rows`; projecting
    every position through the full vocabulary is most of a training step). Position t (input: f_t
    and token t+1) predicts f_{t+1}; it is trained where token t+1 is a trained (assistant) token
    and t+2 exists. ``noise``: width of uniform noise added to the input features (EAGLE's
    robustness trick; 0 = off). Returns (loss, [feature loss, token loss], [top-1 accuracy of the
    draft token against the target's argmax]).
    """
    b, s, _ = features.shape
    inputs = features
    if noise > 0:
        inputs = features + (torch.rand_like(features) - 0.5) * noise
    tok = torch.cat([input_ids[:, 1:], input_ids.new_zeros(b, 1)], 1)
    emb = head.embed(tok).to(inputs.dtype)
    positions = torch.arange(s, device=features.device)[None].expand(b, s)
    residual, q, k, v = head.project(emb, inputs, positions)
    mask = torch.tril(torch.ones(s, s, dtype=torch.bool, device=features.device))[None, None]
    mask = mask & attention_mask.bool()[:, None, None, :]
    pred = head.complete(residual, q, k, v, mask)
    valid = trained_positions(loss_mask, attention_mask)
    if not bool(valid.any()):
        zero = pred.sum().float() * 0.0
        return zero, [zero.detach(), zero.detach()], [zero.detach()]
    feat_loss = nn.functional.smooth_l1_loss(pred[valid].float(), next_rows(features, valid).float())
    if target_logits.dim() == 3:
        target_logits = next_rows(target_logits, valid)
    p = torch.softmax(target_logits.float(), -1)
    logq = torch.log_softmax(head.logits(pred[valid]).float(), -1)
    tok_loss = -(p * logq).sum(-1).mean()
    acc = (logq.argmax(-1) == p.argmax(-1)).float().mean()
    loss = feature_weight * feat_loss + token_weight * tok_loss
    return loss, [feat_loss.detach(), tok_loss.detach()], [acc]
