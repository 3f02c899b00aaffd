"""Self-distillation: regenerate the assistant turns of a conversation set with the target itself.

    python train/distill.py data=sharegpt max_samples=2000 out=runs/distill/sharegpt_smollm2.jsonl
    python train/train.py configs/train/smollm2_eagle3.yaml data=runs/distill/sharegpt_smollm2.jsonl

Heads trained on the target's own replies learn what the target will say, not what another model
said (the training signal Medusa-2 and EAGLE recommend). Each assistant turn is regenerated from the
human turns and the target's own earlier replies, through this project's speculative engine (prompt
lookup by default, or a trained head: identical greedy text, fewer target forwards). A base model
(no chat template) continues the plain-text rendering of the conversation, and its continuation
becomes the assistant turn (``selfdraft.data.reply_content``).

Output: ShareGPT JSONL (``{"id", "conversations": [{"from", "value"}]}``), one line per conversation,
flushed after each chunk of conversations. Rerunning with the same ``out`` resumes: ids already
written are skipped (a line cut by a crash is dropped and redone).

``batch_size > 1`` regenerates with continuous batching (one batched target forward per step). Greedy
replies are the target's argmax either way (bit-identical in fp32; in bf16 a padded batched forward
may round differently). Sampled replies (temperature > 0) in batch mode share one generator per
round: reproducible for the same batch_size and data, not equal to the batch_size=1 samples.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from selfdraft.batch import TreePolicy, generate_batch
from selfdraft.config import load
from selfdraft.data import data_source, has_chat_template, json_lines, load_conversations, reply_content
from selfdraft.drafters import drafter_factory
from selfdraft.generate import GenerationConfig, generate
from selfdraft.progress import quiet
from selfdraft.sampling import SamplingConfig
from selfdraft.target import load_target
from selfdraft.train_config import DistillConfig

ROLE_OUT = {"user": "human", "assistant": "gpt", "system": "system"}


def completed_ids(path: Path) -> set[int]:
    """Ids already written; a trailing partial line (a crash mid-write) is cut off the file."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
        print(f"[distill] dropped a partial last line of {len(data) - keep} bytes (interrupted write)")
    return {json.loads(line)["id"] for _, line in json_lines(data[:keep].decode("utf-8"))}


def regenerate(target, conversations: list[list[dict]], ids: list[int], make_drafter, gen_cfg: GenerationConfig,
               cfg: DistillConfig, totals: dict[str, int], chat: bool) -> list[list[dict]]:
    """Regenerate the assistant turns of several conversations, turn by turn; returns their new histories.

    ``chat``: the target renders prompts with a chat template (else its replies are plain-text
    continuations). Round k regenerates the k-th assistant turn of every conversation that still
    has one (and whose prompt fits the context), from its human turns and the target's own earlier replies. With
    ``cfg.batch_size`` > 1 a round runs through continuous batching (one batched target forward per
    step); otherwise each reply is one speculative ``generate`` call. Greedy replies are the same
    either way: both decode the target's own argmax.
    """
    histories: list[list[dict]] = [[] for _ in conversations]
    cursors = [0] * len(conversations)  # next message to read per conversation
    active = list(range(len(conversations)))
    while active:
        asks: list[tuple[int, list[int]]] = []
        for c in active:
            messages, history = conversations[c], histories[c]
            while cursors[c] < len(messages) and messages[cursors[c]]["role"] != "assistant":
                history.append(messages[cursors[c]])
                cursors[c] += 1
            if cursors[c] >= len(messages):
                continue  # no assistant turn left
            prompt = target.encode_chat(history)
            if len(prompt) >= target.max_positions or (cfg.max_prompt_tokens and len(prompt) > cfg.max_prompt_tokens):
                continue  # the rest of this conversation does not fit (the context, or the prompt limit)
            asks.append((c, prompt))
        replies: list[tuple[list[int], object]] = []
        if cfg.batch_size > 1 and asks:
            results = generate_batch(target.model, [p for _, p in asks], make_drafter, replace(gen_cfg, seed=cfg.seed + ids[asks[0][0]]),
                                     target.eos_token_ids, target.tokenizer, batch_size=cfg.batch_size,
                                     policy=TreePolicy(auto_off=True))
            for (c, _), res in zip(asks, results):
                if not res.ok:
                    raise RuntimeError(f"conversation {ids[c]}: {res.error}")
                replies.append((res.tokens, res.stats))
        else:
            for c, prompt in asks:
                res = generate(target.model, prompt, make_drafter() if make_drafter else None,
                               replace(gen_cfg, seed=cfg.seed + ids[c]), target.eos_token_ids, target.tokenizer)
                replies.append((res.tokens, res.stats))
        for (c, _), (tokens, stats) in zip(asks, replies):
            totals["steps"] += stats.steps
            totals["accepted"] += stats.accepted
            totals["new_tokens"] += stats.new_tokens
            text = target.tokenizer.decode(tokens, skip_special_tokens=True)
            histories[c].append({"role": "assistant", "content": reply_content(text, chat)})
            cursors[c] += 1  # past the assistant turn just regenerated
        active = [c for c, _ in asks if cfg.turns == "all"]
    return histories


