"""Benchmark decoders side by side on one target (table + JSON).

    python scripts/bench.py [config.yaml] [key=value ...]
    e.g. python scripts/bench.py configs/bench/smollm2_bf16.yaml limit=10
"""

from __future__ import annotations

import sys

from selfdraft.benchmark import BenchConfig
from selfdraft.benchmark import main as run
from selfdraft.config import load


def main(cfg: BenchConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    argv = sys.argv[1:]
    path = argv.pop(0) if argv and "=" not in argv[0] else None
    main(load(BenchConfig, path, argv))
