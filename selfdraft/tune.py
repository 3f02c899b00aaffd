"""Tune a head's draft tree to this machine: the budget with the highest expected tokens/s.

Expected tokens/s of a tree budget b is ``tau(b) / (verify(b) + draft(b) + other)``:

- ``verify(n)``: measured latency of one greedy target forward over a tree of n tokens after a cached
  context of the tuning prompts' text, as generation runs it (the lm_head screened for up to four
  tokens; on a GPU nearly flat up to ~64 tokens; on a small CPU it grows quickly);
- ``draft(b)``: measured latency of one drafter step (feed the accepted pair, expand the tree);
- ``other``: the decode loop's own time per step (acceptance, cache compaction), from a real run;
- ``tau(b)``: accept length of the budget on real prompts. EAGLE heads (dynamic trees): one greedy
  run per branching factor with the largest tree records each verified node's depth and score; the
  accepted path of any smaller budget (top-N by score among nodes of depth <= D) is read off the
  same steps, since greedy decoding commits the same tokens whatever the tree. Medusa heads (static
  trees): per-head top-r accuracies on the target's own greedy continuations give each candidate
  path the probability of being accepted (Medusa's tree construction); tau of the best N paths is
  1 + their summed probabilities.

The chosen budget is written to ``tune.json`` in the head folder, which ``head:path=DIR`` drafters
read as their defaults (explicit options still win).

With ``lookup=N`` the tree to merge with an N-token prompt-lookup draft (``head:path=DIR,lookup=N``,
:class:`~selfdraft.drafters.MergedDrafter`) is picked too. The head-alone model above does not
predict it: the merged tree adds lookup's copied spans, and the speculation gate switches head-only
steps off and on by their measured cost, so a cheaper head tree can commit more per second than the
one best alone (docs/benchmarks.md, nineteenth session). The best few head trees and a one-token
head draft are therefore decoded for real, merged and gated as ``generate`` runs them, the trees
taking turns prompt by prompt; greedy output is the same for all, so the least total time wins.
The choice is saved under ``lookup`` in ``tune.json`` and read by ``head:path=DIR,lookup=N``.

With ``temperature=T`` (> 0) the head tree for sampling is picked the same way, by decoding: at T a
top-k child is accepted with the target's probability of it, not whenever it is the argmax, so the
greedy profile says little; the trials are the one-token draft and the best trees, each with its
children as the head's top-k and drawn from the head's q (``sample=true``). Saved under ``sampled``
and used by head drafters built for sampling (``temperature`` > 0 in :func:`read_tuned`).
"""

from __future__ import annotations

import heapq
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from selfdraft.adapter import new_cache, tree_forward
from selfdraft.config import opt
from selfdraft.drafters.base import Draft, Drafter, StepResult
from selfdraft.generate import GenerationConfig, generate
from selfdraft.heads.artifact import write_text_atomic
from selfdraft.kernels import cpu_report
from selfdraft.tree import chain_tree, top_nodes_by_score

TUNE_FILE = "tune.json"
BUDGETS = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)


@dataclass(frozen=True)
class TuneConfig:
    head: str = opt("", "head folder to tune; the chosen tree is saved there as tune.json")
    target: str = opt("smollm2", "target: alias, local folder, .gguf file or hub id")
    dtype: str = opt("bfloat16", "target dtype to tune for (the one you will generate in)")
    prompts: str = opt("sharegpt-heldout", "prompts for the acceptance profile: 'sharegpt-heldout' (the last ShareGPT records, "
                       "disjoint from training and from MT-bench), 'mtbench' or a JSONL file")
    limit: int = opt(6, "prompts in the acceptance profile")
    max_new_tokens: int = opt(96, "new tokens per profiled prompt")
    max_nodes: int = opt(64, "largest tree considered (draft nodes, root excluded)")
    max_depth: int = opt(8, "deepest tree considered")
    top_ks: str = opt("1 2 4 8", "EAGLE: branching factors considered (space-separated)")
    context: int = opt(256, "cached context length behind the timed verification forwards")
    reps: int = opt(7, "timing repetitions per size (median)")
    threads: int = opt(0, "torch threads (0 = number of cores)")
    lookup: int = opt(0, "also pick the head tree to merge with an N-token prompt-lookup draft (head:path=DIR,lookup=N): "
                      "the best trees are decoded end to end with the speculation gate (0 = head alone only)")
    measure: int = opt(3, "with lookup: how many of the best head-alone trees to decode merged (plus a one-token draft)")
    temperature: float = opt(0.0, "also pick the head tree for sampling at this temperature (> 0): the one-token draft and "
                             "the best trees, children top-k and drawn from the head (sample=true), are decoded at it "
                             "with the speculation gate; head drafters use the choice when generation samples")
    save: bool = opt(True, "write tune.json into the head folder")
    out: str = opt("", "also write the full measurements as JSON to this file")


