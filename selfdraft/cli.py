"""The ``selfdraft`` command: a thin shell over the library and the programs in scripts/.

User mistakes (missing files, bad options, an unknown target) print one ``selfdraft: error:`` line
and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

from selfdraft.config import ConfigError, add_arguments, from_args, opt


@dataclass(frozen=True)
class GenerateConfig:
    target: str = opt("smollm2", "target: alias (smollm2, gemma3-270m), local folder, .gguf file or hub id")
    dtype: str = opt("bfloat16", "target dtype: float32 (exact) or bfloat16 (faster on this CPU)")
    drafter: str = opt("prompt_lookup", "drafter NAME[:key=value,...] (prompt_lookup, layer_skip, draft_model) or 'none'")
    prompt: str = opt("Write a haiku about speculative decoding.", "user prompt (rendered with the chat template)")
    max_new_tokens: int = opt(128, "maximum new tokens")
    temperature: float = opt(0.0, "0 = greedy; > 0 samples (lossless)")
    top_k: int = opt(0, "top-k (0 = off)")
    top_p: float = opt(1.0, "top-p (1.0 = off)")
    acceptance: str = opt("exact", "exact (lossless) or typical (Medusa typical acceptance, LOSSY)")
    seed: int = opt(0, "sampling seed")
    threads: int = opt(0, "torch threads (0 = number of cores)")


def _generate(cfg: GenerateConfig) -> None:
    import torch

    from selfdraft.benchmark import parse_decoder
    from selfdraft.drafters import build_drafter
    from selfdraft.generate import GenerationConfig, generate
    from selfdraft.sampling import SamplingConfig
    from selfdraft.target import load_target

    if cfg.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {cfg.max_new_tokens}")
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    gen_cfg = GenerationConfig(
        max_new_tokens=cfg.max_new_tokens,
        sampling=SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p),
        acceptance=cfg.acceptance,
        seed=cfg.seed,
    )
    t0 = time.perf_counter()
    target = load_target(cfg.target, dtype=cfg.dtype)
    drafter = None
    if cfg.drafter != "none":
        name, options = parse_decoder(cfg.drafter)
        drafter = build_drafter(name, target.model, **options)
    print(f"[loaded {cfg.target} in {time.perf_counter() - t0:.1f}s; drafter {cfg.drafter}]", file=sys.stderr)
    ids = target.encode_chat(cfg.prompt)
    printed: list[int] = []
    shown = ""

    def stream(tokens: list[int], sources: list[str]) -> None:
        nonlocal shown
        printed.extend(tokens)
        text = target.tokenizer.decode(printed, skip_special_tokens=True)
        sys.stdout.write(text[len(shown):])
        sys.stdout.flush()
        shown = text

    out = generate(target.model, ids, drafter, gen_cfg, target.eos_token_ids, target.tokenizer, stream)
    s = out.stats
    print()
    print(
        f"[{s.new_tokens} tokens in {s.wall_s:.2f}s = {s.tokens_per_s:.1f} tok/s; tau {s.tau:.2f} over "
        f"{s.steps} target forwards; time draft {s.draft_s:.2f}s verify {s.verify_s + s.prefill_s:.2f}s "
        f"other {s.other_s:.2f}s; stop: {out.stop_reason}]",
        file=sys.stderr,
    )


def build_parser() -> argparse.ArgumentParser:
    from selfdraft.benchmark import BenchConfig

    parser = argparse.ArgumentParser(prog="selfdraft", description="Self-drafting speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text with a target and a drafter, streaming")
    gen.add_argument("--config", help="YAML file of generate options (flags override it)")
    add_arguments(gen, GenerateConfig)
    bench = sub.add_parser("bench", help="benchmark decoders side by side: table + JSON")
    bench.add_argument("--config", help="YAML file of bench options (flags override it)")
    add_arguments(bench, BenchConfig)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from selfdraft.generate import ContextLengthError
    from selfdraft.target import TargetNotFoundError

    try:
        if args.command == "generate":
            _generate(from_args(GenerateConfig, args, args.config))
        elif args.command == "bench":
            from selfdraft.benchmark import BenchConfig
            from selfdraft.benchmark import main as bench_main

            bench_main(from_args(BenchConfig, args, args.config))
    except (ConfigError, TargetNotFoundError, ContextLengthError, FileNotFoundError, KeyError, ValueError) as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"selfdraft: error: {msg}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
