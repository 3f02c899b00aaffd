"""Time one target forward of n new tokens (a verification) through the lean forward and through the
model's own (Hugging Face) forward, interleaved, after a cached context; prints a table, writes JSON.

    python scripts/forward_routes.py [--target smollm2] [--sizes 1 6 7 8 12 16] [--context 256] [--reps 15]

Where a forward is larger than the lean forward takes (``lean_forward.lean_max_rows()``, 16 queries per
row) both columns are the model's own forward. The numbers behind ``LEAN_MAX_ROWS_NATIVE`` and the
kernels' row limits (docs/perf_log.md) come from this comparison.
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial

import torch

from selfdraft import lean_forward
from selfdraft.kernels import cpu_report
from selfdraft.target import load_target
from selfdraft.tune import forward_latency

ROUTES = {"hf": "0", "lean": "1"}
"""Route name -> the value of ``SELFDRAFT_LEAN_FORWARD`` that selects it."""


def time_routes(model, sizes: list[int], context: int, reps: int) -> dict[str, dict[int, float]]:
    """Median seconds of one n-token forward per route, routes and sizes taking turns each round."""
    before = os.environ.get(lean_forward.LEAN_ENV)
    routes = {route: partial(os.environ.__setitem__, lean_forward.LEAN_ENV, env) for route, env in ROUTES.items()}
    try:
        return forward_latency(model, sizes, context, reps, routes)
    finally:
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
          f"lean forward up to {lean_forward.lean_max_rows()} tokens here")
    print(f"{'tokens':>6}  {'HF forward ms':>13}  {'lean forward ms':>15}  {'HF / lean':>9}")
    for n in args.sizes:
        hf, lean = medians["hf"][n] * 1e3, medians["lean"][n] * 1e3
        print(f"{n:>6}  {hf:>13.1f}  {lean:>15.1f}  {hf / lean:>9.2f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    record = {"config": vars(args), **cpu_report(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "median_s": {r: {str(n): t for n, t in m.items()} for r, m in medians.items()}}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
