"""Time one target forward of n new tokens (a verification) through the lean forward and through the
model's own (Hugging Face) forward, interleaved, after a cached context; prints a table, writes JSON.
Where the CPU has AVX512-BF16, more routes run the lean forward with the product kernel's VDPBF16PS
path in 256-bit and 512-bit registers and on its AVX2 path (the comparisons behind
csrc/bf16_linear_avx512.cpp and its register width).

    python scripts/forward_routes.py [--target smollm2] [--sizes 1 6 7 8 12 16] [--context 256] [--reps 15]

Where a forward is larger than the lean forward takes (``lean_forward.lean_max_rows()`` tokens over the
batch) both columns are the model's own forward. The numbers behind ``LEAN_MAX_ROWS_NATIVE`` and the
kernels' row limits (docs/perf_log.md) come from this comparison.
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial

import torch

from selfdraft import lean_forward
from selfdraft.kernels import cpu_report, fused_kernel
from selfdraft.target import load_target
from selfdraft.tune import forward_latency

ROUTES = {"hf": ("0", True, None), "lean": ("1", True, None), "lean-256": ("1", True, False),
          "lean-512": ("1", True, True), "lean-avx2": ("1", False, None)}
"""Route name -> (the value of ``SELFDRAFT_LEAN_FORWARD`` that selects it, whether the product kernel
may take its AVX512-BF16 path, that path's register width: True 512-bit, False 256-bit, None this CPU's
default). The AVX512-BF16 routes run only where that path is on."""


def time_routes(model, sizes: list[int], context: int, reps: int) -> dict[str, dict[int, float]]:
    """Median seconds of one n-token forward per route, routes and sizes taking turns each round
    (lean-256, lean-512 and lean-avx2 only where the AVX512-BF16 path is on)."""
    kernel = fused_kernel()
    avx512 = kernel is not None and kernel.avx512_bf16_enabled()
    default_zmm = avx512 and kernel.avx512_bf16_zmm()

    def enter(lean: str, products_avx512: bool, zmm: bool | None) -> None:
        os.environ[lean_forward.LEAN_ENV] = lean
        if avx512:
            kernel.set_avx512_bf16(products_avx512)
            kernel.set_avx512_bf16_zmm(default_zmm if zmm is None else zmm)

    routes = {r: partial(enter, *how) for r, how in ROUTES.items() if r in ("hf", "lean") or avx512}
    before = os.environ.get(lean_forward.LEAN_ENV)
    try:
        return forward_latency(model, sizes, context, reps, routes)
    finally:
        if avx512:
            kernel.set_avx512_bf16(True)
            kernel.set_avx512_bf16_zmm(default_zmm)
        if before is None:
            os.environ.pop(lean_forward.LEAN_ENV, None)
        else:
            os.environ[lean_forward.LEAN_ENV] = before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 6, 7, 8, 10, 12, 16])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = number of cores)")
    p.add_argument("--out", default="outputs/forward_routes.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    model = load_target(args.target, dtype=args.dtype).model
    medians = time_routes(model, args.sizes, args.context, args.reps)
    print(f"{args.target} ({args.dtype}), {args.context} cached tokens, medians of {args.reps}; "
          f"lean forward up to {lean_forward.lean_max_rows()} tokens here; ms, and / lean (this CPU's default route)")
    names = list(medians)
    print(f"{'tokens':>6}" + "".join(f"  {r + ' ms':>13}  {'/ lean':>6}" for r in names))
    for n in args.sizes:
        lean = medians["lean"][n]
        print(f"{n:>6}" + "".join(f"  {medians[r][n] * 1e3:>13.1f}  {medians[r][n] / lean:>6.2f}" for r in names))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    record = {"config": vars(args), **cpu_report(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "median_s": {r: {str(n): t for n, t in m.items()} for r, m in medians.items()}}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
