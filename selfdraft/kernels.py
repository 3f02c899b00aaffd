"""bf16 CPU kernels for small forwards, and matrix products for bf16 models on CPUs without native bf16.

PyTorch's eager CPU GEMM for bfloat16 goes through oneDNN only where the CPU has bf16 dot-product
instructions (AVX512-BF16 or AMX). Elsewhere (AVX2-only x86 such as AMD Zen 2/3, older Xeons) an
(m, k) x (k, n) product with m > 1 falls back to one bf16 dot product per output element, which
costs about m times a one-row product: on such a 2-core CPU a SmolLM2 forward over a 9-node tree
cost 4-5x a one-token forward (docs/perf_log.md), so every speculative decoder lost to plain
decoding, HF prompt lookup included. One-row products (plain decoding) are fine: they use a
vectorised bf16 GEMV that reads half the bytes of fp32.

:class:`UpcastMatmuls` is a function mode, entered around a forward, that computes ``F.linear`` with
bfloat16 weights and at least ``min_rows`` input rows in fp32 (MKL) instead: each weight is
converted block by block into a reused fp32 scratch buffer and multiplied there; the result is
rounded back to bfloat16, as the bf16 kernel rounds its fp32 accumulator. Nothing of the model is
modified or copied: its bf16 weights stay the only copy, the scratch holds one block.

For the small forwards of decoding (one token, a draft tree, a head step) the conversion itself is
the cost, and PyTorch's eager bf16 ops carry more. Compiled kernels (``selfdraft/csrc``, AVX2 + FMA,
with an AVX512-BF16 path for products where the CPU has it,
one module built on first use with ``torch.utils.cpp_extension``) take over there:
:class:`FusedModules` routes a model's bf16 ``nn.Linear`` modules through a product kernel that
widens the weights in registers and accumulates in fp32 (on the 2-core AVX2 machine a SmolLM2
forward's products cost 16.7 ms for 1 token and 37 ms for 9, against 26-41 and 132-168 ms), and its
RMSNorm modules through a one-pass norm kernel; :class:`FusedAttention` routes SDPA attention over
few query positions through an attention kernel reading the bf16 cache directly.
:func:`forward_products` picks the routes for one forward; ``SELFDRAFT_FUSED_BF16=0`` turns the
kernels off (docs/perf_log.md has the measurements).

Where bf16 is native (AVX512-BF16), oneDNN's products carry ~50 us of fixed cost per call, so the
kernels serve the small forwards there too (a SmolLM2 one-token decode step 36.6 -> 25.6 ms on a
2-core AVX512-BF16 EPYC), and the product kernel multiplies bf16 inputs with VDPBF16PS dot products
(``csrc/bf16_linear_avx512.cpp``; ``SELFDRAFT_AVX512_BF16=0`` keeps it on the AVX2 path): a 16-token
SmolLM2 forward 44 -> 29 ms there, one token unchanged. On Intel CPUs it multiplies in 512-bit registers
(``SELFDRAFT_AVX512_ZMM`` chooses). Products over at most FUSED_MAX_ROWS_AVX512
rows take it inside the model's own forward (FUSED_MAX_ROWS_NATIVE with the AVX2 path, past which
oneDNN wins); the lean forward (:mod:`selfdraft.lean_forward`), which skips the model's Python, keeps
every product of a verification (any size) and of a prompt of up to 16 tokens (24 on AMX) on the kernel
on both kinds of CPU.

Where the CPU also has AMX-BF16 (Intel Sapphire Rapids and later) and Linux grants the tiles, products
whose width is a multiple of 32 multiply on them (``csrc/bf16_linear_amx.cpp``; ``SELFDRAFT_AMX_BF16=0``
keeps them on VDPBF16PS): one tile instruction takes 16 weight rows x 32 elements against up to 16
input rows, so a verification of several tokens costs little more than one token. Whole greedy
verifications after 256 tokens on a 2-core Sapphire Rapids, VDPBF16PS -> AMX (ms): SmolLM2 1 token
13.4 -> 14.1, 6: 24.5 -> 18.7, 10: 34.6 -> 20.8, 16: 51.8 -> 25.8; Gemma-3-270M 1: 19.2 -> 20.8, 10:
61.7 -> 38.8, 16: 94.7 -> 51.6 (docs/perf_log.md, forty-fourth session).
"""

