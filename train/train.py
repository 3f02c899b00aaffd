"""Train a draft head on a frozen target.

    accelerate launch train/train.py configs/train/smollm2_medusa.yaml [key=value ...]
    python train/train.py configs/train/smollm2_medusa.yaml max_steps=50     (one process)

The loop is plain PyTorch + accelerate: the frozen target runs under no_grad to produce features,
only head parameters reach the optimizer; bf16 autocast, gradient accumulation, clipping, warmup +
cosine schedule, held-out eval, W&B logging (offline unless WANDB_MODE says otherwise), atomic
checkpoints and exact resume (same data order, optimizer, scheduler and RNG state).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm import tqdm

from selfdraft.config import load
from selfdraft.data import (
    EXTRA_MAX_PROMPT_CHARS,
    collate,
    data_source,
    first_exchanges,
    has_chat_template,
    load_conversations,
    prepare_samples,
)
from selfdraft.features import FeatureStore, target_features
from selfdraft.generate import GenerationConfig, generate
from selfdraft.heads import build_head, head_type, load_head, save
from selfdraft.heads.artifact import (
    fingerprint,
    read_head,
    replace_dir,
    save_head,
    target_info,
    weights_digest,
    weights_fingerprint,
)
from selfdraft.heads.eagle1 import Eagle1Config, next_rows, trained_positions
from selfdraft.heads.eagle3 import Eagle3Config, select_draft_vocab
from selfdraft.heads.medusa import MedusaConfig, medusa_loss
from selfdraft.heads.medusa2 import Medusa2, attach_lora
from selfdraft.kernels import matmul_mode, native_bf16_matmul, resolve_mixed_precision
from selfdraft.progress import quiet
from selfdraft.target import load_target
from selfdraft.train_config import TrainConfig


def build_samples(cfg: TrainConfig, tokenizer, accelerator: Accelerator):
    """(train, eval) samples: eval the first ``eval_samples`` of ``data``; ``extra_data``'s first exchanges train only."""
    source = data_source(cfg.data)
    limit = cfg.max_samples + cfg.eval_samples if cfg.max_samples else None  # max_samples 0 = all
    conversations, report = load_conversations(source, limit=limit)
    accelerator.print(f"[data] {source}: {report.describe()}")
    samples = tokenized(cfg, tokenizer, conversations, accelerator)
    if len(samples) <= cfg.eval_samples:
        raise ValueError(f"only {len(samples)} usable samples; need more than eval_samples={cfg.eval_samples}")
    if cfg.extra_samples:
        extra_source = data_source(cfg.extra_data)
        pool, _ = load_conversations(extra_source)
        extra = first_exchanges(pool, cfg.extra_samples, conversations, EXTRA_MAX_PROMPT_CHARS)
        accelerator.print(f"[data] {extra_source}: {len(extra)} first exchanges added as written (asked for {cfg.extra_samples}; "
                          f"prompts already in {source} or over {EXTRA_MAX_PROMPT_CHARS} characters skipped)")
        samples = samples + tokenized(cfg, tokenizer, extra, accelerator)
    return samples[cfg.eval_samples :], samples[: cfg.eval_samples]


def tokenized(cfg: TrainConfig, tokenizer, conversations: list, accelerator: Accelerator) -> list:
    bar = tqdm(conversations, desc="tokenise", unit="conv", file=sys.stderr, disable=quiet() or not accelerator.is_main_process)
    samples, counts = prepare_samples(tokenizer, bar, cfg.max_len)
    rendering = "the chat template" if has_chat_template(tokenizer) else "plain text (no chat template)"
    accelerator.print(f"[data] tokenised with {rendering}, max_len {cfg.max_len}: {dict(counts)}")
    return samples


def batch_order(n: int, batch: int, seed: int, rank: int, world: int):
    """Endless, deterministic stream of sample-index batches for this rank (reshuffled each epoch)."""
    epoch = 0
    while True:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        per_step = batch * world
        for start in range(0, n - per_step + 1, per_step):
            chunk = perm[start : start + per_step]
            yield chunk[rank * batch : (rank + 1) * batch]
        epoch += 1