def setup_differences(measured_on: dict, here: dict) -> dict[str, tuple]:
    """The CPU-report fields (:func:`selfdraft.kernels.cpu_report`) in which the machine a tree was
    tuned on differs from this one, as {field: (there, here)}; a field missing there (recorded by an
    older version) counts as False. Tunes older than the report itself are taken as they are."""
    if "cpu_capability" not in measured_on:
        return {}
    return {k: (measured_on.get(k, False), v) for k, v in here.items() if measured_on.get(k, False) != v}


def read_tuned(head_dir: str | Path, lookup: int = 0, temperature: float = 0.0) -> dict:
    """The drafter options saved by ``selfdraft tune`` for this head ({} if it was never tuned, or
    tuned on a CPU setup unlike this one: that tune's timings say nothing here; a message says so).

    ``lookup`` > 0: the options tuned for the head merged with an N-token prompt-lookup draft; when
    the head was tuned without that lookup, its head-alone options, with a message saying so.
    ``temperature`` > 0 (the head alone): the options tuned for sampling (``tune --temperature``),
    those of another temperature with a message; when there are none, the greedy ones with a message.
    Merged with lookup, a sampling run takes the greedy merged choice (a merged tree is deterministic)."""
    path = Path(head_dir) / TUNE_FILE
    if not path.is_file():
        return {}
    tuned = json.loads(path.read_text())
    differs = setup_differences(tuned.get("tuned_for", {}), cpu_report())
    if differs:
        shown = ", ".join(f"{k} {a} there, {b} here" for k, (a, b) in differs.items())
        print(f"[tune] ignoring {path}: it was measured on a different CPU setup ({shown}); run "
              f"`selfdraft tune --head {head_dir}` here to pick a tree for this machine", file=sys.stderr)
        return {}
    merged = tuned.get("lookup") or {}
    sampled = tuned.get("sampled")
    if temperature > 0 and not lookup and sampled:
        if abs(sampled["temperature"] - temperature) > 1e-6:
            print(f"[tune] {path}: using the tree tuned for temperature {sampled['temperature']} at temperature "
                  f"{temperature}; `selfdraft tune --head {head_dir} --temperature {temperature}` tunes for this one",
                  file=sys.stderr)
        return dict(sampled["drafter_options"])
    if temperature > 0 and not lookup:
        print(f"[tune] {path} holds the tree tuned for greedy decoding; `selfdraft tune --head {head_dir} "
              f"--temperature {temperature}` picks one for sampling", file=sys.stderr)
    if lookup and merged.get("num_tokens") == lookup:
        return dict(merged["drafter_options"])
    if lookup:
        print(f"[tune] {path} holds the tree tuned for the head alone, not merged with lookup={lookup}; "
              f"`selfdraft tune --head {head_dir} --lookup {lookup}` picks the tree for the merged drafter", file=sys.stderr)
    return dict(tuned.get("drafter_options", {}))


