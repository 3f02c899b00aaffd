"""The ``selfdraft`` command: a thin shell over the library and the programs in scripts/.

Each subcommand is one entry of :func:`commands`: a frozen config dataclass (its fields become the
``--flags``; ``--config FILE.yaml`` supplies defaults), a handler ``run(cfg, out)`` and the output
flags it accepts (``--quiet``, ``--json``, ``--show-draft``, ``--html``). User mistakes (missing
files, bad options, an unknown target, a prompt that does not fit the context) print one
``selfdraft: error:`` line and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from selfdraft.config import ConfigError, add_arguments, from_args, opt

if TYPE_CHECKING:
    from selfdraft.benchmark import BenchConfig
    from selfdraft.drafters.base import Drafter
    from selfdraft.gate import SpeculationGate
    from selfdraft.generate import GenerationConfig, GenerationOutput
    from selfdraft.prefix_cache import PrefixCache
    from selfdraft.target import Target


@dataclass(frozen=True)
class DecodeConfig:
    """Target, drafter and sampling: what generate and chat share."""

    target: str = opt("smollm2", "target: alias (smollm2, gemma3-270m), local folder, .gguf file or hub id")
    dtype: str = opt("bfloat16", "target dtype: float32 (exact) or bfloat16 (faster on this CPU)")
    drafter: str = opt(
        "prompt_lookup", "drafter NAME[:key=value,...] (prompt_lookup, suffix, layer_skip, draft_model, head:path=DIR) or 'none'"
    )
    max_new_tokens: int = opt(128, "maximum new tokens per reply (>= 1)")
    temperature: float = opt(0.0, "0 = greedy; > 0 samples (lossless)")
    top_k: int = opt(0, "top-k (0 = off)")
    top_p: float = opt(1.0, "top-p (1.0 = off)")
    acceptance: str = opt("exact", "exact (lossless) or typical (Medusa typical acceptance, LOSSY)")
    seed: int = opt(0, "sampling seed")
    threads: int = opt(0, "torch threads (0 = number of cores)")
    auto_off: bool = opt(True, "measure online and decode plainly while speculation is slower on this machine "
                               "(per batch size in batch mode); the output does not change")


@dataclass(frozen=True)
class GenerateConfig(DecodeConfig):
    prompt: str = opt("Write a haiku about speculative decoding.", "user prompt (rendered with the chat template)")
    prompts: str = opt("", "batch mode: 'mtbench' or a JSONL file of prompts, decoded together (replaces --prompt)")
    limit: int = opt(0, "batch mode: first N prompts (0 = all)")
    batch_size: int = opt(8, "batch mode: sequences decoded at once (continuous batching refills finished slots)")
    max_step_tokens: int = opt(64, "batch mode: tree nodes verified per step over all rows (trees shrink as the batch grows)")


@dataclass(frozen=True)
class ChatConfig(DecodeConfig):
    system: str = opt("", "system message before the conversation ('' = none)")


@dataclass(frozen=True)
class Output:
    """How results are shown; not part of a run's config (not in YAML files)."""

    quiet: bool = False
    json: bool = False
    show_draft: bool = False
    html: str | None = None


OUTPUT_FLAGS: dict[str, tuple[tuple[str, ...], dict]] = {
    "quiet": (
        ("--quiet", "-q"),
        dict(action="store_true", help="no progress bars or loading notes on stderr"),
    ),
    "json": (
        ("--json",),
        dict(action="store_true", help="print one JSON object with the results to stdout instead of text and tables"),
    ),
    "show_draft": (
        ("--show-draft",),
        dict(action="store_true", help="colour each token by where it came from: accepted draft (green), "
                                       "target correction (red), bonus token (cyan), target (plain)"),
    ),
    "html": (
        ("--html",),
        dict(metavar="FILE", help="write a standalone HTML page: tokens coloured by source, tau, tokens/s"),
    ),
}
"""Output flags a subcommand may take: name (the Output field) -> (flag names, argparse options)."""