def init_head(cfg: TrainConfig, model: torch.nn.Module) -> tuple[object, torch.nn.Module]:
    """The head config and weights of ``cfg.init_head`` (continued training), checked against ``cfg.head`` and the target.

    The saved config wins over the fresh-head options (sizes, EAGLE-3 feature layers and draft
    vocabulary); the optimizer and schedule start afresh (``resume`` is for an interrupted run).
    """
    meta, tensors = read_head(cfg.init_head)
    kind, want = meta.get("head_type"), "medusa" if cfg.head == "medusa2" else cfg.head
    if kind != want:
        raise ValueError(f"init_head {cfg.init_head} holds a '{kind}' head, but head={cfg.head} trains '{want}' heads")
    if "medusa2" in meta:
        raise ValueError(f"init_head {cfg.init_head} is a Medusa-2 head tied to its own merged target; start from a Medusa-1 head")
    _, head_cfg, head = build_head(meta, tensors, model, cfg.init_head)
    print(f"[head] starting from {cfg.init_head} ({kind})")
    if cfg.head == "medusa2":
        backbone = attach_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_modules.split())
        return head_cfg, Medusa2(backbone, head)
    return head_cfg, head


def make_head(cfg: TrainConfig, model: torch.nn.Module, samples: list) -> tuple[object, torch.nn.Module]:
    """The head config and a fresh head for ``cfg.head`` (or the one ``cfg.init_head`` holds)."""
    if cfg.init_head:
        return init_head(cfg, model)
    c = model.config
    if cfg.head == "medusa":
        head_cfg = MedusaConfig(c.hidden_size, c.vocab_size, cfg.num_heads, cfg.num_layers, cfg.share_lm_head)
        return head_cfg, head_type("medusa").build(head_cfg, model)
    if cfg.head == "medusa2":
        head_cfg = MedusaConfig(c.hidden_size, c.vocab_size, cfg.num_heads, cfg.num_layers, cfg.share_lm_head)
        heads = head_type("medusa").build(head_cfg, model)
        backbone = attach_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_modules.split())
        return head_cfg, Medusa2(backbone, heads)
    if cfg.head == "eagle1":
        head_cfg = Eagle1Config.for_target(model)
        return head_cfg, head_type("eagle1").build(head_cfg, model)
    if cfg.head == "eagle3":
        head_cfg = Eagle3Config.for_target(model, cfg.draft_vocab_size)
        head = head_type("eagle3").build(head_cfg, model)
        counts = torch.zeros(c.vocab_size, dtype=torch.long)
        for s in samples:
            ids = torch.tensor(s.input_ids)[torch.tensor(s.loss_mask).bool()]
            counts += torch.bincount(ids, minlength=c.vocab_size)
        head.set_draft_vocab(select_draft_vocab(counts, head_cfg.draft_vocab_size))
        covered = counts[head.draft_ids.cpu()].sum().item() / max(1, counts.sum().item())
        print(f"[head] eagle3 draft vocabulary {head_cfg.draft_vocab_size} ids cover {100 * covered:.1f}% of trained tokens")
        return head_cfg, head
    raise KeyError(f"unknown head '{cfg.head}'; train.py supports medusa, medusa2, eagle1 and eagle3")


def feature_indices(cfg: TrainConfig, head: torch.nn.Module) -> tuple[int, ...]:
    """Target hidden-state indices the head trains on (-1 = final normed state, always included)."""
    module = head.module if hasattr(head, "module") else head
    return tuple(module.cfg.feature_layers) if cfg.head == "eagle3" else (-1,)


def stored(store: FeatureStore, ids: list[int], batch: dict, device: torch.device | str = "cpu") -> dict:
    """Stored features of dump samples ``ids``, padded like ``batch``."""
    return {i: t.to(device) for i, t in store.batch_features(ids, batch["input_ids"].shape[1]).items()}