@torch.inference_mode()
def forward_latency(model: nn.Module, sizes: list[int], context: int, reps: int,
                    routes: dict[str, Callable[[], None]], argmax_only: bool = False,
                    text: Sequence[int] = ()) -> dict[str, dict[int, float]]:
    """Median seconds of one tree forward over n tokens (n in ``sizes``) after ``context`` cached tokens,
    per route: ``routes`` maps a name to a function run before each of its forwards (switching how the
    forward runs; scripts/forward_routes.py compares the lean and the HF forward this way).
    ``argmax_only`` times the forwards as greedy steps run them (:func:`tree_forward`: the lm_head
    screened where it pays). ``text``: token ids the context and the timed tokens are read from
    (repeated where too short; random ids where empty). Greedy timings need real text: after random
    ids the screen can keep ~10% of Gemma-3's vocabulary (27,469 of 262,144 rows where text keeps
    3-13), and then times a screened verification slower than an unscreened one.

    The sizes and routes take turns, one forward each per round, so a drift of the machine's speed
    over the minutes of a run (10-30% on the shared CPUs measured here) lands on every size alike
    instead of on whichever size was being timed then (docs/perf_log.md)."""
    device = next(model.parameters()).device
    need = context + max(sizes)
    if text:
        ids = torch.tensor((list(text) * (need // len(text) + 1))[:need], device=device)
    else:
        ids = torch.randint(0, model.config.vocab_size, (need,), generator=torch.Generator().manual_seed(0)).to(device)
    cache = new_cache(model, need + 8)
    tree_forward(model, cache, ids[None, :context], chain_tree(context - 1), last_logits_only=True)
    inputs = {n: (ids[None, context : context + n], chain_tree(n - 1)) for n in sizes}
    times: dict[str, dict[int, list[float]]] = {r: {n: [] for n in sizes} for r in routes}
    for rep in range(reps + 1):  # round 0 warms every shape up
        for n, (tokens, tree) in inputs.items():
            for route, enter in routes.items():
                enter()
                t0 = time.perf_counter()
                tree_forward(model, cache, tokens, tree, argmax_only=argmax_only)
                if rep:
                    times[route][n].append(time.perf_counter() - t0)
                cache.truncate(context)
    return {r: {n: statistics.median(t) for n, t in per.items()} for r, per in times.items()}


def verify_latency(model: nn.Module, sizes: list[int], context: int, reps: int, text: Sequence[int]) -> dict[int, float]:
    """Median seconds of one greedy verification over n tokens (n in ``sizes``) after ``context`` cached
    tokens of ``text`` (the tuning prompts), the sizes taking turns (:func:`forward_latency`). Greedy as
    :func:`generate` runs it: only each row's argmax is used, so small trees get the screened lm_head
    (:mod:`selfdraft.greedy_screen`) and their cost is not overestimated."""
    return forward_latency(model, sizes, context, reps, {"": lambda: None}, argmax_only=True, text=text)[""]


@torch.inference_mode()
def draft_latency(model: nn.Module, drafter: Drafter, prompt: list[int], reps: int) -> float:
    """Median seconds of one steady-state drafter step: take one accepted pair, propose a tree."""
    device = next(model.parameters()).device
    layers = tuple(drafter.hidden_layers)
    cache = new_cache(model, len(prompt) + 8)
    ids = torch.tensor(prompt, device=device)
    fwd = tree_forward(model, cache, ids[None], chain_tree(len(prompt) - 1), layers, True)
    tokens = torch.tensor(prompt + [int(fwd.logits[0, -1].argmax())])
    drafter.reset(StepResult(tokens, 0, fwd.hidden_states))
    greedy = GenerationConfig().sampling
    drafter.propose(tokens, greedy, None)
    last = {i: h[:, -1:] for i, h in fwd.hidden_states.items()} if fwd.hidden_states else None
    times = []
    for _ in range(reps + 1):
        tokens = torch.cat([tokens, tokens[-1:]])
        drafter.update(StepResult(tokens, 0, last))
        t0 = time.perf_counter()
        drafter.propose(tokens, greedy, None)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


class ProfileRecorder:
    """Wraps an EAGLE drafter: proposes its largest tree and records, per step, every verified node's
    depth and score and which nodes the target accepted (greedy)."""

    def __init__(self, drafter, max_nodes: int):
        self.drafter, self.max_nodes = drafter, max_nodes
        self.hidden_layers = drafter.hidden_layers
        self.steps: list[tuple[Tensor, Tensor, list[int]]] = []
        self._last = None

    def reset(self, step: StepResult) -> None:
        self.drafter.reset(step)

    def propose(self, tokens: Tensor, sampling, generator) -> Draft:
        tree, node_tokens, scores, _ = self.drafter.expand(tokens)
        tree, keep = top_nodes_by_score(tree, scores, self.max_nodes)
        self._last = (tree, node_tokens[keep], scores[keep])
        return Draft(tree, node_tokens[keep])

    def update(self, step: StepResult) -> None:
        tree, node_tokens, scores = self._last
        n = step.num_accepted
        accepted = step.tokens[len(step.tokens) - 1 - n : len(step.tokens) - 1].tolist()
        path, node, kids = [], 0, tree.children()
        for tok in accepted:
            node = next(c for c in kids[node] if int(node_tokens[c]) == tok)
            path.append(node)
        self.steps.append((tree.depth.clone(), scores.clone(), path))
        self.drafter.update(step)


def tau_from_profile(steps: list[tuple[Tensor, Tensor, list[int]]], budget: int, depth: int) -> float:
    """Mean accept length (1 + accepted) of the top-``budget`` nodes by score among depth <= ``depth``."""
    total = 0
    for depths, scores, path in steps:
        s = scores.clone().float()
        s[0] = float("inf")
        s[depths > depth] = float("-inf")
        order = torch.sort(-s, stable=True).indices[: budget + 1]
        kept = set(order.tolist())
        accepted = 0
        for node in path:
            if node not in kept or int(depths[node]) > depth:
                break
            accepted += 1
        total += 1 + accepted
    return total / max(1, len(steps))


def medusa_rank_accuracy(model: nn.Module, heads: nn.Module, sequences: list[tuple[list[int], int]], width: int) -> Tensor:
    """(K, width) fraction of positions where head k's rank-r token is the one the target emitted.

    sequences: (token ids, index where generated tokens start): the target's own greedy continuations.
    """
    k = heads.cfg.num_heads
    hits = torch.zeros(k, width)
    counts = torch.zeros(k)
    with torch.inference_mode():
        for ids, start in sequences:
            x = torch.tensor([ids], device=next(model.parameters()).device)
            hidden = model(input_ids=x, output_hidden_states=[-1]).hidden_states[-1][0]
            logits = heads(hidden)  # (K, seq, V)
            for j in range(k):
                shift = j + 2
                lo, hi = max(start - 1, 0), len(ids) - shift
                if hi <= lo:
                    continue
                top = logits[j, lo:hi].topk(width, -1).indices.cpu()
                want = torch.tensor(ids[lo + shift : hi + shift])[:, None]
                hits[j] += (top == want).float().sum(0)
                counts[j] += hi - lo
    return hits / counts.clamp(min=1)[:, None]


def medusa_best_paths(acc: Tensor, max_nodes: int) -> list[tuple[tuple[int, ...], float]]:
    """Best-first tree construction (Medusa): paths in order of acceptance probability prod acc[d, r_d].

    Children never beat their parent, so every prefix of the returned list is a valid (prefix-closed) tree.
    """
    k, width = acc.shape
    heap = [(-float(acc[0, r]), (r,)) for r in range(width)]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < max_nodes:
        neg, path = heapq.heappop(heap)
        out.append((path, -neg))
        if len(path) < k:
            for r in range(width):
                heapq.heappush(heap, (neg * float(acc[len(path), r]), path + (r,)))
    return out


@torch.inference_mode()
def decode_time(model: nn.Module, prompts: list[list[int]], factories: dict[str, Callable[[], Drafter | None]],
                cfg: GenerationConfig, eos_token_ids: Sequence[int]) -> dict[str, dict]:
    """Decode every prompt with a fresh drafter of each factory (None: plain decoding), the factories
    taking turns prompt by prompt in a rotating order (a drift of the machine's speed lands on all
    alike). Returns {name: {"seconds", "tokens", "tokens_per_s", "tau"}} over all prompts (tau: tokens
    committed per verification forward, the prefill's first token not counted); each
    factory first decodes a few tokens untimed (one-time costs: kernels, first shapes)."""
    names = list(factories)
    warm = replace(cfg, max_new_tokens=min(8, cfg.max_new_tokens))
    for name in names:
        generate(model, prompts[0], factories[name](), warm, eos_token_ids)
    totals = {name: {"seconds": 0.0, "tokens": 0, "steps": 0, "verified": 0} for name in names}
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names):] + names[: i % len(names)]:
            drafter = factories[name]()
            t0 = time.perf_counter()
            out = generate(model, prompt, drafter, cfg, eos_token_ids)
            totals[name]["seconds"] += time.perf_counter() - t0
            totals[name]["tokens"] += len(out.tokens)
            totals[name]["steps"] += out.stats.steps
            totals[name]["verified"] += sum(out.stats.accept_lengths)
    return {name: {**t, "tokens_per_s": t["tokens"] / max(t["seconds"], 1e-9), "tau": t["verified"] / max(1, t["steps"])}
            for name, t in totals.items()}


def tree_key(options: dict) -> str:
    """Options that build the same tree share a key: a depth-1 EAGLE tree is the top ``total_tokens``
    children whatever ``top_k`` (>= total_tokens) they are picked from."""
    if options.get("depth") == 1 and "total_tokens" in options:
        options = {**options, "top_k": options["total_tokens"]}
    return json.dumps(options, sort_keys=True)


def trial_trees(kind: str, candidates: list[dict], count: int) -> list[dict]:
    """Head drafter options to decode for real: a one-token draft, then the ``count`` best head-alone
    candidates by expected tokens/s that build other trees."""
    one = {"paths": [[0]]} if kind == "medusa" else {"depth": 1, "top_k": 1, "total_tokens": 1}
    trials, seen = [one], {tree_key(one)}
    for c in sorted(candidates, key=lambda c: -c["expected_tokens_per_s"]):
        if len(trials) > count:
            break
        if tree_key(c["drafter_options"]) not in seen:
            seen.add(tree_key(c["drafter_options"]))
            trials.append(c["drafter_options"])
    return trials


TIE = 0.03
"""Decoded trials within this fraction of the fastest (about the timing noise of one pass over a few
prompts here) count as tied, and the smallest tree among them wins: a cheaper head step keeps the
gate drafting on more steps when the prompts turn out less predictable than the tuning ones."""


def tree_size(options: dict) -> int:
    return len(options["paths"]) if "paths" in options else options["total_tokens"]


def measure_trials(model: nn.Module, prompts: list[list[int]], trials: list[dict], build: Callable[[dict], Drafter],
                   references: dict[str, Callable[[], Drafter | None]], gen: GenerationConfig,
                   eos_token_ids: Sequence[int]) -> dict:
    """Decode a drafter ``build(options)`` of every trial and the reference decoders on the prompts,
    in turns (:func:`decode_time`); the fastest trial by tokens/s wins, the smallest tree of those
    within TIE of it. Returns {"drafter_options", "measured_tokens_per_s", "measured_tau", "trials",
    "reference"}."""
    factories = dict(references)
    for i, options in enumerate(trials):
        factories[f"trial {i}"] = lambda o=options: build(o)
    measured = decode_time(model, prompts, factories, gen, eos_token_ids)
    rows = [{"drafter_options": o, "nodes": tree_size(o), **measured[f"trial {i}"]} for i, o in enumerate(trials)]
    fastest = max(r["tokens_per_s"] for r in rows)
    best = min((r for r in rows if r["tokens_per_s"] * (1 + TIE) >= fastest), key=lambda r: (r["nodes"], -r["tokens_per_s"]))
    return {"drafter_options": best["drafter_options"], "measured_tokens_per_s": best["tokens_per_s"],
            "measured_tau": best["tau"], "trials": rows, "reference": {name: measured[name] for name in references}}


def tune_merged(model: nn.Module, head: nn.Module, kind: str, prompts: list[list[int]], candidates: list[dict],
                cfg: TuneConfig, eos_token_ids: Sequence[int]) -> dict:
    """Decode the trial head trees merged with cfg.lookup-token prompt lookup (gated, greedy), with
    plain decoding and lookup alone alongside for reference (:func:`measure_trials`)."""
    from selfdraft.drafters import MergedDrafter, PromptLookupDrafter
    from selfdraft.heads import head_type

    trials = trial_trees(kind, candidates, cfg.measure)
    references: dict[str, Callable[[], Drafter | None]] = {
        "plain": lambda: None, "prompt_lookup": lambda: PromptLookupDrafter(num_tokens=cfg.lookup)}
    print(f"[tune] decoding {len(trials)} head trees merged with lookup={cfg.lookup} on {len(prompts)} prompts (gated, greedy)")
    merged = measure_trials(
        model, prompts, trials,
        lambda o: MergedDrafter([head_type(kind).drafter(head, **o), PromptLookupDrafter(num_tokens=cfg.lookup)]),
        references, GenerationConfig(max_new_tokens=cfg.max_new_tokens, auto_off=True), eos_token_ids)
    return {"num_tokens": cfg.lookup, **merged}


def tune_sampled(model: nn.Module, head: nn.Module, kind: str, prompts: list[list[int]], candidates: list[dict],
                 cfg: TuneConfig, eos_token_ids: Sequence[int]) -> dict:
    """Decode the trial head trees sampling at cfg.temperature (gated, seeded per run), plain decoding
    alongside: the greedy acceptance profile does not carry over (a top-k child is accepted with the
    target's p of it, not when it is the argmax). EAGLE trials come twice: children as the head's
    top-k, and drawn from the head's q (``sample=true``)."""
    from selfdraft.heads import head_type
    from selfdraft.sampling import SamplingConfig

    trials = trial_trees(kind, candidates, cfg.measure)
    if kind in ("eagle1", "eagle3"):
        trials = [o for t in trials for o in (t, {**t, "sample": True})]
    print(f"[tune] decoding {len(trials)} head trees at temperature {cfg.temperature} on {len(prompts)} prompts (gated)")
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens, sampling=SamplingConfig(cfg.temperature), seed=0, auto_off=True)
    sampled = measure_trials(model, prompts, trials, lambda o: head_type(kind).drafter(head, **o),
                             {"plain": lambda: None}, gen, eos_token_ids)
    return {"temperature": cfg.temperature, **sampled}