@dataclass(frozen=True)
class Command:
    config: type
    """Frozen dataclass whose fields are the subcommand's options."""
    run: Callable[[Any, Output], None]
    help: str
    flags: tuple[str, ...] = ("quiet",)
    """Names in OUTPUT_FLAGS the subcommand accepts."""
    positional: str = ""
    """A config field that may also be given as the first positional argument (``export HEAD_DIR``)."""


# --- generate / chat -----------------------------------------------------------------------------


def _load(cfg: DecodeConfig, out: Output) -> tuple[Target, Drafter | None, GenerationConfig]:
    """Check the options, then load the target and build the drafter (with a progress bar)."""
    import torch

    from selfdraft.benchmark import parse_decoder
    from selfdraft.drafters import build_drafter
    from selfdraft.generate import GenerationConfig
    from selfdraft.progress import bar
    from selfdraft.sampling import SamplingConfig
    from selfdraft.target import load_target

    if cfg.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {cfg.max_new_tokens}")
    gen_cfg = GenerationConfig(
        max_new_tokens=cfg.max_new_tokens,
        sampling=SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p),
        acceptance=cfg.acceptance,
        seed=cfg.seed,
        auto_off=cfg.auto_off,
    )
    spec = None if cfg.drafter == "none" else parse_decoder(cfg.drafter)
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    t0 = time.perf_counter()
    with bar(2, f"loading {cfg.target}", not out.quiet) as pbar:
        target = load_target(cfg.target, dtype=cfg.dtype)
        pbar.update(1)
        pbar.set_description(f"building drafter {cfg.drafter}")
        drafter = build_drafter(spec[0], target.model, cfg.temperature, **spec[1]) if spec else None
        pbar.update(1)
    if not out.quiet:
        print(f"[loaded {cfg.target} in {time.perf_counter() - t0:.1f}s; drafter {cfg.drafter}]", file=sys.stderr)
    return target, drafter, gen_cfg


def _reply(
    target: Target, ids: list[int], drafter: Drafter | None, gen_cfg: GenerationConfig, show_draft: bool, live: bool,
    prefix_cache: PrefixCache | None = None, gate: SpeculationGate | None = None,
) -> tuple[GenerationOutput, list[str]]:
    """Generate one reply, streaming it to stdout when ``live``; returns (output, per-token texts)."""
    from selfdraft.generate import generate
    from selfdraft.show import TokenTexts, ansi_text

    texts = TokenTexts(target.tokenizer)
    pieces: list[str] = []

    def stream(tokens: list[int], sources: list[str]) -> None:
        new = texts.push(tokens)
        pieces.extend(new)
        if live:
            sys.stdout.write(ansi_text(new, sources) if show_draft else "".join(new))
            sys.stdout.flush()

    result = generate(target.model, ids, drafter, gen_cfg, target.eos_token_ids, target.tokenizer, stream,
                      prefix_cache, gate)
    if live:
        print()
    return result, pieces


def _stats_line(result: GenerationOutput) -> str:
    s = result.stats
    return (
        f"[{s.new_tokens} tokens in {s.wall_s:.2f}s = {s.tokens_per_s:.1f} tok/s; tau {s.tau:.2f} over "
        f"{s.steps} target forwards; time draft {s.draft_s:.2f}s verify {s.verify_s + s.prefill_s:.2f}s "
        f"other {s.other_s:.2f}s; stop: {result.stop_reason}"
        + (f"; {s.reused_tokens} prompt tokens reused from the last turn" if s.reused_tokens else "") + "]"
    )