def head_loss(cfg: TrainConfig, head, target, batch, feats: dict | None = None) -> tuple[torch.Tensor, dict]:
    """The head's loss on one batch. ``feats``: stored target features (offline); None runs the target."""
    ids, attn, lmask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    if cfg.head == "medusa2":  # gradients flow through the target's adapters: no stored features
        loss, losses, accs = head(ids, attn, lmask, cfg.loss_decay, cfg.lm_weight)
        return loss, metrics_of(losses, accs)
    lm_head = target.get_output_embeddings()
    if feats is None:
        feats = target_features(target, ids, attn, feature_indices(cfg, head))
    last = feats[-1]
    if cfg.head == "medusa":
        dtype = next(head.parameters()).dtype  # fp32 heads on a bf16 target without autocast
        loss, losses, accs = medusa_loss(head, last.to(dtype), ids, lmask, cfg.loss_decay)
    else:
        # the target's logits from its (shared, frozen) lm_head, in fp32 where bf16 products are slow
        with torch.no_grad(), matmul_mode(lm_head.weight.dtype, lm_head.weight.device, ids.numel()):
            if cfg.head == "eagle3":  # only the draft vocabulary's rows: the loss reads nothing else
                rows = lm_head.weight[(head.module if hasattr(head, "module") else head).draft_ids]
                logits = torch.nn.functional.linear(last.to(rows.dtype), rows)
            else:  # eagle1: the rows its loss reads only (full-vocabulary products are most of a step)
                rows = next_rows(last, trained_positions(lmask, attn))
                logits = lm_head(rows.to(lm_head.weight.dtype))
        # through the (possibly DDP-wrapped) module's forward, so gradients are synchronised
        if cfg.head == "eagle1":
            noise = cfg.feature_noise if head.training else 0.0
            loss, losses, accs = head(last.float(), ids, logits, lmask, attn, cfg.feature_weight, cfg.token_weight, noise)
            losses = {"feature": losses[0], "token": losses[1]}
        else:
            layers = feature_indices(cfg, head)
            features = torch.cat([feats[i] for i in layers], -1).float()
            loss, losses, accs = head(features, ids, logits, lmask, attn, cfg.ttt_steps, cfg.loss_decay)
    return loss, metrics_of(losses, accs)


def metrics_of(losses: list | dict, accs: list) -> dict:
    """Console/W&B metrics: named losses, per-head top-1, and tau estimated from the top-1 chain."""
    named = losses.items() if isinstance(losses, dict) else enumerate(losses)
    metrics = {f"loss/{k}" if isinstance(k, str) else f"loss/head{k}": float(v) for k, v in named}
    metrics.update({f"top1/head{k}": float(v) for k, v in enumerate(accs)})
    # expected tau from per-depth accuracies along the top-1 chain: 1 + sum_k prod_{j<=k} acc_j
    chain, tau = 1.0, 1.0
    for a in accs:
        chain *= float(a)
        tau += chain
    metrics["tau_estimate"] = tau
    return metrics


class TrainingClock:
    """Minutes trained so far, across resumes, as every rank agrees on them (the slowest rank's): with a
    time budget (``max_minutes``) all ranks stop after the same step and run the same learning rate."""

    def __init__(self, accelerator: Accelerator, budget_minutes: float):
        self.accelerator = accelerator
        self.budget = 60.0 * budget_minutes
        self.seconds = 0.0
        self.origin = time.perf_counter()  # when training would have started, had it never stopped

    def start(self, carried_seconds: float = 0.0) -> None:
        """Start counting now, after ``carried_seconds`` trained before (a resumed run's)."""
        self.seconds = carried_seconds
        self.origin = time.perf_counter() - carried_seconds

    def tick(self) -> None:
        """Read the clock (after an optimizer step): one small all-reduce per step where a budget is set."""
        seconds = time.perf_counter() - self.origin
        if self.budget and self.accelerator.num_processes > 1:
            seconds = float(self.accelerator.reduce(torch.tensor([seconds], device=self.accelerator.device), "max"))
        self.seconds = seconds

    def progress(self) -> float:
        """Share of the time budget used (0 without one)."""
        return self.seconds / self.budget if self.budget else 0.0

    @property
    def expired(self) -> bool:
        return bool(self.budget) and self.seconds >= self.budget