def beaten_by(section: dict, reference: str) -> bool:
    """Whether a reference decoder of a :func:`measure_trials` section measured faster than every
    trial by more than TIE."""
    fastest = max(t["tokens_per_s"] for t in section["trials"])
    return section["reference"][reference]["tokens_per_s"] > fastest * (1 + TIE)


def format_trials(title: str, section: dict) -> str:
    """Decoded trials' measured speed, against the reference decoders (plain decoding last)."""
    plain = section["reference"]["plain"]["tokens_per_s"]
    lines = [f"{title:<56} {'tau':>5} {'tok/s':>7} {'x plain':>7}"]
    rows = [(json.dumps(r["drafter_options"]) if "paths" not in r["drafter_options"] else
             f"{len(r['drafter_options']['paths'])} Medusa paths", r) for r in section["trials"]]
    rows += [(f"({name} alone)", r) for name, r in section["reference"].items() if name != "plain"]
    for label, r in rows + [("(plain decoding)", section["reference"]["plain"])]:
        lines.append(f"{label:<56} {r['tau']:>5.2f} {r['tokens_per_s']:>7.1f} {r['tokens_per_s'] / plain:>6.2f}x")
    return "\n".join(lines)


def choose(candidates: list[dict]) -> dict:
    return max(candidates, key=lambda c: (c["expected_tokens_per_s"], -c["nodes"]))


