"""EAGLE-3 draft head (Li et al., 2025): fused multi-layer features, one decoder layer, reduced vocabulary.

Inputs at position t: the embedding of token t+1 (the target's own embedding, shared) and a feature:
at the first step ``fc(cat(low_t, mid_t, high_t))`` from three target layers, at later steps the
head's own previous output (training-time test). The decoder layer normalises both and attends with
q/k/v projections over their concatenation (2H -> heads), the residual stream is the feature; the
output, after a final norm, is projected to a draft vocabulary of the most frequent target tokens
(``d2t``: target id = draft id + d2t[draft id]; ``t2d``: which target ids are in it).

Parameter names follow the layout the serving engines load (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d``); the code is ours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from selfdraft.heads.layers import MLP, Attention, RMSNorm, target_dims


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    """Draft hidden size (= target hidden size)."""
    target_hidden_size: int
    """Width of each fused target feature."""
    intermediate_size: int
    """MLP width of the draft decoder layer."""
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    """Target vocabulary size."""
    draft_vocab_size: int
    """Reduced draft vocabulary (most frequent target tokens)."""
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    feature_layers: tuple[int, int, int] = (2, 0, 0)
    """Target hidden-state indices fused (inputs of layers low, mid, high); default 2, L//2, L-3."""

    @staticmethod
    def for_target(model: nn.Module, draft_vocab_size: int) -> Eagle3Config:
        n = model.config.num_hidden_layers
        return Eagle3Config(
            **target_dims(model),
            target_hidden_size=model.config.hidden_size,
            draft_vocab_size=min(draft_vocab_size, model.config.vocab_size),
            feature_layers=(min(2, n - 1), n // 2, max(n - 3, 0)),
        )


class MidLayer(nn.Module):
    """The draft decoder layer over (embedding, feature) pairs."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(2 * cfg.hidden_size, cfg.hidden_size, cfg.num_attention_heads,
                                   cfg.num_key_value_heads, cfg.head_dim, cfg.rope_theta)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def qkv(self, emb: Tensor, feature: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.self_attn.project(self.attention_input(emb, feature), positions)

    def kv(self, emb: Tensor, feature: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.self_attn.project_kv(self.attention_input(emb, feature), positions)

    def attention_input(self, emb: Tensor, feature: Tensor) -> Tensor:
        """The 2H-wide input of the attention's projections: the normed embedding and feature side by side."""
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(feature)], -1)

    def finish(self, feature: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        return self.residual(feature, self.self_attn.attend(q, k, v, mask))

    def finish_ttt(self, feature: Tensor, q: Tensor, keys: list[Tensor], values: list[Tensor], key_mask: Tensor) -> Tensor:
        """:meth:`finish` for unrolled training step ``len(keys) - 1`` under the :func:`ttt_mask`, without materialising it.

        keys, values: every step's (b, heads, s, hd) keys/values, already expanded to the query heads
        (once per step when it is appended, not again at each later step)."""
        out = ttt_attention(q, keys, values, key_mask)
        return self.residual(feature, self.self_attn.output(out))

    def residual(self, feature: Tensor, attended: Tensor) -> Tensor:
        h = feature + attended
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """EAGLE-3 head. The target's embedding is referenced (not a submodule, never saved)."""

    def __init__(self, cfg: Eagle3Config, target_embedding: nn.Module | None = None):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.__dict__["embed"] = target_embedding

    def set_draft_vocab(self, draft_to_target: Tensor) -> None:
        """draft_to_target: (draft_vocab,) target ids, sorted ascending."""
        ids = draft_to_target.to(self.d2t.device).long()
        if ids.numel() != self.cfg.draft_vocab_size:
            raise ValueError(f"draft vocab has {ids.numel()} ids, config says {self.cfg.draft_vocab_size}")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_ids(self) -> Tensor:
        """(draft_vocab,) target id of each draft id."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.cfg.feature_layers)

    def fuse(self, features: Tensor) -> Tensor:
        """(…, 3 * target_hidden) concatenated target features -> (…, hidden) draft feature."""
        return self.fc(features)

    def project(self, emb: Tensor, feature: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Drafting step, first half: (b, s, H) embeddings and features -> (residual, q, k, v)."""
        return (feature, *self.midlayer.qkv(emb, feature, positions))

    def complete(self, residual: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """Drafting step, second half: attend over the (cached) keys -> (b, s, H) output feature."""
        return self.midlayer.finish(residual, q, k, v, mask)

    def key_values(self, emb: Tensor, feature: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`project`'s keys and values alone, for committed inputs whose outputs nothing reads."""
        return self.midlayer.kv(emb, feature, positions)

    def logits(self, h: Tensor) -> Tensor:
        """Draft-vocabulary logits from the layer output."""
        return self.lm_head(self.norm(h))

    def forward(self, features: Tensor, input_ids: Tensor, target_logits: Tensor, loss_mask: Tensor,
                attention_mask: Tensor, steps: int = 7, decay: float = 0.8):
        """Training forward (so DDP wrappers see it): the :func:`eagle3_loss` triple."""
        return eagle3_loss(self, features, input_ids, target_logits, loss_mask, attention_mask, steps, decay)


def select_draft_vocab(token_counts: Tensor, size: int) -> Tensor:
    """The ``size`` most frequent target ids, sorted ascending (ties: lower id first)."""
    order = torch.sort(-token_counts.double(), stable=True).indices[:size]
    return torch.sort(order).values


def ttt_mask(seq: int, step: int, device: torch.device | None = None) -> Tensor:
    """Training-time-test attention mask for unrolled step ``step`` (0-based): (seq, seq * (step + 1)) bool.

    The query at position t sees step-0 keys at positions <= t (causal) and, for every later step
    i <= step, only the key at its own position t (the draft's own earlier outputs along its path).
    """
    causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool, device=device))
    diag = torch.eye(seq, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diag] * step, dim=1)


