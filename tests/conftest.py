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


def char_tokenizer():
    """A character-level fast tokenizer with a chat template, built in memory (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 32 + VOCAB - 3)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>{% endif %}"
    )
    return fast


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """A saved tiny llama + tokenizer folder that load_target and the CLI accept."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def kernel_or_skip():
    """The fused CPU kernel module (selfdraft/csrc), or skip the test where it cannot be built."""
    from selfdraft.kernels import build_fused_kernel

    kernel = build_fused_kernel()
    if kernel is None:
        pytest.skip("the fused bf16 kernels need an x86 CPU with AVX2 and a C++ compiler")
    return kernel


@pytest.fixture(params=["avx2", "avx512_bf16_ymm", "avx512_bf16_zmm", "amx_bf16"])
def product_kernel(request):
    """The kernel module with bf16 products on one path: AVX2 (widened weights, 8-wide FMAs; every x86
    CPU the kernel builds on), AVX512-BF16 (VDPBF16PS in 256-bit or 512-bit registers; skipped where the
    CPU lacks it) or AMX-BF16 (tiles, for widths that are multiples of 32; skipped where the CPU or the
    OS does not allow them)."""
    kernel = kernel_or_skip()
    native = request.param != "avx2"
    amx = request.param == "amx_bf16"
    if native and not kernel.avx512_bf16_available():
        pytest.skip("this CPU has no AVX512-BF16")
    if amx and not kernel.amx_bf16_available():
        pytest.skip("this CPU (or its OS) gives no AMX-BF16 tiles")
    before, before_amx = kernel.set_avx512_bf16(native), kernel.set_amx_bf16(amx)
    before_zmm = kernel.set_avx512_bf16_zmm(request.param == "avx512_bf16_zmm" or (amx and kernel.avx512_bf16_zmm()))
    assert kernel.avx512_bf16_enabled() == native and kernel.amx_bf16_enabled() == amx
    yield kernel
    kernel.set_avx512_bf16(before)
    kernel.set_amx_bf16(before_amx)
    kernel.set_avx512_bf16_zmm(before_zmm)
