"""Tiny random targets of every supported architecture, built in memory (no downloads)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

VOCAB = 96


def _common(**extra):
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg.update(extra)
    return cfg


CONFIGS = {
    "llama": lambda: LlamaConfig(**_common(head_dim=8)),
    "qwen2": lambda: Qwen2Config(**_common()),
    "qwen3": lambda: Qwen3Config(**_common(head_dim=8)),
    # sliding window of 6 so tree masks cross the window boundary in the tests
    "gemma3": lambda: Gemma3TextConfig(
        **_common(head_dim=8, sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2)
    ),
}
ARCHS = tuple(CONFIGS)


def tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A frozen random model; weights scaled up so argmaxes are decisive and drafts are testable."""
    torch.manual_seed(seed)
    cfg = CONFIGS[arch]()
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return model.eval().requires_grad_(False)


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def models() -> dict[str, torch.nn.Module]:
    return {a: tiny_model(a) for a in ARCHS}


def random_prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()