def lr_lambda(cfg: TrainConfig, clock: TrainingClock | None = None):
    """Linear warmup, then cosine decay to 0 at whichever of max_steps and the clock's budget ends first."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        if clock is not None:
            progress = max(progress, clock.progress())
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def write_metrics(accelerator: Accelerator, out_dir: Path, step: int, metrics: dict) -> None:
    """Append one JSON line to out_dir/metrics.jsonl (main process)."""
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")


def latest_checkpoint(out_dir: Path) -> Path | None:
    ckpts = sorted((out_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return ckpts[-1] if ckpts else None


def save_checkpoint(accelerator: Accelerator, out_dir: Path, step: int, state: dict) -> None:
    """accelerate state + trainer state, written to a temp folder and renamed: a kill mid-save keeps the last one."""
    final = out_dir / "checkpoints" / f"step-{step}"
    tmp = out_dir / "checkpoints" / f".tmp-step-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    # every rank writes its own RNG state file into tmp: none may still be writing when it is renamed
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        replace_dir(tmp, final)
    accelerator.wait_for_everyone()


def evaluate(cfg: TrainConfig, head, target, samples, pad_id: int, store: FeatureStore | None = None) -> dict:
    """Mean loss/accuracy metrics over the held-out samples (which lead an offline dump, index 0..)."""
    head.eval()
    totals: dict[str, float] = {}
    starts = range(0, len(samples), cfg.batch_size)
    with torch.no_grad():
        for start in starts:
            ids = list(range(start, min(start + cfg.batch_size, len(samples))))
            batch = collate([samples[i] for i in ids], pad_id)
            feats = stored(store, ids, batch) if store else None
            _, metrics = head_loss(cfg, head, target, batch, feats)
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v / len(starts)
    head.train()
    return {f"eval/{k}": v for k, v in totals.items()}


def real_tau(cfg: TrainConfig, head_cfg: object, head: torch.nn.Module, model: torch.nn.Module, samples: list,
             out_dir: Path, eos_token_ids: frozenset[int]) -> dict:
    """The real accept length: save the head, load it as users do, draft through the engine on held-out prompts.

    Each prompt is a held-out sample up to its first trained (assistant) token, so it ends with the
    rendered generation prompt. Greedy, ``eval_tau_tokens`` new tokens each. Main process only.
    """
    if cfg.eval_tau_prompts <= 0:
        return {}
    kind = "medusa" if cfg.head == "medusa2" else cfg.head  # Medusa-2 heads are Medusa heads on the adapted target
    folder = save(out_dir / ".eval-head", kind, head_cfg, head, model, cfg.target)
    _, loaded, _ = load_head(folder, model)
    steps = accepted = new = 0
    t0 = time.perf_counter()
    for sample in samples[: cfg.eval_tau_prompts]:
        first = sample.loss_mask.index(1) if 1 in sample.loss_mask else len(sample.input_ids)
        drafter = head_type(kind).drafter(loaded)
        out = generate(model, sample.input_ids[:first], drafter, GenerationConfig(max_new_tokens=cfg.eval_tau_tokens), eos_token_ids)
        steps += out.stats.steps
        accepted += out.stats.accepted
        new += out.stats.new_tokens
    # tau as GenerationStats defines it: tokens per verification forward (the prefill's token not counted)
    tau = (steps + accepted) / steps if steps else 1.0
    return {"eval/tau": tau, "eval/tau_tokens_per_s": new / (time.perf_counter() - t0)}


def saved_head(cfg: TrainConfig, module: torch.nn.Module) -> torch.nn.Module:
    """The module saved as the head folder (Medusa-2: its heads; the adapters go with the target)."""
    return module.heads if cfg.head == "medusa2" else module


def save_medusa2(cfg: TrainConfig, head_cfg: MedusaConfig, module: Medusa2, tokenizer, out_dir: Path) -> None:
    """Medusa-2 result: out_dir/adapter (peft), out_dir/target (merged, a plain HF folder) and out_dir/head,
    whose config records the merged target's weight fingerprint (it refuses the base target)."""
    module.backbone.save_pretrained(str(out_dir / "adapter"))
    if not cfg.merge_adapter:
        save(out_dir / "head", "medusa", head_cfg, module.heads, module.backbone, cfg.target)
        return
    merged = module.backbone.merge_and_unload()
    tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix=".target.tmp-"))
    merged.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    replace_dir(tmp, out_dir / "target")
    info = target_info(merged, str(out_dir / "target"))
    info["weights_fingerprint"] = weights_fingerprint(merged)
    save_head(out_dir / "head", "medusa", head_cfg, module.heads, info, {"medusa2": {"adapter": "../adapter", "target": "../target"}})


