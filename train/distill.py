"""Self-distillation: regenerate the assistant turns of a conversation set with the target itself.

    python train/distill.py data=sharegpt max_samples=2000 out=runs/distill/sharegpt_smollm2.jsonl
    python train/train.py configs/train/smollm2_eagle3.yaml data=runs/distill/sharegpt_smollm2.jsonl

Heads trained on the target's own replies learn what the target will say, not what another model
said (the training signal Medusa-2 and EAGLE recommend). Each assistant turn is regenerated from the
human turns and the target's own earlier replies, through this project's speculative engine (prompt
lookup by default, or a trained head: identical greedy text, fewer target forwards).

Output: ShareGPT JSONL (``{"id", "conversations": [{"from", "value"}]}``), one line per conversation,
flushed as it is written. Rerunning with the same ``out`` resumes after the last complete line (a
line cut by a crash is dropped and redone).
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

from selfdraft.config import load
from selfdraft.data import load_conversations, sharegpt_path
from selfdraft.drafters import build_drafter
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
    return {json.loads(line)["id"] for line in data[:keep].decode().splitlines() if line.strip()}


def main(cfg: DistillConfig) -> Path:
    from selfdraft.benchmark import parse_decoder

    if cfg.turns not in ("all", "first"):
        raise ValueError(f"turns must be 'all' or 'first', got '{cfg.turns}'")
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    target = load_target(cfg.target, dtype=cfg.dtype)
    if not getattr(target.tokenizer, "chat_template", None):
        raise ValueError(f"{cfg.target} has no chat template: self-distillation needs a chat model")
    source = sharegpt_path() if cfg.data == "sharegpt" else cfg.data
    conversations, report = load_conversations(source, limit=cfg.max_samples or None)
    print(f"[distill] {source}: {report.describe()}")
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = completed_ids(out)
    gen_cfg = GenerationConfig(max_new_tokens=cfg.max_new_tokens, sampling=SamplingConfig(cfg.temperature),
                               on_context_overflow="truncate")
    max_pos = int(getattr(target.model.config, "max_position_embeddings", 1 << 20))
    steps = accepted = new_tokens = skipped = 0
    t0 = time.perf_counter()
    with open(out, "a") as f, tqdm(total=len(conversations), initial=len(done), desc="distill", disable=quiet(),
                                  unit="conv", file=sys.stderr) as bar:
        for idx, messages in enumerate(conversations):
            if idx in done:
                continue
            history: list[dict] = []
            for m in messages:
                if m["role"] != "assistant":
                    history.append(m)
                    continue
                prompt = target.encode_chat(history)
                if len(prompt) >= max_pos:
                    break  # the rest of this conversation does not fit in the context
                drafter = None
                if cfg.drafter != "none":
                    name, options = parse_decoder(cfg.drafter)
                    drafter = build_drafter(name, target.model, **options)
                res = generate(target.model, prompt, drafter, replace(gen_cfg, seed=cfg.seed + idx),
                               target.eos_token_ids, target.tokenizer)
                steps += res.stats.steps
                accepted += res.stats.accepted
                new_tokens += res.stats.new_tokens
                history.append({"role": "assistant", "content": target.tokenizer.decode(res.tokens, skip_special_tokens=True).strip()})
                if cfg.turns == "first":
                    break
            if not any(m["role"] == "assistant" for m in history):
                skipped += 1
            else:
                record = {"id": idx, "conversations": [{"from": ROLE_OUT[m["role"]], "value": m["content"]} for m in history]}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                f.flush()
            bar.update(1)
    wall = time.perf_counter() - t0
    print(f"[distill] wrote {out}: {new_tokens} new tokens in {wall:.0f}s ({new_tokens / max(wall, 1e-9):.1f} tok/s), "
          f"tau {(steps + accepted) / max(steps, 1):.2f} with drafter {cfg.drafter}; {skipped} conversations did not fit the context")
    return out


if __name__ == "__main__":
    argv = sys.argv[1:]
    path = argv.pop(0) if argv and "=" not in argv[0] else None
    main(load(DistillConfig, path, argv))
