"""Schemas of the training programs in train/ (train.py, dump_features.py, distill.py).

They live in the library so the ``selfdraft`` command can show and check their options without
importing the programs; the programs themselves stay top-to-bottom scripts.
"""

from __future__ import annotations

from dataclasses import dataclass

from selfdraft.config import opt


@dataclass(frozen=True)
class TrainConfig:
    target: str = opt("smollm2", "target: alias, local folder, .gguf file or hub id")
    target_dtype: str = opt("float32", "dtype the frozen target runs in (bfloat16 halves memory; on CPUs without native bf16 its products run in fp32)")
    head: str = opt("medusa", "head type: medusa (Medusa-1), medusa2 (joint with LoRA), eagle1 or eagle3")
    num_heads: int = opt(4, "medusa: number of heads (draft depth)")
    num_layers: int = opt(1, "medusa: residual blocks per head")
    share_lm_head: bool = opt(True, "medusa: project with the target's lm_head instead of per-head copies")
    data: str = opt("sharegpt", "'sharegpt' (the shipped ShareGPT V3), a JSON/JSONL file or folder, or a hub id")
    max_samples: int = opt(2000, "conversations to use (0 = all)")
    extra_data: str = opt("", "more training text, as written: 'sharegpt' or a file/folder like data, whose first exchanges "
                          "(those not opened by a prompt in data) are added to data's training samples; the target labels "
                          "them as it does data. Cheaper than distilled replies: no generation, only the feature dump")
    extra_samples: int = opt(0, "how many extra_data first exchanges to add (0 = none)")
    eval_samples: int = opt(32, "held-out conversations for eval loss/accuracy")
    max_len: int = opt(512, "tokens per sample: longer ones are truncated (the first max_len kept)")
    batch_size: int = opt(4, "samples per micro-batch per process")
    grad_accum: int = opt(1, "micro-batches per optimizer step")
    lr: float = opt(1e-3, "peak learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    warmup_steps: int = opt(20, "linear warmup steps")
    max_steps: int = opt(200, "optimizer steps")
    max_minutes: float = opt(0.0, "stop after the step that reaches this many minutes of training (0 = no limit); the "
                             "learning-rate schedule then ends at whichever of max_steps and max_minutes comes first")
    clip: float = opt(1.0, "gradient-norm clipping (0 = off)")
    loss_decay: float = opt(0.8, "weight of medusa head k / eagle3 unrolled step k is loss_decay**k")
    draft_vocab_size: int = opt(8192, "eagle3: reduced draft vocabulary (most frequent trained tokens)")
    ttt_steps: int = opt(7, "eagle3: training-time-test unrolled steps")
    lora_rank: int = opt(8, "medusa2: LoRA rank")
    lora_alpha: int = opt(16, "medusa2: LoRA alpha")
    lora_dropout: float = opt(0.05, "medusa2: LoRA dropout")
    lora_modules: str = opt("q_proj k_proj v_proj o_proj", "medusa2: target modules that get adapters (space-separated)")
    lm_weight: float = opt(1.0, "medusa2: weight of the backbone LM loss next to the head losses")
    merge_adapter: bool = opt(True, "medusa2: also save the target with the adapter merged (out_dir/target)")
    feature_weight: float = opt(1.0, "eagle1: weight of the smooth-L1 feature regression loss")
    token_weight: float = opt(0.1, "eagle1: weight of the soft cross-entropy token loss")
    feature_noise: float = opt(0.2, "eagle1: width of uniform noise added to input features (0 = off)")
    mixed_precision: str = opt("no", "accelerate mixed precision: no, bf16, fp16, or auto (bf16 where the device has "
                                     "native bf16 matmuls, else no: a CPU without them runs bf16 products ~5x slower)")
    log_every: int = opt(10, "steps between metric logs")
    eval_every: int = opt(100, "steps between evals (0 = only at the end)")
    eval_tau_prompts: int = opt(4, "held-out prompts the saved head drafts for through the engine at each eval (0 = off)")
    eval_tau_tokens: int = opt(64, "new tokens per real-tau eval prompt")
    save_every: int = opt(100, "steps between checkpoints (0 = only at the end)")
    out_dir: str = opt("runs/medusa", "run folder: checkpoints/, head/ (the result), wandb/")
    report_to: str = opt("wandb", "wandb or none")
    wandb_project: str = opt("selfdraft", "W&B project name")
    seed: int = opt(0, "seed for init and data order")
    resume: bool = opt(False, "continue from the last checkpoint in out_dir")
    init_head: str = opt("", "start from this head folder (continued training or fine-tuning on new data); fresh optimizer and schedule")
    features_dir: str = opt("", "offline target features (train/dump_features.py writes them): train from disk, target layers not in memory")
    features_dtype: str = opt("bfloat16", "dump_features: dtype of the stored hidden states (float32 for exact parity)")
    features_budget_gb: float = opt(100.0, "dump_features: refuse to write more than this many GB")
    features_per_shard: int = opt(64, "dump_features: samples per shard file")

    def __post_init__(self) -> None:
        choices = {"head": ("medusa", "medusa2", "eagle1", "eagle3"), "report_to": ("wandb", "none"),
                   "mixed_precision": ("no", "bf16", "fp16", "auto"), "features_dtype": ("float32", "bfloat16", "float16")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown {name} '{getattr(self, name)}'; choose one of {', '.join(allowed)}")
        if self.max_steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("max_steps, batch_size and grad_accum must be >= 1")
        if not self.max_minutes >= 0:
            raise ValueError(f"max_minutes must be >= 0 (0 = no time limit), got {self.max_minutes}")
        if self.extra_samples < 0 or (self.extra_samples and not self.extra_data):
            raise ValueError("extra_samples must be >= 0, and > 0 only with extra_data set (e.g. extra_data=sharegpt)")


@dataclass(frozen=True)
class DistillConfig:
    target: str = opt("smollm2", "target: alias, local folder, .gguf file or hub id")
    dtype: str = opt("bfloat16", "target dtype (bfloat16 decodes faster on CPUs; float32 is exact)")
    data: str = opt("sharegpt", "'sharegpt' (the shipped ShareGPT V3), a JSON/JSONL file or folder, or a hub id")
    max_samples: int = opt(1000, "conversations to regenerate (0 = all)")
    turns: str = opt("all", "'all' assistant turns, or 'first' (keep only the first exchange)")
    max_new_tokens: int = opt(256, "new tokens per regenerated assistant turn")
    temperature: float = opt(0.0, "0 = greedy; > 0 samples from the target (lossless through the engine)")
    drafter: str = opt("prompt_lookup", "drafter that speeds regeneration up (NAME[:k=v,...], head:path=DIR, or none)")
    out: str = opt("runs/distill/distilled.jsonl", "output JSONL (resumed if it exists)")
    seed: int = opt(0, "sampling seed (per conversation: seed + index)")
    threads: int = opt(0, "torch threads (0 = number of cores)")
    batch_size: int = opt(1, "replies generated together with continuous batching (1 = one at a time through the drafter)")
    max_prompt_tokens: int = opt(0, "skip a turn (and the rest of its conversation) whose prompt is longer than this (0 = up to the context)")