from __future__ import annotations

import os
import platform
import sys
import warnings
import weakref
from contextlib import AbstractContextManager, ExitStack, nullcontext
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

MIN_ROWS = 5
"""Fewest input rows for which the fp32 route paid per product on an AVX2 CPU (2-core AMD EPYC, a
1536 x 576 bf16 weight: 2-4 rows faster in bf16; 5 rows 384 vs 514 us, 16 rows 540 vs 1742 us)."""
FORWARD_MIN_ROWS = 8
"""Fewest tokens in a forward (rows over the batch) for which :func:`matmul_mode` enters the mode:
the function mode itself costs ~2.5 us per torch call (~10 ms per SmolLM2 forward), which small
forwards do not win back (docs/perf_log.md)."""
FUSED_MAX_ROWS = 48
"""Most input rows a product takes through the fused kernel; larger ones go to the fp32 route. On the
2-core AVX2 machine whole forwards of 64-192 tokens cost the same either way within noise (64: 288
vs 327 ms, 192: 786 vs 702 ms); the fp32 route's MKL GEMM (124 GFLOP/s against the kernel's ~65)
wins for long prefills."""
FUSED_MAX_ROWS_NATIVE = 6
"""The same limit where bf16 products are native, inside the model's own (Hugging Face) forward: on a
2-core AVX512-BF16 EPYC, whole SmolLM2 forwards
after 400 cached tokens (median of 16, interleaved) with the product kernel up to this many rows vs
oneDNN: 1 token 25.6 vs 34.5 ms, 4: 32.9 vs 38.5, 6: 39.1 vs 41.9, 8: 42.5 vs 41.8, 16: 50.4 vs 49.8
(norms and attention fused in both). Measured with the kernel's AVX2 path; where it runs its
AVX512-BF16 path the limit is FUSED_MAX_ROWS_AVX512."""
FUSED_MAX_ROWS_AVX512 = 16
"""The same limit where the product kernel multiplies with AVX512-BF16 (:func:`avx512_bf16_products`):
on the 2-core AVX512-BF16 EPYC, whole forwards through the model's own forward after 256 cached tokens
(medians of 11, interleaved), products up to 16 rows on the kernel vs past 6 rows on oneDNN: SmolLM2
7 tokens 30.4 vs 50.5 ms, 8: 31.7 vs 52.0, 12: 39.7 vs 58.2, 16: 43.5 vs 62.0; Gemma-3-270M 7: 45.2
vs 66.4, 12: 57.2 vs 73.4, 16: 65.7 vs 80.1 (docs/perf_log.md, twenty-fifth session)."""
FUSED_ENV = "SELFDRAFT_FUSED_BF16"
"""Set to 0 to keep the fused kernels off (no build, PyTorch's kernels and the fp32 route only)."""
AVX512_ENV = "SELFDRAFT_AVX512_BF16"
"""Set to 0 to keep the product kernel on its AVX2 path where the CPU has AVX512-BF16 (comparisons);
by default bf16 inputs there take the VDPBF16PS path (csrc/bf16_linear_avx512.cpp)."""
ZMM_ENV = "SELFDRAFT_AVX512_ZMM"
"""Set to 1 or 0 to have the VDPBF16PS path multiply in 512-bit or 256-bit registers; unset, 512-bit on
Intel CPUs and 256-bit elsewhere (on a 2-core Zen 4, which splits 512-bit instructions, 2-3-token
forwards took 15-25% longer with them; on a 2-core Emerald Rapids 512-bit products are faster at
every row count: docs/perf_log.md, forty-fifth session)."""
AMX_ENV = "SELFDRAFT_AMX_BF16"
"""Set to 0 to keep bf16 products off the AMX tiles where the CPU has AMX-BF16 (comparisons); by default
products whose width is a multiple of 32 take them there (csrc/bf16_linear_amx.cpp)."""
FUSED_ATTENTION_MAX_QUERIES = 16
"""Most query positions (per row) an attention call through Hugging Face's attention interface (the
model's own forward, the draft heads' modules) takes through the fused kernel; the lean forward
(selfdraft/lean_forward.py) gives the kernel every forward it takes, up to ``lean_max_rows()`` tokens,
so that a tree's rows round as plain decoding's one-token steps do. On the 2-core AVX2 machine, 9
query heads over 3 KV heads and 400 cached positions: 1 query 0.04 vs 0.41 ms (PyTorch's bf16 SDPA),
9 queries 0.22 vs 0.27 ms, 48 queries 1.03 vs 0.71 ms; a 48-row decode step over 640 positions 2.3 vs
23 ms per layer. Since the forty-first session's kernel, 48 queries over 1,000 keys 2.9 vs 2.6 ms."""
ATTENTION_NAME = "selfdraft_bf16"
"""Name the fused attention is registered under in Hugging Face's attention interface."""
KERNEL_SOURCES = (
    "bindings.cpp", "bf16_linear.cpp", "bf16_linear_avx512.cpp", "bf16_linear_amx.cpp", "bf16_attention.cpp", "bf16_rms_norm.cpp", "bf16_rope.cpp", "bf16_decoder.cpp",
    "eagle3_step.cpp", "int8_linear.cpp", "bf16_argmax.cpp",
)
"""Sources of the kernel module under selfdraft/csrc (kernels.h holds what they share)."""
BLOCK_ROWS = 2048
"""Weight rows converted per block: a decoder layer's projections fit in one (2048 x 576 fp32 is 4.7 MB,
in cache for its product); a vocabulary projection goes block by block."""