def main(cfg: TuneConfig) -> dict:
    from selfdraft.benchmark import load_prompts
    from selfdraft.heads import load_head
    from selfdraft.target import load_target

    if not cfg.head:
        raise ValueError("give the head folder to tune: selfdraft tune --head DIR")
    if cfg.max_nodes < 1 or cfg.max_depth < 1:
        raise ValueError(f"max_nodes and max_depth must be >= 1, got {cfg.max_nodes}, {cfg.max_depth}")
    if cfg.lookup < 0 or cfg.measure < 0 or cfg.temperature < 0:
        raise ValueError(f"lookup, measure and temperature must be >= 0, got {cfg.lookup}, {cfg.measure}, {cfg.temperature}")
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    target = load_target(cfg.target, dtype=cfg.dtype)
    model = target.model
    kind, head, _ = load_head(cfg.head, model)
    encoded = [target.encode_chat(p) for p in load_prompts(cfg.prompts, cfg.limit)]
    prompts = [p for p in encoded if len(p) + cfg.max_new_tokens <= target.max_positions]
    if len(prompts) < len(encoded):
        print(f"[tune] {len(encoded) - len(prompts)} of {len(encoded)} prompts skipped: prompt + max_new_tokens "
              f"over the target's {target.max_positions} positions")
    if not prompts:
        raise ValueError(f"no prompt of {cfg.prompts} fits the target's context with max_new_tokens {cfg.max_new_tokens}")
    gen_cfg = GenerationConfig(max_new_tokens=cfg.max_new_tokens)
    budgets = [b for b in BUDGETS if b <= cfg.max_nodes]

    # 1. verification cost against tree size
    print(f"[tune] timing target forwards over 1..{budgets[-1] + 1} tree tokens after {cfg.context} cached tokens")
    verify = verify_latency(model, [b + 1 for b in budgets] + [1], cfg.context, cfg.reps, [t for p in prompts for t in p])
    # 2. the loop's own time per step, from plain greedy runs (Medusa's profile reads all of them)
    plain = [generate(model, p, None, gen_cfg, target.eos_token_ids) for p in (prompts if kind == "medusa" else prompts[:2])]
    other = sum(o.stats.other_s for o in plain) / max(1, sum(o.stats.steps for o in plain))

    def candidate(options: dict, nodes: int, tau: float, draft_s: float) -> dict:
        step_s = verify[nodes + 1] + draft_s + other
        return {"drafter_options": options, "nodes": nodes, "tau": tau, "verify_s": verify[nodes + 1],
                "draft_s": draft_s, "expected_tokens_per_s": tau / step_s}

    candidates = []
    if kind in ("eagle1", "eagle3"):
        from selfdraft.drafters.eagle import EagleDrafter

        for top_k in [int(x) for x in cfg.top_ks.split()]:
            # 3. acceptance profile with the largest tree of this branching factor
            recorder = ProfileRecorder(EagleDrafter(head, cfg.max_depth, top_k, cfg.max_nodes), cfg.max_nodes)
            for p in prompts:
                generate(model, p, recorder, gen_cfg, target.eos_token_ids)
            for depth in range(1, cfg.max_depth + 1):
                # 4. drafting cost of this (depth, top_k): the full expansion, and on its own each budget
                # small enough that the drafter skips nodes it could not keep (EagleDrafter.children)
                full_s = draft_latency(model, EagleDrafter(head, depth, top_k, cfg.max_nodes), prompts[0], cfg.reps)
                for b in budgets:
                    if b < depth or b > top_k + (depth - 1) * top_k * top_k:
                        continue  # fewer nodes than the depth, or more than this expansion generates
                    drafter = EagleDrafter(head, depth, top_k, b)
                    pruned = any(drafter.children(d) < top_k for d in range(depth))
                    draft_s = draft_latency(model, drafter, prompts[0], cfg.reps) if pruned else full_s
                    options = {"depth": depth, "top_k": top_k, "total_tokens": b}
                    candidates.append(candidate(options, b, tau_from_profile(recorder.steps, b, depth), draft_s))
            print(f"[tune] top_k {top_k}: {len(recorder.steps)} profiled steps")
    elif kind == "medusa":
        from selfdraft.drafters.medusa import MedusaDrafter

        sequences = [(p + o.tokens, len(p)) for p, o in zip(prompts, plain)]
        acc = medusa_rank_accuracy(model, head, sequences, width=8)
        ranked = medusa_best_paths(acc, cfg.max_nodes)
        for b in budgets:
            if b > len(ranked):
                continue
            paths = [list(p) for p, _ in ranked[:b]]
            tau = 1 + sum(v for _, v in ranked[:b])
            draft_s = draft_latency(model, MedusaDrafter(head, paths), prompts[0], cfg.reps)
            candidates.append(candidate({"paths": paths}, b, tau, draft_s))
    else:
        raise ValueError(f"selfdraft tune knows EAGLE and Medusa heads, not '{kind}'")
    if not candidates:
        raise ValueError("no tree budget fits max_nodes/max_depth; raise them")
    best = choose(candidates)
    plain_tps = 1.0 / (verify[1] + other)
    result = {
        "head_type": kind,
        "drafter_options": best["drafter_options"],
        "expected_tokens_per_s": best["expected_tokens_per_s"],
        "expected_tau": best["tau"],
        "expected_plain_tokens_per_s": plain_tps,
        "tuned_for": {"target": cfg.target, "dtype": cfg.dtype, "threads": torch.get_num_threads(),
                      "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                      **cpu_report(), "date": time.strftime("%Y-%m-%d")},
        "verify_latency_s": {str(k): v for k, v in sorted(verify.items())},
        "other_s_per_step": other,
        "config": asdict(cfg),
    }
    print(format_table(candidates, plain_tps))
    if cfg.lookup:
        result["lookup"] = tune_merged(model, head, kind, prompts, candidates, cfg, target.eos_token_ids)
        print(format_trials(f"head tree merged with lookup={cfg.lookup}", result["lookup"]))
    if cfg.temperature > 0:
        result["sampled"] = tune_sampled(model, head, kind, prompts, candidates, cfg, target.eos_token_ids)
        print(format_trials(f"head tree at temperature {cfg.temperature}", result["sampled"]))
    chosen = f"{best['nodes']} Medusa paths" if kind == "medusa" else str(best["drafter_options"])
    print(f"[tune] chosen: {chosen} -> expected tau {best['tau']:.2f}, {best['expected_tokens_per_s']:.1f} tok/s "
          f"(plain decoding {plain_tps:.1f} tok/s)")
    if best["expected_tokens_per_s"] < plain_tps:
        print(f"[tune] no tree is expected to beat plain decoding on this machine ({cpu_report()}); with auto_off "
              "(the default of generate, chat and bench) the engine decodes plainly while drafting measures slower")
    if cfg.lookup:
        merged = result["lookup"]
        print(f"[tune] chosen with lookup={cfg.lookup}: {merged['drafter_options']} -> measured tau {merged['measured_tau']:.2f}, "
              f"{merged['measured_tokens_per_s']:.1f} tok/s (plain {merged['reference']['plain']['tokens_per_s']:.1f}, "
              f"lookup alone {merged['reference']['prompt_lookup']['tokens_per_s']:.1f})")
        if beaten_by(merged, "prompt_lookup"):
            print(f"[tune] prompt lookup alone measured faster than every merged tree on these prompts: the head "
                  f"adds drafting and verification cost for tokens lookup already copies; on text like this, "
                  f"--drafter prompt_lookup:num_tokens={cfg.lookup} is the faster choice")
    if cfg.temperature > 0:
        sampled = result["sampled"]
        print(f"[tune] chosen at temperature {cfg.temperature}: {sampled['drafter_options']} -> measured tau "
              f"{sampled['measured_tau']:.2f}, {sampled['measured_tokens_per_s']:.1f} tok/s "
              f"(plain {sampled['reference']['plain']['tokens_per_s']:.1f})")
        if beaten_by(sampled, "plain"):
            print(f"[tune] at temperature {cfg.temperature} plain decoding measured faster than every head tree on "
                  "these prompts: the target's sampled text is too unpredictable for this head to pay; with auto_off "
                  "(the default) the engine decodes plainly while drafting measures slower")
    if cfg.save:
        path = write_text_atomic(Path(cfg.head) / TUNE_FILE, json.dumps(result, indent=2))
        print(f"[tune] saved to {path}; head:path={cfg.head} now drafts with it by default"
              + (f", head:path={cfg.head},lookup={cfg.lookup} with the merged choice" if cfg.lookup else "")
              + (", and with the sampled choice when generating at temperature > 0" if cfg.temperature > 0 else ""))
    if cfg.out:
        Path(cfg.out).write_text(json.dumps({**result, "candidates": candidates}, indent=2))
    return result


def format_table(candidates: list[dict], plain_tps: float, rows: int = 12) -> str:
    """The best candidates by expected tokens/s, plus the verification cost per size."""
    top = sorted(candidates, key=lambda c: -c["expected_tokens_per_s"])[:rows]
    lines = [f"{'nodes':>5} {'depth':>5} {'top_k':>5} {'tau':>5} {'verify ms':>9} {'draft ms':>8} {'exp tok/s':>9}"]
    for c in top:
        o = c["drafter_options"]
        lines.append(f"{c['nodes']:>5} {o.get('depth', len(max(o.get('paths', [[]]), key=len))):>5} "
                     f"{o.get('top_k', '-'):>5} {c['tau']:>5.2f} {1000 * c['verify_s']:>9.1f} "
                     f"{1000 * c['draft_s']:>8.1f} {c['expected_tokens_per_s']:>9.1f}")
    lines.append(f"(plain decoding, expected: {plain_tps:.1f} tok/s)")
    return "\n".join(lines)
