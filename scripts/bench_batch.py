"""Batched decoding benchmark: throughput and per-request latency by batch size (table + JSON).

    python scripts/bench_batch.py [config.yaml] [key=value ...]
    e.g. python scripts/bench_batch.py configs/bench/batch_smollm2_bf16.yaml limit=16 "batch_sizes=1 4"

Decoders: ``hf`` (transformers ``generate``, greedy, static batches with left padding), ``plain``
(:func:`selfdraft.batch.generate_batch` without a drafter: continuous batching, one token per row per
step) and any drafter ``NAME[:key=value,...]`` (continuous batching with tree speculation under the
batch's :class:`~selfdraft.batch.TreePolicy`). Greedy only. Throughput is all new tokens over the
wall time of the whole run; latency is per request, from the start of the run (queueing included).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from selfdraft.batch import TreePolicy, generate_batch
from selfdraft.benchmark import load_prompts, parse_decoder
from selfdraft.config import load, opt
from selfdraft.drafters import drafter_factory
from selfdraft.generate import GenerationConfig
from selfdraft.target import Target


@dataclass(frozen=True)
class BatchBenchConfig:
    target: str = opt("smollm2", "target: alias, local folder, .gguf file or hub id")
    dtype: str = opt("bfloat16", "target dtype: float32 or bfloat16")
    prompts: str = opt("mtbench", "prompt set: 'mtbench' or a JSONL file")
    limit: int = opt(32, "number of prompts (requests) per run (0 = all)")
    max_new_tokens: int = opt(128, "new tokens per request (>= 1)")
    batch_sizes: tuple = opt(("1", "2", "4", "8", "16"), "space-separated batch sizes")
    decoders: tuple = opt(("hf", "plain", "prompt_lookup"), "space-separated decoders: hf, plain, or NAME[:k=v,...]")
    max_step_tokens: int = opt(64, "tree policy: verified nodes per step over all rows (0 = no cap)")
    speculate_up_to: int = opt(0, "tree policy: decode plainly above this batch size (0 = always speculate)")
    auto_off: bool = opt(False, "tree policy: measure online and decode plainly where that is faster")
    threads: int = opt(0, "torch threads (0 = number of cores)")
    out: str = opt("outputs/bench_batch.json", "where to write the JSON results")


def _hf_batch(target: Target, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], list[float]]:
    """HF greedy ``generate`` on one static, left-padded batch; returns tokens (cut after EOS) and end times."""
    model = target.model
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    eos = sorted(target.eos_token_ids)
    with torch.inference_mode():
        out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos or None, pad_token_id=pad)
    rows = []
    for seq in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(seq) if t in target.eos_token_ids), len(seq))
        rows.append(seq[:cut])
    return rows, [time.perf_counter()] * len(prompts)


def run_one(
    target: Target, prompts: list[list[int]], decoder: str, batch_size: int, max_new_tokens: int, policy: TreePolicy
) -> tuple[list[list[int]], list[float], float, float]:
    """Run one decoder at one batch size; returns (tokens per request, latencies, wall seconds, tau)."""
    cfg = GenerationConfig(max_new_tokens=max_new_tokens)
    if decoder == "hf":
        t0 = time.perf_counter()
        tokens, ends = [], []
        for i in range(0, len(prompts), batch_size):
            part, part_ends = _hf_batch(target, prompts[i : i + batch_size], max_new_tokens)
            tokens += part
            ends += part_ends
        wall = time.perf_counter() - t0
        return tokens, [e - t0 for e in ends], wall, 1.0
    make = None
    if decoder != "plain":
        name, options = parse_decoder(decoder)
        factory = drafter_factory(name, target.model, **options)  # a head folder is read once
        pool = [factory() for _ in range(min(batch_size, len(prompts)))]
        make = pool.pop  # drafters are built outside the timed region
    t0 = time.perf_counter()
    results = generate_batch(target.model, prompts, make, cfg, target.eos_token_ids, target.tokenizer, batch_size,
                             policy)
    wall = time.perf_counter() - t0
    errors = [r.error for r in results if not r.ok]
    if errors:
        raise ValueError(f"{len(errors)} request(s) failed: {errors[0]}")
    steps = sum(r.stats.steps for r in results)
    tau = sum(r.stats.steps + r.stats.accepted for r in results) / steps if steps else 1.0
    return [r.tokens for r in results], [r.latency_s for r in results], wall, tau


def bench_batch(
    target: Target,
    prompts: list[list[int]],
    batch_sizes: list[int],
    decoders: list[str],
    max_new_tokens: int = 128,
    policy: TreePolicy | None = None,
) -> list[dict]:
    """Every decoder at every batch size on the same requests; one row (a dict) per pair.

    Rows hold tokens/s (all new tokens / wall), mean and p90 per-request latency, tau, and the share
    of requests whose tokens equal the ``plain`` decoder's at that batch size (when plain is run first).
    """
    policy = policy or TreePolicy()
    rows = []
    for batch_size in batch_sizes:
        reference = None
        for decoder in sorted(decoders, key=lambda d: d != "plain"):
            tokens, latency, wall, tau = run_one(target, prompts, decoder, batch_size, max_new_tokens, policy)
            if decoder == "plain":
                reference = tokens
            new = sum(len(t) for t in tokens)
            lat = sorted(latency)
            same = None if reference is None else sum(a == b for a, b in zip(tokens, reference)) / len(tokens)
            rows.append(dict(decoder=decoder, batch_size=batch_size, new_tokens=new, wall_s=wall,
                             tokens_per_s=new / wall if wall else 0.0, mean_latency_s=sum(lat) / len(lat),
                             p90_latency_s=lat[min(len(lat) - 1, int(0.9 * len(lat)))], tau=tau, same_as_plain=same))
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| decoder | batch | tok/s | mean latency s | p90 latency s | tau | same as plain |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        same = "-" if r["same_as_plain"] is None else f"{100 * r['same_as_plain']:.0f}%"
        lines.append(f"| {r['decoder']} | {r['batch_size']} | {r['tokens_per_s']:.1f} | {r['mean_latency_s']:.2f} | "
                     f"{r['p90_latency_s']:.2f} | {r['tau']:.2f} | {same} |")
    return "\n".join(lines)


def crossover(rows: list[dict]) -> str:
    """The smallest batch size from which no speculative decoder beats plain decoding in tokens/s."""
    by_size: dict[int, dict[str, float]] = {}
    for r in rows:
        by_size.setdefault(r["batch_size"], {})[r["decoder"]] = r["tokens_per_s"]
    for size in sorted(by_size):
        speeds = by_size[size]
        spec = [v for k, v in speeds.items() if k not in ("hf", "plain")]
        if "plain" in speeds and spec and max(spec) <= speeds["plain"]:
            return f"speculation stops paying at batch size {size}"
    return "speculation pays at every batch size measured"


def main(cfg: BatchBenchConfig) -> list[dict]:
    from selfdraft.target import load_target

    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    target = load_target(cfg.target, dtype=cfg.dtype)
    prompts = [target.encode_chat(p) for p in load_prompts(cfg.prompts, cfg.limit or None)]
    policy = TreePolicy(max_step_tokens=cfg.max_step_tokens or None, speculate_up_to=cfg.speculate_up_to or None,
                        auto_off=cfg.auto_off)
    sizes = [int(b) for b in cfg.batch_sizes]
    rows = bench_batch(target, prompts, sizes, list(cfg.decoders), cfg.max_new_tokens, policy)
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.out).write_text(json.dumps({"config": asdict(cfg), "results": rows}, indent=1))
    print(f"target {cfg.target} ({cfg.dtype}), {len(prompts)} requests, {cfg.max_new_tokens} new tokens, greedy")
    print(format_table(rows))
    print(crossover(rows))
    print(f"wrote {cfg.out}")
    return rows


if __name__ == "__main__":
    argv = sys.argv[1:]
    path = argv.pop(0) if argv and "=" not in argv[0] else None
    main(load(BatchBenchConfig, path, argv))