@cache
def native_bf16_matmul(device_type: str = "cpu") -> bool:
    """Whether bfloat16 matrix products on this device type run on native bf16 instructions (true off the CPU)."""
    if device_type != "cpu":
        return True
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_report() -> dict:
    """What decides CPU matmul speed here: the ISA level PyTorch uses, native bf16 support and whether
    small bf16 products run on the fused kernel."""
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16_matmul": native_bf16_matmul("cpu"),
        "fused_bf16_kernel": fused_kernel() is not None,
        "avx512_bf16_products": avx512_bf16_products(),
        "amx_bf16_products": amx_bf16_products(),
        "avx512_bf16_zmm": avx512_bf16_zmm_products(),
    }


def resolve_mixed_precision(requested: str, device_type: str) -> str:
    """accelerate's mixed-precision setting for a run: 'auto' becomes 'bf16' where bf16 products are
    native on ``device_type`` and 'no' elsewhere; other values are returned as given."""
    if requested != "auto":
        return requested
    return "bf16" if native_bf16_matmul(device_type) else "no"


@cache
def _shared_mode() -> UpcastMatmuls:
    return UpcastMatmuls()


def matmul_mode(dtype: torch.dtype, device: torch.device, rows: int) -> AbstractContextManager:
    """The context to run a forward of ``rows`` tokens in: :class:`UpcastMatmuls` for bf16 weights on a
    CPU without native bf16 and at least FORWARD_MIN_ROWS rows, else nothing (PyTorch's own kernels)."""
    if dtype != torch.bfloat16 or device.type != "cpu" or rows < FORWARD_MIN_ROWS or native_bf16_matmul("cpu"):
        return nullcontext()
    return _shared_mode()


def _built(cpp_extension, name: str) -> bool:
    """Whether torch's extension cache already holds a build (only decides whether to announce one:
    the lookup uses a private torch helper, so any failure just means "announce")."""
    try:
        return (Path(cpp_extension._get_build_directory(name, False)) / f"{name}.so").exists()
    except Exception:
        return False