def run_generate_batch(cfg: GenerateConfig, out: Output) -> None:
    """Many prompts decoded together; one result per prompt in order, failed rows reported, not fatal to the rest."""
    from selfdraft.batch import TreePolicy, generate_batch
    from selfdraft.benchmark import load_prompts, parse_decoder
    from selfdraft.drafters import drafter_factory

    if cfg.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {cfg.batch_size}")
    texts = load_prompts(cfg.prompts, cfg.limit or None)
    target, _, gen_cfg = _load(dataclasses.replace(cfg, drafter="none"), out)
    factory = None
    if cfg.drafter != "none":
        name, options = parse_decoder(cfg.drafter)
        factory = drafter_factory(name, target.model, cfg.temperature, **options)
    t0 = time.perf_counter()
    results = generate_batch(target.model, [target.encode_chat(t) for t in texts], factory, gen_cfg,
                             target.eos_token_ids, target.tokenizer, cfg.batch_size,
                             TreePolicy(max_step_tokens=cfg.max_step_tokens, auto_off=cfg.auto_off))
    wall = time.perf_counter() - t0
    failed = [(i, r) for i, r in enumerate(results) if not r.ok]
    for i, (prompt, res) in enumerate(zip(texts, results)):
        text = target.tokenizer.decode(res.tokens, skip_special_tokens=True) if res.ok else ""
        if out.json:
            print(json.dumps({"index": i, "prompt": prompt, "text": text, "error": res.error,
                              "stop_reason": res.stop_reason, "tau": res.stats.tau if res.ok else None,
                              "latency_s": res.latency_s}))
        elif res.ok:
            print(f"=== {i}: {prompt[:60]!r}\n{text}")
    new = sum(len(r.tokens) for r in results)
    if not out.quiet:
        print(f"[{len(texts)} prompts, batch {cfg.batch_size}: {new} tokens in {wall:.1f}s = {new / wall:.1f} tok/s]",
              file=sys.stderr)
    if failed:
        for i, res in failed:
            print(f"selfdraft: prompt {i} failed: {res.error}", file=sys.stderr)
        raise ValueError(f"{len(failed)} of {len(texts)} prompts failed (the others are printed above)")


def run_generate(cfg: GenerateConfig, out: Output) -> None:
    """One prompt -> one streamed reply; optional colours, HTML page and JSON. With --prompts: batch mode."""
    from selfdraft.show import ansi_legend, html_page, summary, write_page

    if cfg.prompts:
        if out.show_draft or out.html:
            raise ValueError("--show-draft and --html show one generation; drop them with --prompts")
        run_generate_batch(cfg, out)
        return

    target, drafter, gen_cfg = _load(cfg, out)
    ids = target.encode_chat(cfg.prompt)
    if out.show_draft and not out.json:
        print(ansi_legend(), file=sys.stderr)
    result, pieces = _reply(target, ids, drafter, gen_cfg, out.show_draft, live=not out.json)
    numbers = summary(result.stats)
    if out.html:
        info = {"target": cfg.target, "drafter": cfg.drafter, "temperature": cfg.temperature}
        page = html_page(pieces, result.sources, {**info, **numbers, "stop": result.stop_reason}, prompt=cfg.prompt)
        write_page(out.html, page)
    if out.json:
        print(json.dumps({
            "target": cfg.target, "drafter": cfg.drafter, "prompt": cfg.prompt, "text": "".join(pieces),
            "tokens": result.tokens, "sources": result.sources, "stop_reason": result.stop_reason,
            "summary": numbers, "stats": result.stats.to_dict(), "html": out.html,
        }))
        return
    print(_stats_line(result), file=sys.stderr)
    if out.html:
        print(f"[wrote {out.html}]", file=sys.stderr)