def ttt_attention(q: Tensor, keys: list[Tensor], values: list[Tensor], key_mask: Tensor) -> Tensor:
    """Attention of unrolled step j = len(keys) - 1 under ``ttt_mask(s, j) & key_mask``, in O(s^2 + j s) scores.

    q: (b, h, s, d); keys, values: per step (b, h, s, d); key_mask: (b, s) bool (False = padding).
    Query t sees the step-0 keys at positions <= t and, of every later step, only the key at t: so
    the later steps add one score per query (a row-wise dot product), not an (s, s) block each. One
    softmax runs over the causal scores and the j extra scores together; the output is the step-0
    attention plus each later step's value weighted by its score. Equal to SDPA under the full
    (s, s * (j + 1)) mask, whose cost grows with j^2 over an unrolled run.
    """
    scale = q.shape[-1] ** -0.5
    s = q.shape[2]
    causal = torch.tril(torch.ones(s, s, dtype=torch.bool, device=q.device))[None, None] & key_mask[:, None, None, :]
    scores = (q @ keys[0].transpose(-1, -2)) * scale
    extra = [(q * k).sum(-1, keepdim=True) * scale for k in keys[1:]]
    neg = torch.finfo(scores.dtype).min
    scores = scores.masked_fill(~causal, neg)
    extra = [e.masked_fill(~key_mask[:, None, :, None], neg) for e in extra]
    weights = torch.softmax(torch.cat([scores, *extra], -1).float(), -1).to(q.dtype)
    out = weights[..., :s] @ values[0]
    for i, v in enumerate(values[1:]):
        out = out + weights[..., s + i : s + i + 1] * v
    return out


def eagle3_loss(
    head: Eagle3Head,
    features: Tensor,
    input_ids: Tensor,
    target_logits: Tensor,
    loss_mask: Tensor,
    attention_mask: Tensor,
    steps: int = 7,
    decay: float = 0.8,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """EAGLE-3 training loss with training-time test.

    features: (b, s, 3H) fused-layer target features; input_ids, loss_mask, attention_mask: (b, s);
    target_logits: (b, s, V) target logits, or (b, s, draft_vocab) already at the draft ids. Step j predicts token t+2+j from position t; its target
    is the target's distribution at position t+1+j restricted to the draft vocabulary. Returns
    (sum_j decay^j * loss_j, per-step losses, per-step top-1 accuracies against the target argmax).
    """
    b, s, _ = features.shape
    embed = head.embed
    if target_logits.shape[-1] != head.cfg.draft_vocab_size:  # full-vocabulary logits: keep the draft ids
        target_logits = target_logits[..., head.draft_ids]
    # the target distribution restricted to the draft vocabulary and renormalised, once for all steps
    p_all = torch.softmax(target_logits.float(), -1)
    key_mask = attention_mask.bool()
    positions = torch.arange(s, device=features.device)[None].expand(b, s)
    feature = head.fuse(features)
    keys: list[Tensor] = []
    values: list[Tensor] = []
    total = features.new_zeros((), dtype=torch.float32)
    losses, accs = [], []
    for j in range(steps):
        if j + 2 > s:
            break
        # inputs at t: embedding of token t+1+j (right-shifted; the tail is padding and masked out)
        tok = torch.cat([input_ids[:, 1 + j :], input_ids.new_zeros(b, 1 + j)], 1)
        emb = embed(tok).to(feature.dtype)
        q, k, v = head.midlayer.qkv(emb, feature, positions + j)
        keys.append(head.midlayer.self_attn.expand_kv(k))
        values.append(head.midlayer.self_attn.expand_kv(v))
        h = head.midlayer.finish_ttt(feature, q, keys, values, key_mask)
        # positions t = 0 .. n-1 have a label t+2+j inside the sequence; the target there is p at t+1+j
        n = s - 2 - j
        valid = loss_mask[:, 1 + j : 1 + j + n].bool() & key_mask[:, 2 + j : 2 + j + n]
        if bool(valid.any()):
            logq = torch.log_softmax(head.logits(h[:, :n][valid]).float(), -1)
            p = p_all[:, 1 + j : 1 + j + n][valid]
            step_loss = -(p * logq).sum(-1).mean()
            total = total + (decay**j) * step_loss
            losses.append(step_loss.detach())
            accs.append((logq.argmax(-1) == p.argmax(-1)).float().mean())
        feature = h
    return total, losses, accs