@cache
def build_fused_kernel():
    """Compile (or load the cached build of) the bf16 kernel module; None on a CPU without AVX2 or
    where it cannot be built (warned once)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or torch.backends.cpu.get_cpu_capability() not in (
        "AVX2",
        "AVX512",
    ):
        return None
    try:
        from torch.utils import cpp_extension

        name = "selfdraft_cpu_kernels"
        if not _built(cpp_extension, name):
            print("selfdraft: building the bf16 CPU kernels (once per machine, a minute or two)", file=sys.stderr)
        csrc = Path(__file__).parent / "csrc"
        module = cpp_extension.load(
            name=name,
            sources=[str(csrc / f) for f in KERNEL_SOURCES],
            extra_include_paths=[str(csrc)],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
        module.set_avx512_bf16(os.environ.get(AVX512_ENV, "1") != "0")
        module.set_amx_bf16(os.environ.get(AMX_ENV, "1") != "0")
        if os.environ.get(ZMM_ENV, "") in ("0", "1"):
            module.set_avx512_bf16_zmm(os.environ[ZMM_ENV] == "1")
        return module
    except Exception as e:  # no compiler, no ninja, ...: slower but correct without it
        warnings.warn(
            f"selfdraft: could not build the bf16 CPU kernels ({type(e).__name__}: {e}); small bf16 "
            f"products, attention and norms use PyTorch's kernels (slower). Install a C++ compiler and ninja, or set "
            f"{FUSED_ENV}=0 to silence this.",
            stacklevel=2,
        )
        return None


def avx512_bf16_products() -> bool:
    """Whether the product kernel multiplies bf16 inputs with AVX512-BF16 dot products here (the CPU
    has them, the kernel is built and ``SELFDRAFT_AVX512_BF16`` is not 0)."""
    kernel = fused_kernel()
    return kernel is not None and kernel.avx512_bf16_enabled()


def avx512_bf16_zmm_products() -> bool:
    """Whether the product kernel's AVX512-BF16 path is on and multiplies in 512-bit registers (by
    default on Intel CPUs; ``SELFDRAFT_AVX512_ZMM`` chooses)."""
    kernel = fused_kernel()
    return kernel is not None and kernel.avx512_bf16_enabled() and kernel.avx512_bf16_zmm()


def amx_bf16_products() -> bool:
    """Whether the product kernel multiplies bf16 inputs with AMX-BF16 tiles here (the CPU and the OS
    allow them, the AVX512-BF16 path is on and ``SELFDRAFT_AMX_BF16`` is not 0); widths that are not a
    multiple of 32 stay on the AVX512-BF16 path."""
    kernel = fused_kernel()
    return kernel is not None and kernel.amx_bf16_enabled()


def fused_kernel():
    """The bf16 kernel module where it applies (an x86 CPU with AVX2, ``SELFDRAFT_FUSED_BF16`` not 0),
    else None."""
    if os.environ.get(FUSED_ENV, "1") == "0":
        return None
    return build_fused_kernel()


def fused_max_rows() -> int:
    """Most input rows a product takes through the fused kernel on this CPU."""
    if not native_bf16_matmul("cpu"):
        return FUSED_MAX_ROWS
    return FUSED_MAX_ROWS_AVX512 if avx512_bf16_products() else FUSED_MAX_ROWS_NATIVE


def _fused_forward(ref: weakref.ref, kernel, max_rows: int):
    """The ``forward`` FusedModules installs on the ``nn.Linear`` that ``ref`` points to (a weak
    reference: the function is kept between entries and must not keep the module alive)."""

    def forward(x: Tensor) -> Tensor:
        module = ref()
        weight, bias = module.weight, module.bias
        if (
            x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16
            and x.numel() <= max_rows * x.shape[-1]
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        ):
            return kernel.bf16_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    return forward


def _fused_norm_forward(ref: weakref.ref, kernel, eps: float, unit_offset: bool):
    """The ``forward`` FusedModules installs on the RMSNorm module ``ref`` points to."""

    def forward(x: Tensor) -> Tensor:
        module = ref()
        if x.dtype == torch.bfloat16 and not (torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad)):
            return kernel.bf16_rms_norm(x, module.weight, eps, unit_offset)
        return type(module).forward(module, x)

    return forward


def rms_norm_convention(module: nn.Module, kernel) -> tuple[float, bool] | None:
    """``(eps, unit_offset)`` for which the kernel's RMSNorm reproduces ``module``'s own forward, or None.

    Candidates are modules whose class name ends in ``RMSNorm`` with a 1-D bf16 CPU ``weight`` and an
    ``eps`` / ``variance_epsilon``; each is run once on a probe input against both conventions
    (``weight * bf16(x_hat)`` and ``bf16(x_hat * (1 + weight))``) and kept only where one matches to
    within a bf16 rounding step, with the module's own weights (fixed during inference): a norm with
    other arithmetic stays on its own forward.
    """
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if (
        not type(module).__name__.endswith("RMSNorm")
        or not isinstance(weight, Tensor)
        or weight.dim() != 1
        or weight.dtype != torch.bfloat16
        or weight.device.type != "cpu"
        or not isinstance(eps, float)
        or "forward" in vars(module)
    ):
        return None
    probe = (torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)) * 4).bfloat16()
    with torch.no_grad():
        try:
            want = module(probe)
        except Exception:
            return None
        if not isinstance(want, Tensor) or want.shape != probe.shape or want.dtype != torch.bfloat16:
            return None
        want = want.float()
        for unit_offset in (False, True):
            got = kernel.bf16_rms_norm(probe, weight, eps, unit_offset).float()
            if bool(((got - want).abs() <= want.abs() * 2**-7 + 1e-30).all()):
                return eps, unit_offset
    return None


class FusedModules:
    """Within ``with``, the bf16 CPU ``nn.Linear`` modules under ``roots`` run products over at most
    ``max_rows`` rows (inference only) through the fused product kernel, and their RMSNorm modules
    through the fused norm kernel (where :func:`rms_norm_convention` finds it reproduces them);
    anything else goes to the module's own computation.

    Each module's ``forward`` is replaced by an instance attribute while inside and restored on exit,
    so code outside (HF ``generate``, training) sees the modules untouched; weights are never copied.
    Re-entrant: nested entries are free. Modules whose ``forward`` is already replaced (accelerate
    hooks) are left alone.
    """

    def __init__(self, kernel, roots: list[nn.Module], max_rows: int = FUSED_MAX_ROWS):
        seen: dict[int, nn.Module] = {}
        for root in roots:
            for m in root.modules():
                seen.setdefault(id(m), m)
        # built once: entering and leaving run once per forward, so they only set and drop attributes
        self._forwards = []
        self.max_rows = max_rows
        self.linears = self.norms = 0
        for m in seen.values():
            if "forward" in vars(m):
                continue
            if type(m) is nn.Linear and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu":
                ref = weakref.ref(m)
                self._forwards.append((ref, _fused_forward(ref, kernel, max_rows)))
                self.linears += 1
            elif (convention := rms_norm_convention(m, kernel)) is not None:
                ref = weakref.ref(m)
                self._forwards.append((ref, _fused_norm_forward(ref, kernel, *convention)))
                self.norms += 1
        self.depth = 0

    def __len__(self) -> int:
        return len(self._forwards)

    def __enter__(self) -> FusedModules:
        if self.depth == 0:
            for ref, forward in self._forwards:
                if (m := ref()) is not None:
                    vars(m)["forward"] = forward  # what nn.Module.__setattr__ does for a plain value
        self.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        if self.depth == 0:
            for ref, _ in self._forwards:
                if (m := ref()) is not None:
                    vars(m).pop("forward", None)


_FUSED: weakref.WeakKeyDictionary[nn.Module, FusedModules] = weakref.WeakKeyDictionary()


def fused_modules(*roots: nn.Module | None) -> AbstractContextManager:
    """:class:`FusedModules` over the given modules (None entries skipped), cached per first root;
    a null context where the kernel does not apply."""
    mods = [r for r in roots if r is not None]
    kernel = fused_kernel() if mods else None
    if kernel is None:
        return nullcontext()
    max_rows = fused_max_rows()
    fm = _FUSED.get(mods[0])
    if fm is None or fm.max_rows != max_rows:
        fm = _FUSED[mods[0]] = FusedModules(kernel, mods, max_rows)
    return fm


def attention_kernel(query: Tensor, key: Tensor, value: Tensor):
    """The kernel module whose ``bf16_attention`` takes this attention (bf16 CPU inference over at
    most FUSED_ATTENTION_MAX_QUERIES query positions, query (b, heads, n, d) with d a multiple of 8,
    key and value (b, kv heads, L, d)), else None."""
    kernel = fused_kernel()
    d = query.shape[-1]
    if (
        kernel is None
        or not query.dtype == key.dtype == value.dtype == torch.bfloat16
        or query.device.type != "cpu"
        or query.shape[2] > FUSED_ATTENTION_MAX_QUERIES
        or d % 8 != 0
        or not key.shape[-1] == value.shape[-1] == d
        or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
    ):
        return None
    return kernel


def _attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
               dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """The attention function :class:`FusedAttention` selects (Hugging Face's attention-interface
    signature): the fused kernel for bf16 inference over at most FUSED_ATTENTION_MAX_QUERIES query
    positions, HF's SDPA attention for anything else (in query blocks for a long masked forward)."""
    kernel = attention_kernel(query, key, value)
    if (
        kernel is not None
        and (attention_mask is not None or query.shape[2] == 1)
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
        and not (module.training and dropout > 0)
    ):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return kernel.bf16_attention(query, key, value, attention_mask, scale), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if isinstance(attention_mask, Tensor) and query.shape[0] == 1 and query.shape[2] > ATTENTION_QUERY_BLOCK:
        return _blockwise_attention(sdpa_attention_forward, module, query, key, value, attention_mask,
                                    dropout=dropout, scaling=scaling, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


ATTENTION_QUERY_BLOCK = 256
"""Query positions per SDPA call when a long masked forward (a prompt after a prefix, a prompt past a
sliding window) is split. On the 2-core AVX2 machine, Gemma-3's 4 heads x 256 over 2,048 positions
with its 512-wide window: 123 ms in one call, 55 ms in blocks of 256 (4,096 positions: 520 vs 122);
SmolLM2's 9 x 64 causal: 88 vs 62 ms."""


def _blockwise_attention(sdpa, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor, **kwargs):
    """``sdpa`` (HF's SDPA attention) one block of ATTENTION_QUERY_BLOCK queries at a time, each over
    only the span of keys its rows of ``mask`` (1, 1, q, k; additive or bool) leave visible: SDPA with
    an explicit mask computes every score, masked or not. Keys outside the span are hidden from every
    query of the block, so the softmax is the same up to the order of its sums (bf16 rounding)."""
    mask = mask[..., : key.shape[2]]
    hidden = torch.finfo(mask.dtype).min if mask.dtype != torch.bool else None
    outs = []
    for start in range(0, query.shape[2], ATTENTION_QUERY_BLOCK):
        rows = mask[..., start : start + ATTENTION_QUERY_BLOCK, :]
        seen = (rows if hidden is None else rows > hidden).flatten(0, -2).any(0).nonzero()
        lo, hi = (int(seen[0]), int(seen[-1]) + 1) if seen.numel() else (0, mask.shape[-1])
        out, _ = sdpa(module, query[:, :, start : start + ATTENTION_QUERY_BLOCK], key[:, :, lo:hi],
                      value[:, :, lo:hi], rows[..., lo:hi], **kwargs)
        outs.append(out)
    return torch.cat(outs, 1), None  # HF's layout: (batch, queries, heads, head_dim)


@cache
def _register_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)
    return ATTENTION_NAME