def main(cfg: TrainConfig) -> Path:
    out_dir = Path(cfg.out_dir)
    use_wandb = cfg.report_to == "wandb"
    if use_wandb:
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_DIR", str(out_dir))
        out_dir.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(
        # on a machine without GPUs, processes started by torchrun (accelerate launch --multi_gpu)
        # join one gloo group: that is how DDP runs on CPUs without MPI
        cpu=not torch.cuda.is_available(),
        gradient_accumulation_steps=cfg.grad_accum,
        # the schedule counts optimizer steps: stepped below once per step (accelerate's default steps it
        # once per process, so under DDP the warmup and decay ran num_processes times too fast)
        step_scheduler_with_optimizer=False,
        mixed_precision=resolve_mixed_precision(cfg.mixed_precision, "cuda" if torch.cuda.is_available() else "cpu"),
        log_with="wandb" if use_wandb else None,
    )
    set_seed(cfg.seed)
    accelerator.print(f"[accelerate] {accelerator.distributed_type} x{accelerator.num_processes} on {accelerator.device}, "
                      f"mixed precision {accelerator.mixed_precision} (config: {cfg.mixed_precision})")
    if accelerator.mixed_precision == "bf16" and not native_bf16_matmul(accelerator.device.type):
        accelerator.print("[accelerate] note: this CPU has no native bf16 matrix instructions, so bf16 autocast runs "
                          "every head product on PyTorch's slow fallback; mixed_precision: auto (or no) trains in fp32")
    target = load_target(cfg.target, dtype=cfg.target_dtype, device=str(accelerator.device))
    model, tokenizer = target.model, target.tokenizer
    frozen_before = weights_digest(model)
    target_params = sum(p.numel() for p in model.parameters())  # before offline training releases the layers
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    store = None
    if cfg.features_dir:
        store = FeatureStore(cfg.features_dir)
        if store.meta["target"].get("fingerprint") != fingerprint(model):
            raise ValueError(f"{cfg.features_dir} was dumped from another target; dump it again for {cfg.target}")
        samples = store.samples()
        train_samples, eval_samples = samples[cfg.eval_samples :], samples[: cfg.eval_samples]
        # only the shared embedding, norm and lm_head are needed from here on: free the decoder layers
        model.get_decoder().layers = torch.nn.ModuleList()
        frozen_before = weights_digest(model)
        accelerator.print(f"[data] offline features {cfg.features_dir}: {len(samples)} samples, states {store.indices}; "
                          "target decoder layers released")
    else:
        train_samples, eval_samples = build_samples(cfg, tokenizer, accelerator)

    if store is not None and cfg.head == "medusa2":
        raise ValueError("medusa2 trains the target's adapters, so it cannot train from stored features; drop features_dir")
    head_cfg, head = make_head(cfg, model, train_samples)
    (head.heads if cfg.head == "medusa2" else head).float()  # the target itself keeps its dtype
    params = [p for p in head.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    accelerator.print(f"[head] {cfg.head}: {n_params / 1e6:.2f}M trainable parameters "
                      f"({100 * n_params / target_params:.1f}% of the target)")
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    clock = TrainingClock(accelerator, cfg.max_minutes)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, clock))
    head, optimizer, scheduler = accelerator.prepare(head, optimizer, scheduler)

    step, consumed, trained_seconds = 0, 0, 0.0
    if cfg.resume:
        ckpt = latest_checkpoint(out_dir)
        if ckpt is None:
            raise FileNotFoundError(f"resume=true but no checkpoint under {out_dir / 'checkpoints'}")
        accelerator.load_state(str(ckpt))
        state = json.loads((ckpt / "trainer_state.json").read_text())
        step, consumed = state["step"], state["micro_batches"]
        trained_seconds = state.get("train_seconds", 0.0)  # checkpoints from before max_minutes lack it
        accelerator.print(f"[resume] from {ckpt} at step {step}")
    if use_wandb:
        accelerator.init_trackers(cfg.wandb_project, config=asdict(cfg))

    def run_eval(at_step: int) -> dict:
        """Held-out loss/accuracy, plus the real tau through the engine (it needs the whole target)."""
        metrics = evaluate(cfg, head, model, eval_samples, pad_id, store)
        if accelerator.is_main_process and store is None:
            module = saved_head(cfg, accelerator.unwrap_model(head))
            metrics.update(real_tau(cfg, head_cfg, module, model, eval_samples, out_dir, target.eos_token_ids))
        accelerator.log(metrics, step=at_step)
        write_metrics(accelerator, out_dir, at_step, metrics)
        return metrics

    stream = batch_order(len(train_samples), cfg.batch_size, cfg.seed, accelerator.process_index, accelerator.num_processes)
    for _ in range(consumed):
        next(stream)  # same data order as an uninterrupted run
    def trainer_state() -> dict:
        """What a resume reads back besides accelerate's state (trainer_state.json)."""
        return {"step": step, "micro_batches": consumed, "train_seconds": clock.seconds}

    head.train()
    t0, tokens_seen = time.perf_counter(), 0
    clock.start(trained_seconds)
    bar = tqdm(total=cfg.max_steps, initial=step, desc="train", unit="step", file=sys.stderr,
               disable=quiet() or not accelerator.is_main_process)
    while step < cfg.max_steps and not clock.expired:
        for _ in range(cfg.grad_accum):
            idx = next(stream)
            batch = collate([train_samples[i] for i in idx], pad_id)
            feats = stored(store, [cfg.eval_samples + i for i in idx], batch, accelerator.device) if store else None
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            consumed += 1
            tokens_seen += int(batch["attention_mask"].sum())
            with accelerator.accumulate(head), accelerator.autocast():
                loss, metrics = head_loss(cfg, head, model, batch, feats)
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.clip > 0:
                    accelerator.clip_grad_norm_(params, cfg.clip)
                optimizer.step()
                optimizer.zero_grad()
        step += 1
        clock.tick()
        scheduler.step()
        bar.update(1)
        last = step == cfg.max_steps or clock.expired
        if step % cfg.log_every == 0 or last:
            metrics.update(loss=float(loss.detach()), lr=scheduler.get_last_lr()[0], tokens_seen=tokens_seen * accelerator.num_processes)
            accelerator.log(metrics, step=step)
            write_metrics(accelerator, out_dir, step, metrics)
            accelerator.print(f"step {step}/{cfg.max_steps} loss {float(loss.detach()):.4f} tau~{metrics['tau_estimate']:.2f} "
                              f"lr {metrics['lr']:.2e} {time.perf_counter() - t0:.0f}s")
        if cfg.eval_every and step % cfg.eval_every == 0 and not last:
            run_eval(step)
        if cfg.save_every and step % cfg.save_every == 0 and not last:
            save_checkpoint(accelerator, out_dir, step, trainer_state())

    bar.close()
    if step < cfg.max_steps:
        accelerator.print(f"[budget] stopped after step {step} of {cfg.max_steps}: {clock.seconds / 60:.1f} of "
                          f"max_minutes {cfg.max_minutes:g} trained")
    eval_metrics = run_eval(step)
    accelerator.print("[eval] " + " ".join(f"{k} {v:.3f}" for k, v in sorted(eval_metrics.items())))
    save_checkpoint(accelerator, out_dir, step, trainer_state())
    head_dir = out_dir / "head"
    # one write with its newline: every rank prints this line to a shared stdout
    digest = weights_digest(accelerator.unwrap_model(head))
    print(f"[rank {accelerator.process_index}] head digest {digest}\n", end="", flush=True)
    if weights_digest(model) != frozen_before:
        raise RuntimeError("the frozen target's weights changed during training")
    accelerator.print("[check] target weights bit-identical before and after training"
                      + (" (base weights; the LoRA adapters trained)" if cfg.head == "medusa2" else ""))
    if accelerator.is_main_process:
        if cfg.head == "medusa2":
            save_medusa2(cfg, head_cfg, accelerator.unwrap_model(head), tokenizer, out_dir)
        else:
            save(head_dir, cfg.head, head_cfg, accelerator.unwrap_model(head), model, cfg.target)
        accelerator.print(f"[done] head saved to {head_dir} ({time.perf_counter() - t0:.0f}s, "
                          f"{tokens_seen * accelerator.num_processes} tokens seen)")
    accelerator.end_training()
    return head_dir


if __name__ == "__main__":
    argv = sys.argv[1:]
    path = argv.pop(0) if argv and "=" not in argv[0] else None
    main(load(TrainConfig, path, argv))