def run_chat(cfg: ChatConfig, out: Output) -> None:
    """Multi-turn REPL over stdin: each line is a user turn; /reset clears the history, /quit or EOF ends."""
    from selfdraft.data import has_chat_template, reply_content
    from selfdraft.gate import SpeculationGate
    from selfdraft.generate import ContextLengthError
    from selfdraft.prefix_cache import PrefixCache
    from selfdraft.show import ansi_legend

    target, drafter, gen_cfg = _load(cfg, out)
    history = PrefixCache()  # the KV of the conversation so far: each turn prefills only its new tokens
    gate = SpeculationGate(gen_cfg.probe_every)  # what speculation measured here carries from turn to turn
    chat = has_chat_template(target.tokenizer)  # how a reply goes back into the history (reply_content)
    interactive = sys.stdin.isatty()
    system = [{"role": "system", "content": cfg.system}] if cfg.system else []
    messages = list(system)
    if interactive:
        print(f"chatting with {cfg.target}: /reset clears the history, /quit or Ctrl-D ends", file=sys.stderr)
    if out.show_draft:
        print(ansi_legend(), file=sys.stderr)
    turn = 0
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text == "/quit":
            break
        if text == "/reset":
            messages = list(system)
            history.clear()
            print("[history cleared]", file=sys.stderr)
            continue
        if text.startswith("/"):
            print(f"[unknown command {text}: /reset clears the history, /quit ends]", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": text})
        ids = target.encode_chat(messages)
        turn_cfg = dataclasses.replace(gen_cfg, seed=cfg.seed + turn)
        try:
            result, pieces = _reply(target, ids, drafter, turn_cfg, out.show_draft, live=True, prefix_cache=history,
                                    gate=gate)
        except ContextLengthError as err:
            messages.pop()
            print(f"selfdraft: error: {err} (/reset clears the history)", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": reply_content("".join(pieces), chat)})
        print(_stats_line(result), file=sys.stderr)
        turn += 1


# --- bench ---------------------------------------------------------------------------------------


def run_bench(cfg: BenchConfig, out: Output) -> None:
    """Decoders side by side: table (or JSON on stdout), JSON file, optional plots."""
    from selfdraft.benchmark import main as bench_main

    bench_main(cfg, quiet=out.quiet, as_json=out.json)


def run_export(cfg, out: Output) -> None:
    from selfdraft.export import run_export as export

    path = export(cfg)
    print(json.dumps({"exported": str(path), "format": cfg.format}) if out.json else f"exported {cfg.head} as {cfg.format} to {path}")


def run_import(cfg, out: Output) -> None:
    from selfdraft.export import run_import as import_

    path = import_(cfg)
    print(json.dumps({"imported": str(path)}) if out.json else f"imported {cfg.src} to {path}")


def run_tune(cfg, out: Output) -> None:
    """Measure this machine and the head, save the best tree budget next to the head."""
    from selfdraft.tune import main as tune_main

    result = tune_main(cfg)
    if out.json:
        print(json.dumps(result))


@dataclass(frozen=True)
class LaunchOptions:
    launch: str = opt("", "accelerate config YAML: run under `accelerate launch` (DDP, DeepSpeed) instead of in-process")


def _program(name: str):
    """Load a program from the repository's train/ folder (they are scripts, not library modules)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "train" / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the training programs ship with the repository; "
                                "clone it and `pip install -e .` there")
    spec = importlib.util.spec_from_file_location(f"selfdraft_train_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module, path


def _run_program(name: str, cfg, schema: type) -> None:
    """In-process ``main(cfg)``, or ``accelerate launch`` with the options as key=value overrides."""
    import subprocess

    fields = {f.name for f in dataclasses.fields(schema)}
    values = {k: v for k, v in dataclasses.asdict(cfg).items() if k in fields}
    module, path = _program(name)
    if not getattr(cfg, "launch", ""):
        module.main(schema(**values))
        return
    if not os.path.isfile(cfg.launch):
        raise FileNotFoundError(f"accelerate config not found: {cfg.launch}")
    overrides = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in values.items()]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", cfg.launch, str(path), *overrides]
    print("[launch] " + " ".join(cmd[2:5]) + " ...", file=sys.stderr)
    code = subprocess.call(cmd)
    if code != 0:
        raise ValueError(f"accelerate launch exited with status {code}")


def _train_schema():
    from selfdraft.train_config import TrainConfig

    return dataclass(frozen=True)(type("TrainCommandConfig", (LaunchOptions, TrainConfig), {}))


# --- parser --------------------------------------------------------------------------------------


def commands() -> dict[str, Command]:
    """Subcommand name -> Command. Adding a subcommand is one entry here plus its config and handler."""
    from selfdraft.benchmark import BenchConfig
    from selfdraft.export import ExportConfig, ImportConfig
    from selfdraft.train_config import DistillConfig, TrainConfig
    from selfdraft.tune import TuneConfig

    return {
        "generate": Command(GenerateConfig, run_generate, "generate text with a target and a drafter, streaming",
                            ("quiet", "json", "show_draft", "html")),
        "chat": Command(ChatConfig, run_chat, "multi-turn chat over stdin (/reset, /quit), streaming",
                        ("quiet", "show_draft")),
        "bench": Command(BenchConfig, run_bench, "benchmark decoders side by side: table, JSON and plots",
                         ("quiet", "json")),
        "tune": Command(TuneConfig, run_tune, "pick the draft tree budget that is fastest on this machine, save it with the head",
                        ("quiet", "json")),
        "export": Command(ExportConfig, run_export, "write a head in a serving engine's layout (vLLM, SGLang, EAGLE, Medusa, TGI)",
                          ("quiet", "json"), positional="head"),
        "import": Command(ImportConfig, run_import, "read a head in an engine layout (exported or released) into this project's format",
                          ("quiet", "json"), positional="src"),
        "train": Command(_train_schema(), lambda cfg, out: _run_program("train", cfg, TrainConfig),
                         "train a draft head on a frozen target (train/train.py; --config configs/train/*.yaml)", ("quiet",)),
        "features": Command(TrainConfig, lambda cfg, out: _run_program("dump_features", cfg, TrainConfig),
                            "write a training config's target features to disk (train/dump_features.py)", ("quiet",)),
        "distill": Command(DistillConfig, lambda cfg, out: _run_program("distill", cfg, DistillConfig),
                           "regenerate a conversation set's replies with the target (train/distill.py)", ("quiet",)),
    }


def build_parser(cmds: dict[str, Command] | None = None) -> argparse.ArgumentParser:
    """One subparser per command: ``--config``, the config's fields as flags, then its output flags."""
    parser = argparse.ArgumentParser(prog="selfdraft", description="Self-drafting speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in (cmds or commands()).items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        p.add_argument("--config", help=f"YAML file of {name} options (flags override it)")
        add_arguments(p, cmd.config)
        if cmd.positional:
            p.add_argument(f"pos_{cmd.positional}", nargs="?", metavar=cmd.positional.upper(),
                           help=f"same as --{cmd.positional.replace('_', '-')}")
        for flag in cmd.flags:
            names, kwargs = OUTPUT_FLAGS[flag]
            p.add_argument(*names, dest=f"out_{flag}", **kwargs)
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean a user mistake: reported as one line, exit status 2."""
    from selfdraft.generate import ContextLengthError

    return (ConfigError, ContextLengthError, OSError, KeyError, ValueError)


def main(argv: list[str] | None = None) -> int:
    """Parse, run the subcommand, map user errors to one line and exit status 2."""
    cmds = commands()
    args = build_parser(cmds).parse_args(argv)
    cmd = cmds[args.command]
    out = Output(**{f: getattr(args, f"out_{f}") for f in cmd.flags})
    if out.quiet:  # one switch for every command: our bars (also in launched processes), HF's bars and notes
        from selfdraft.progress import QUIET_ENV, quiet_libraries

        os.environ[QUIET_ENV] = "1"
        quiet_libraries()
    if cmd.positional and getattr(args, f"pos_{cmd.positional}", None):
        setattr(args, cmd.positional, getattr(args, f"pos_{cmd.positional}"))
    try:
        cmd.run(from_args(cmd.config, args, args.config), out)
    except user_errors() as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"selfdraft: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