class FusedAttention:
    """Within ``with``, the attention layers of ``model`` that use SDPA call :func:`_attention` instead
    (bf16 attention over few query positions through the fused kernel).

    The switch is the attention implementation named in the layers' configs (Hugging Face looks it up
    on every call), set on entry and restored on exit: code outside (HF ``generate``, training) sees
    the model as loaded. Re-entrant. Layers configured for another implementation are left alone.
    """

    def __init__(self, model: nn.Module):
        configs: dict[int, object] = {}
        for m in model.modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and getattr(cfg, "_attn_implementation", None) == "sdpa":
                configs.setdefault(id(cfg), cfg)
        self._configs = list(configs.values())
        self.depth = 0

    def __len__(self) -> int:
        return len(self._configs)

    def __enter__(self) -> FusedAttention:
        if self.depth == 0:
            name = _register_attention()
            for cfg in self._configs:
                cfg._attn_implementation = name
        self.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        if self.depth == 0:
            for cfg in self._configs:
                cfg._attn_implementation = "sdpa"


_ATTENTION: weakref.WeakKeyDictionary[nn.Module, FusedAttention] = weakref.WeakKeyDictionary()


def fused_attention(model: nn.Module) -> AbstractContextManager:
    """:class:`FusedAttention` for ``model`` (cached per model); a null context where the kernel does
    not apply."""
    if fused_kernel() is None:
        return nullcontext()
    fa = _ATTENTION.get(model)
    if fa is None:
        fa = _ATTENTION[model] = FusedAttention(model)
    return fa


