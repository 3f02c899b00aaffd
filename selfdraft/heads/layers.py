"""The pieces of a Llama-style draft decoder layer shared by the EAGLE heads.

RMSNorm, rotary position embedding (rotate-half layout, as Llama/Qwen/Gemma use), grouped-query
attention whose K/V the drafters keep in their own cache, and the gated SiLU MLP. Parameter names
follow the Llama layout (``self_attn.q_proj`` ...), which is what serving engines load.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from selfdraft.kernels import attention_kernel


def shared_projection(lm_head: nn.Module, x: Tensor) -> Tensor:
    """The target's (shared, frozen) ``lm_head`` applied to head states ``x``. Heads trained in fp32 on
    a bf16 target without autocast (CPUs without native bf16) project through an fp32 view of the
    weight; in the weight's own dtype the module itself is called, so inference routes (the fused
    CPU kernels) apply."""
    if x.dtype == lm_head.weight.dtype:
        return lm_head(x)
    return nn.functional.linear(x, lm_head.weight.to(x.dtype))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """(…, seq) positions -> cos, sin of shape (…, seq, head_dim) (rotate-half layout)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


class RopeTable:
    """cos and sin of :func:`rope` for positions 0 .. n-1, computed once and grown (doubling) when a
    larger position comes: a drafting step looks its few positions up instead of computing them (the
    values are the same, element for element)."""

    def __init__(self, head_dim: int, theta: float):
        self.head_dim, self.theta = head_dim, theta
        self.cos = self.sin = torch.empty(0, head_dim)

    def __call__(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        if positions.device.type != "cpu":  # the lookup's max() would wait for the device: compute
            return rope(positions, self.head_dim, self.theta)
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if needed > self.cos.shape[0]:
            size = max(needed, 2 * self.cos.shape[0], 256)
            self.cos, self.sin = rope(torch.arange(size, device=positions.device), self.head_dim, self.theta)
        return self.cos[positions], self.sin[positions]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (batch, heads, seq, head_dim); cos/sin: (batch, seq, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return (x * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention; ``in_features`` may differ from the output width (EAGLE-3 reads 2H)."""

    def __init__(self, in_features: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_theta: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.rope_theta = num_heads, num_kv_heads, head_dim, rope_theta
        self.q_proj = nn.Linear(in_features, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.rope = RopeTable(head_dim, rope_theta)

    def project(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x: (b, s, in) -> q (b, nh, s, hd), k and v (b, nkv, s, hd), rotary applied at ``positions`` (b, s)."""
        b, s, _ = x.shape
        cos, sin = self.rope(positions)
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        return (apply_rope(q, cos, sin), *self._key_values(x, cos, sin))

    def project_kv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`project` without the queries: the keys and values a committed input leaves in the cache."""
        return self._key_values(x, *self.rope(positions))

    def _key_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        b, s, _ = x.shape
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """q (b, nh, s, hd) over k, v (b, nkv, S, hd) with a (b or 1, 1, s, S) bool mask -> (b, s, hidden).

        bf16 drafting steps on the CPU go through the fused attention kernel (query heads share their
        KV head's rows, no expanded copy of the cache; fp32 softmax like SDPA's, results may differ
        from SDPA's in the last bf16 bit); everything else through SDPA."""
        kernel = attention_kernel(q, k, v)
        if kernel is not None:
            b, _, s, _ = q.shape
            out = kernel.bf16_attention(q, k, v, mask, self.head_dim**-0.5)  # (b, s, nh, hd)
            return self.o_proj(out.reshape(b, s, -1))
        k, v = self.expand_kv(k), self.expand_kv(v)
        return self.output(nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))

    def expand_kv(self, x: Tensor) -> Tensor:
        """(b, nkv, S, hd) -> (b, nh, S, hd): each key/value head repeated for its query group."""
        return x.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)

    def output(self, out: Tensor) -> Tensor:
        """(b, nh, s, hd) attention output -> (b, s, hidden) through o_proj."""
        b, _, s, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def target_dims(model: nn.Module) -> dict:
    """Sizes of the target's decoder layer (a draft layer of the same shape), from its HF config."""
    c = model.config
    rope_params = getattr(c, "rope_parameters", None) or {}
    theta = rope_params.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    return dict(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        vocab_size=c.vocab_size,
        rope_theta=float(theta),
        rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(getattr(c, "max_position_embeddings", 8192)),
    )