def main(cfg: DistillConfig) -> Path:
    from selfdraft.benchmark import parse_decoder

    if cfg.turns not in ("all", "first"):
        raise ValueError(f"turns must be 'all' or 'first', got '{cfg.turns}'")
    if cfg.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {cfg.batch_size}")
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    target = load_target(cfg.target, dtype=cfg.dtype)
    chat = has_chat_template(target.tokenizer)
    print(f"[distill] prompts rendered with {'the chat template' if chat else 'plain text (no chat template): replies are continuations'}")
    source = data_source(cfg.data)
    conversations, report = load_conversations(source, limit=cfg.max_samples or None)
    print(f"[distill] {source}: {report.describe()}")
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = completed_ids(out)
    gen_cfg = GenerationConfig(max_new_tokens=cfg.max_new_tokens, sampling=SamplingConfig(cfg.temperature),
                               on_context_overflow="truncate")
    name, options = parse_decoder(cfg.drafter) if cfg.drafter != "none" else (None, {})
    make_drafter = drafter_factory(name, target.model, cfg.temperature, **options) if name else None  # head folder read once
    todo = [(idx, messages) for idx, messages in enumerate(conversations) if idx not in done]
    # conversations regenerated together (turn by turn) before they are written: one at a time
    # without batching (a crash loses at most one), four batches' worth with it (slots stay full)
    chunk = 1 if cfg.batch_size == 1 else cfg.batch_size * 4
    totals = {"steps": 0, "accepted": 0, "new_tokens": 0}
    skipped = 0
    t0 = time.perf_counter()
    with open(out, "a") as f, tqdm(total=len(conversations), initial=len(done), desc="distill", disable=quiet(),
                                  unit="conv", file=sys.stderr) as bar:
        for start in range(0, len(todo), chunk):
            part = todo[start : start + chunk]
            histories = regenerate(target, [m for _, m in part], [idx for idx, _ in part], make_drafter,
                                   gen_cfg, cfg, totals, chat)
            for (idx, _), history in zip(part, histories):
                if not any(m["role"] == "assistant" for m in history):
                    skipped += 1
                    continue
                record = {"id": idx, "conversations": [{"from": ROLE_OUT[m["role"]], "value": m["content"]} for m in history]}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()  # a crash mid-chunk leaves whole lines (resume skips their ids) and maybe a partial last one (dropped)
            bar.update(len(part))
    steps, accepted, new_tokens = totals["steps"], totals["accepted"], totals["new_tokens"]
    wall = time.perf_counter() - t0
    print(f"[distill] wrote {out}: {new_tokens} new tokens in {wall:.0f}s ({new_tokens / max(wall, 1e-9):.1f} tok/s), "
          f"tau {(steps + accepted) / max(steps, 1):.2f} with drafter {cfg.drafter}; {skipped} conversations skipped (first prompt over the context or max_prompt_tokens)")
    return out


if __name__ == "__main__":
    argv = sys.argv[1:]
    path = argv.pop(0) if argv and "=" not in argv[0] else None
    main(load(DistillConfig, path, argv))