def forward_products(model: nn.Module, dtype: torch.dtype, device: torch.device, rows: int) -> AbstractContextManager:
    """The context for one forward of ``rows`` tokens through ``model`` with bf16 weights on a CPU: the
    fused kernels for small products (:func:`fused_max_rows`), norms and attention over few query
    positions; on a CPU without native bf16 also the fp32 route for forwards too large for the product
    kernel. Elsewhere nothing (PyTorch's own kernels)."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return nullcontext()
    if fused_kernel() is None:
        return matmul_mode(dtype, device, rows)
    stack = ExitStack()
    stack.enter_context(fused_modules(model))
    stack.enter_context(fused_attention(model))
    stack.enter_context(large_products(dtype, device, rows))
    return stack


def large_products(dtype: torch.dtype, device: torch.device, rows: int) -> AbstractContextManager:
    """The fp32 route (:func:`matmul_mode`) for a forward of ``rows`` tokens that the product kernel
    does not take (more than :func:`fused_max_rows`; any size without the kernel), else nothing. For
    modules run outside :func:`forward_products`: a draft head catching up on many committed tokens
    (the prompt after prefill, or a stretch the speculation gate decoded plainly) would otherwise hit
    PyTorch's bf16 GEMM, ~5x slower on AVX2 (a 150 x 640 by 640 x 2048 product: 21.7 against 4.2 ms)."""
    limit = fused_max_rows() if fused_kernel() is not None else 0
    return matmul_mode(dtype, device, rows) if rows > limit else nullcontext()


