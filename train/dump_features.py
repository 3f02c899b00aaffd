"""Write a training run's target features to disk, so training can run without the target's layers.

    python train/dump_features.py configs/train/smollm2_eagle3.yaml features_dir=runs/feats/eagle3
    python train/train.py configs/train/smollm2_eagle3.yaml features_dir=runs/feats/eagle3

Takes the same config as train/train.py (same data, same samples in the same order, the hidden
states the configured head needs), prints the disk size before writing and refuses past
``features_budget_gb``. Shards are written atomically; rerunning resumes an interrupted dump, and
after samples are appended to the data (a longer distillation) it writes only the shards that changed.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm import tqdm

from selfdraft.config import load
from selfdraft.features import estimate_bytes, write_features
from selfdraft.heads.artifact import target_info
from selfdraft.heads.eagle3 import Eagle3Config
from selfdraft.progress import quiet
from selfdraft.target import load_target

_spec = importlib.util.spec_from_file_location("train_main", Path(__file__).with_name("train.py"))
train = importlib.util.module_from_spec(_spec)
sys.modules["train_main"] = train
_spec.loader.exec_module(train)


def main(cfg: train.TrainConfig) -> Path:
    if not cfg.features_dir:
        raise ValueError("set features_dir=FOLDER: where the features go")
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    target = load_target(cfg.target, dtype=cfg.target_dtype, device=str(accelerator.device))
    model, tokenizer = target.model, target.tokenizer
    train_samples, eval_samples = train.build_samples(cfg, tokenizer, accelerator)
    samples = eval_samples + train_samples  # the order train.py splits them back in
    indices = tuple(Eagle3Config.for_target(model, cfg.draft_vocab_size).feature_layers) if cfg.head == "eagle3" else ()
    states = len(set(indices) | {-1})
    size = estimate_bytes(samples, model.config.hidden_size, states, cfg.features_dtype)
    print(f"[features] {len(samples)} samples, {sum(len(s.input_ids) for s in samples)} tokens x {states} states x "
          f"{model.config.hidden_size} in {cfg.features_dtype}: about {size / 1e9:.2f} GB to {cfg.features_dir}")
    if size > cfg.features_budget_gb * 1e9:
        raise ValueError(f"the dump needs about {size / 1e9:.1f} GB, over features_budget_gb={cfg.features_budget_gb}; "
                         "lower max_samples or max_len, use features_dtype=bfloat16, or raise the budget")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    t0 = time.perf_counter()
    with tqdm(total=len(samples), desc="features", unit="sample", file=sys.stderr, disable=quiet()) as bar:
        folder = write_features(cfg.features_dir, model, samples, indices, target_info(model, cfg.target),
                                cfg.features_dtype, cfg.features_per_shard, cfg.batch_size, pad_id, bar)
    print(f"[features] done in {time.perf_counter() - t0:.0f}s: {folder}")
    return folder


if __name__ == "__main__":
    argv = sys.argv[1:]
    path = argv.pop(0) if argv and "=" not in argv[0] else None
    main(load(train.TrainConfig, path, argv))
