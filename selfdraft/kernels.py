"""Matrix products for bfloat16 targets on CPUs without native bf16 arithmetic.

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
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

MIN_ROWS = 5
"""Fewest input rows for which the fp32 route paid per product on an AVX2 CPU (2-core AMD EPYC, a
1536 x 576 bf16 weight: 2-4 rows faster in bf16; 5 rows 384 vs 514 us, 16 rows 540 vs 1742 us)."""
FORWARD_MIN_ROWS = 8
"""Fewest tokens in a forward (rows over the batch) for which :func:`matmul_mode` enters the mode:
the function mode itself costs ~2.5 us per torch call (~10 ms per SmolLM2 forward), which small
forwards do not win back (docs/perf_log.md)."""
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
    """What decides CPU matmul speed here: the ISA level PyTorch uses and native bf16 support."""
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16_matmul": native_bf16_matmul("cpu")}


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
