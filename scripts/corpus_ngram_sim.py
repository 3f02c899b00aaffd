"""Offline model: does a corpus n-gram drafter (SuffixDecoding-style) add to prompt lookup, and how
long should lookup's drafts be?

Replays the target's own greedy replies step by step, as the decode loop would verify them: each
step drafts with prompt lookup (the engine's ``PromptLookupDrafter``: 3..2-grams, 10 tokens, fixed or
with its adaptive length and periodic loops) and/or a chain from an n-gram table of other replies
(``selfdraft.drafters.suffix.NgramTable``, as the ``suffix`` drafter drafts: the longest matching
context of up to ``--max-ngram`` tokens, its most frequent next token while that token's share is at
least min_prob), accepts the longest agreeing prefix, and charges the verification of the merged
draft at the measured cost of a lean forward of that many tokens (``scripts/forward_routes.py``
JSON). The table grows with the replies already replayed (as a server's cache of finished requests
would) and can be seeded with a corpus of the target's replies (``selfdraft distill`` output). Greedy
only, no speculation gate; no model runs except to produce the replies:

    python scripts/corpus_ngram_sim.py --target smollm2 --prompts mtbench sharegpt-heldout --limit 80 \\
        --corpus runs/distill/sharegpt_smollm2_first.jsonl \\
        --costs docs/results/s25_forward_routes_smollm2.json --out docs/results/s26_corpus_ngram_sim.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from selfdraft.benchmark import load_conversations
from selfdraft.drafters.base import StepResult
from selfdraft.drafters.prompt_lookup import PromptLookupDrafter
from selfdraft.drafters.suffix import NgramTable, corpus_replies
from selfdraft.generate import GenerationConfig, generate
from selfdraft.sampling import SamplingConfig
from selfdraft.stats import common_prefix
from selfdraft.target import load_target

STEP_OVERHEAD_MS = 0.4  # the decode loop's own time per step (other% of the 80-question runs)


def forward_cost(costs: dict[int, float], n: int) -> float:
    """ms for a forward of n tokens, interpolated between the measured sizes."""
    sizes = sorted(costs)
    if n >= sizes[-1]:
        return costs[sizes[-1]] * n / sizes[-1]
    lo = max(s for s in sizes if s <= n)
    hi = min(s for s in sizes if s >= n)
    return costs[lo] if lo == hi else costs[lo] + (costs[hi] - costs[lo]) * (n - lo) / (hi - lo)


def replay(rows: list[dict], table: NgramTable | None, lookup: PromptLookupDrafter | None, costs: dict[int, float],
           length: int, min_ngram: int, min_prob: float) -> dict:
    greedy = SamplingConfig(temperature=0.0)
    tokens = steps = drafted = 0
    ms = 0.0
    for row in rows:
        prompt, out = row["prompt"], row["output"]
        seq = torch.tensor(prompt + out)
        if lookup is not None:
            lookup.reset(StepResult(seq[: len(prompt)], 0))
        i = 0
        while i < len(out):
            context = prompt + out[:i]
            drafts = []
            if lookup is not None:
                drafts.append(lookup.propose(seq[: len(context)], greedy, None).tokens[1:].tolist())  # one candidate: a chain
            if table is not None:
                drafts.append(table.chain(context, length, min_ngram, min_prob))
            drafts = [d for d in drafts if d]
            nodes = {tuple(d[: j + 1]) for d in drafts for j in range(len(d))}  # the merged trie
            a = max((common_prefix(d, out[i:]) for d in drafts), default=0)
            ms += forward_cost(costs, 1 + len(nodes)) + STEP_OVERHEAD_MS
            steps += 1
            drafted += bool(drafts)
            step = min(a + 1, len(out) - i)
            tokens += step
            i += step
            if lookup is not None:
                lookup.update(StepResult(seq[: len(prompt) + i], a))
        if table is not None:
            table.add(out)  # a finished reply joins the table
    return {"tau": tokens / steps, "drafted": drafted / steps, "model_tok_s": 1000 * tokens / ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--prompts", nargs="+", default=["mtbench", "sharegpt-heldout"])
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--corpus", default="", help="selfdraft distill JSONL of the target's replies (seed)")
    ap.add_argument("--costs", required=True, help="scripts/forward_routes.py JSON (its 'lean' medians)")
    ap.add_argument("--max-ngram", type=int, default=6)
    ap.add_argument("--replies", default="", help="cache of the greedy replies (written when missing)")
    ap.add_argument("--lookup-variants", choices=["one", "both"], default="both",
                    help="one: lookup with a fixed 10-token draft (the twenty-sixth session's model); both: also adaptive + periodic")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    costs = {int(k): 1000 * v for k, v in json.loads(Path(args.costs).read_text())["median_s"]["lean"].items()}
    target = load_target(args.target, dtype="bfloat16")
    cache = Path(args.replies) if args.replies else None
    if cache is not None and cache.is_file():
        replies = json.loads(cache.read_text())
    else:
        replies = {}
        for spec in args.prompts:
            rows = []
            for conv in load_conversations(spec, args.limit, "first"):
                ids = target.encode_chat(conv.messages([]))
                gen = generate(target.model, ids, None, GenerationConfig(max_new_tokens=args.max_new_tokens),
                               eos_token_ids=target.eos_token_ids)
                rows.append({"prompt": ids, "output": gen.tokens})
            replies[spec] = rows
        if cache is not None:
            cache.write_text(json.dumps(replies))
    tokenize = target.tokenizer.encode
    seed = [tokenize(t, add_special_tokens=False) for t in corpus_replies(args.corpus)] if args.corpus else []
    settings = [("lookup", False, 0, 0), ("lookup + table", True, 1, 0.3), ("lookup + table", True, 2, 0.4)]
    lookups = {"fixed 10": dict(adaptive=False, periodic=False), "adaptive, periodic": dict(adaptive=True, periodic=True)}
    if args.lookup_variants == "one":
        lookups = {"fixed 10": lookups["fixed 10"]}
    results = []
    print(f"seed corpus: {len(seed)} replies, {sum(map(len, seed))} tokens")
    print(f"{'prompts':18} {'drafter':24} {'lookup':20} {'min_ngram':>9} {'min_prob':>8} {'tau':>6} {'drafted':>8} {'model tok/s':>11}")
    for spec, rows in replies.items():
        for seeded in ([False, True] if seed else [False]):
            for name, use_table, min_ngram, min_prob in settings:
                if not use_table and seeded:
                    continue
                for lookup_name, lookup_options in lookups.items():
                    table = None
                    if use_table:
                        table = NgramTable(args.max_ngram)
                        for s in seed if seeded else []:
                            table.add(s)
                    r = replay(rows, table, PromptLookupDrafter(num_tokens=10, **lookup_options), costs, 3, max(min_ngram, 1), min_prob)
                    label = name + (" (seeded)" if seeded else "")
                    results.append({"prompts": spec, "drafter": label, "lookup": lookup_name, "min_ngram": min_ngram,
                                    "min_prob": min_prob, **r})
                    print(f"{spec:18} {label:24} {lookup_name:20} {min_ngram:>9} {min_prob:>8} {r['tau']:6.3f} {r['drafted']:8.0%} "
                          f"{r['model_tok_s']:11.1f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