def upcast_linear(x: Tensor, weight: Tensor, bias: Tensor | None, scratch: Tensor) -> Tensor:
    """``F.linear(x, weight, bias)`` computed in fp32 and returned in ``x.dtype``.

    x: (..., k); weight: (n, k); scratch: (>= min(n, block), k) fp32 buffer the weight blocks are
    converted into. Returns (..., n).
    """
    k = x.shape[-1]
    x32 = x.reshape(-1, k).float()
    n = weight.shape[0]
    block = scratch.shape[0]
    if n <= block:  # one block: (m, k) x (k, n) directly
        y = torch.mm(x32, scratch[:n].copy_(weight).t())
    else:  # the transposed product, block by block: each block's output rows are contiguous
        out = torch.empty(n, x32.shape[0], dtype=torch.float32, device=x.device)
        for start in range(0, n, block):
            rows = min(block, n - start)
            torch.mm(scratch[:rows].copy_(weight[start : start + rows]), x32.t(), out=out[start : start + rows])
        y = out.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


class UpcastMatmuls(TorchFunctionMode):
    """Within ``with mode:``, bf16 ``F.linear`` calls over >= ``min_rows`` rows run as fp32 products.

    Only inference (no autograd through the scratch buffer): under grad mode the call goes to PyTorch
    unchanged. Keep one instance per model and re-enter it for each forward; it owns the scratch.
    """

    def __init__(self, min_rows: int = MIN_ROWS, block_rows: int = BLOCK_ROWS):
        super().__init__()
        self.min_rows, self.block_rows = min_rows, block_rows
        self._scratch: dict[tuple[int, torch.device], Tensor] = {}

    def _buffer(self, k: int, rows: int, device: torch.device) -> Tensor:
        buf = self._scratch.get((k, device))
        if buf is None or buf.shape[0] < rows:
            # a normal tensor even when first needed under inference_mode: later forwards under
            # no_grad (training after an engine eval) write into it too
            with torch.inference_mode(False):
                buf = torch.empty(rows, k, dtype=torch.float32, device=device)
            self._scratch[(k, device)] = buf
        return buf

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (
                weight.dtype == torch.bfloat16
                and x.device.type == "cpu"
                and x.numel() >= self.min_rows * x.shape[-1]
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            ):
                rows = min(weight.shape[0], self.block_rows)
                return upcast_linear(x, weight, bias, self._buffer(weight.shape[1], rows, x.device))
        return func(*args, **kwargs)
