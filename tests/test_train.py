"""Training loop on a tiny target: loss falls, target frozen, exact resume, W&B offline, two ranks agree."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("train_script", ROOT / "train" / "train.py")
train = importlib.util.module_from_spec(spec)
sys.modules["train_script"] = train  # dataclasses resolve annotations through sys.modules
spec.loader.exec_module(train)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """Conversations with learnable structure: the assistant repeats a pattern."""
    path = tmp_path_factory.mktemp("data") / "convs.json"
    records = []
    for i in range(80):
        word = "abcdefgh"[i % 8] * 3
        records.append({"conversations": [{"from": "human", "value": f"say {word}"},
                                          {"from": "gpt", "value": " ".join([word] * 6)}]})
    path.write_text(json.dumps(records))
    return path


def config(tiny_target_dir, data_file, out, **kw):
    base = train.TrainConfig(
        target=str(tiny_target_dir), data=str(data_file), max_samples=64, eval_samples=8, max_len=64,
        batch_size=4, max_steps=30, warmup_steps=2, lr=1e-2, log_every=2, eval_every=0, save_every=0,
        out_dir=str(out), report_to="none", share_lm_head=False,
    )
    return replace(base, **kw)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("head", ["medusa", "eagle1", "eagle3"])
def test_training_lowers_loss_and_keeps_target_frozen(tiny_target_dir, data_file, tmp_path, head, capsys):
    """Guards the loop end to end: the loss falls, a head folder is written, the target is untouched."""
    cfg = config(tiny_target_dir, data_file, tmp_path, head=head, draft_vocab_size=64, ttt_steps=3)
    head_dir = train.main(cfg)
    rows = [r for r in metrics(tmp_path) if "loss" in r]
    first, last = rows[0], rows[-3:]
    late_loss = sum(r["loss"] for r in last) / 3
    late_top1 = sum(r["top1/head0"] for r in last) / 3
    # soft targets (eagle3) have a floor at the target's entropy, so judge the loss and the accuracy
    assert late_loss < first["loss"] - 0.2, f"loss {first['loss']:.3f} -> {late_loss:.3f}"
    assert late_top1 > first["top1/head0"] + 0.2, f"top-1 {first['top1/head0']:.2f} -> {late_top1:.2f}"
    assert (head_dir / "model.safetensors").is_file() and (head_dir / "config.json").is_file()
    assert "target weights bit-identical" in capsys.readouterr().out
    final_eval = [r for r in metrics(tmp_path) if "eval/tau" in r][-1]
    # the real tau comes from drafting through the engine. EAGLE heads learn the target's own
    # distribution, so they get accepted; Medusa-1 learns the data's labels, which this random target
    # does not follow (that is what self-distilled data fixes), so it only has to be a valid tau
    floor = 1.0 if head == "medusa" else 1.5
    assert final_eval["eval/tau"] >= floor, f"real tau {final_eval['eval/tau']:.2f} (estimate {final_eval['eval/tau_estimate']:.2f})"


@pytest.mark.parametrize("head", ["medusa", "eagle1", "eagle3"])
def test_heads_train_in_fp32_on_a_bf16_target(tiny_target_dir, data_file, tmp_path, head):
    """Guards training without autocast (CPUs without native bf16 train in fp32): the heads take the
    bf16 target's states in fp32 and project through the shared bf16 lm_head in fp32."""
    cfg = config(tiny_target_dir, data_file, tmp_path, head=head, share_lm_head=True, target_dtype="bfloat16",
                 mixed_precision="no", max_steps=4, eval_tau_prompts=0, draft_vocab_size=64, ttt_steps=2)
    train.main(cfg)
    rows = [r for r in metrics(tmp_path) if "loss" in r]
    assert rows and all(r["loss"] == r["loss"] for r in rows)  # trained, finite


def crash_after_checkpoint(cfg, at_step: int, monkeypatch) -> None:
    """Run ``cfg`` until it is killed right after writing its step-``at_step`` checkpoint."""
    real_save = train.save_checkpoint

    def save_then_die(acc, out_dir, step, state):
        real_save(acc, out_dir, step, state)
        if step == at_step:
            raise KeyboardInterrupt(f"simulated kill after the step-{at_step} checkpoint")

    monkeypatch.setattr(train, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train.main(cfg)
    monkeypatch.setattr(train, "save_checkpoint", real_save)


def test_resume_after_crash_equals_uninterrupted(tiny_target_dir, data_file, tmp_path, monkeypatch):
    """Guards resume: same data order, optimizer and schedule, so the final head is identical."""
    full = config(tiny_target_dir, data_file, tmp_path / "full", max_steps=12, save_every=6)
    train.main(full)
    crashed = replace(full, out_dir=str(tmp_path / "crash"))
    crash_after_checkpoint(crashed, 6, monkeypatch)
    train.main(replace(crashed, resume=True))
    a = (tmp_path / "full" / "head" / "model.safetensors").read_bytes()
    b = (tmp_path / "crash" / "head" / "model.safetensors").read_bytes()
    assert a == b, "resumed run differs from the uninterrupted one"


def test_wandb_offline_run_files_hold_metrics(tiny_target_dir, data_file, tmp_path):
    """Guards logging without an account: offline run files are written with the metrics."""
    cfg = config(tiny_target_dir, data_file, tmp_path, max_steps=4, report_to="wandb")
    os.environ.pop("WANDB_MODE", None)
    train.main(cfg)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, f"no offline run under {tmp_path / 'wandb'}"
    # wandb's service process finishes writing the run file shortly after finish() returns: wait for it
    deadline = time.monotonic() + 60
    while True:
        blobs = b"".join(p.read_bytes() for p in runs[0].rglob("*.wandb"))
        if (b"tau_estimate" in blobs and b"loss" in blobs) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert b"tau_estimate" in blobs and b"loss" in blobs, f"{len(blobs)} bytes of run data without the metrics"


def free_port() -> int:
    """A TCP port nothing listens on now (a fixed one can be held by another run on the machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def failure_report(stderr: str, limit: int = 6000) -> str:
    """A failed launch's first traceback (a rank's own error, printed before the launcher's summary)
    and the tail of stderr: the tail alone holds only torchrun's 'exitcode 1' summary."""
    first = stderr.find("Traceback")
    head = stderr[first : first + limit // 2] if first >= 0 else ""
    return f"{head}\n...\n{stderr[-limit // 2 :]}"


def launch_two_ranks(tiny_target_dir, data_file, out: Path, *options: str) -> subprocess.CompletedProcess:
    """train.py on two CPU processes (gloo); fails the test unless both ranks end with the same head."""
    # accelerate's own --cpu multi-process launch needs mpirun; torchrun (--multi_gpu) + gloo needs nothing
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", str(free_port()), str(ROOT / "train" / "train.py"),
           f"target={tiny_target_dir}", f"data={data_file}", "max_samples=64", "eval_samples=8", "max_len=64",
           "batch_size=2", "eval_every=0", "save_every=0", "report_to=none", f"out_dir={out}", *options]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, failure_report(proc.stderr)
    digests = sorted(re.findall(r"head digest ([0-9a-f]{64})", proc.stdout))
    assert "MULTI_CPU x2" in proc.stdout, proc.stdout[-2000:]
    assert len(digests) == 2 and digests[0] == digests[1], proc.stdout[-2000:]
    return proc


def test_two_cpu_processes_agree(tiny_target_dir, data_file, tmp_path):
    """Guards DDP on CPU (gloo): both ranks end with the same head weights and both ranks' states in the
    checkpoint (rank 0 renamed the checkpoint folder while rank 1 could still be writing into it), and
    the learning rate follows the schedule by optimizer steps (accelerate's default stepped it once per
    rank: on two ranks the cosine reached 0 at step 3 of 6)."""
    launch_two_ranks(tiny_target_dir, data_file, tmp_path, "max_steps=6", "warmup_steps=2", "log_every=1")
    cfg = train.TrainConfig(max_steps=6, warmup_steps=2)
    expected = [cfg.lr * train.lr_lambda(cfg)(step) for step in range(1, 7)]
    assert [m["lr"] for m in metrics(tmp_path) if "lr" in m] == pytest.approx(expected, rel=1e-6, abs=1e-12)
    # the checkpoint holds each rank's RNG state (a resume on two ranks reads both), nothing half-moved
    ckpts = list((tmp_path / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["step-6"], ckpts
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {f.name for f in ckpts[0].iterdir()}



def test_two_ranks_stop_together_on_a_time_budget(tiny_target_dir, data_file, tmp_path):
    """Guards max_minutes under DDP: the ranks agree on the clock (the slowest rank's), so both stop after
    the same step with the same head; a rank stopping alone would hang the other in its next all-reduce."""
    proc = launch_two_ranks(tiny_target_dir, data_file, tmp_path, "max_steps=50", "max_minutes=1e-9")
    assert "[budget] stopped after step 1 of 50" in proc.stdout, proc.stdout[-2000:]
    assert [c.name for c in (tmp_path / "checkpoints").iterdir()] == ["step-1"]


def test_time_budget_ends_the_schedule_and_counts_across_a_resume(tiny_target_dir, data_file, tmp_path, monkeypatch,
                                                                   capsys):
    """Guards max_minutes: the cosine ends at whichever of steps and minutes runs out first, a run stops
    once its minutes are spent, and a resumed run counts the minutes trained before the crash."""
    cfg = train.TrainConfig(max_steps=100, warmup_steps=10, max_minutes=2.0)
    clock = SimpleNamespace(progress=lambda: 0.5)
    f = train.lr_lambda(cfg, clock)
    assert f(4) == pytest.approx(0.5)  # warmup goes by steps
    assert f(19) == pytest.approx(0.5)  # half the minutes, a tenth of the steps: the minutes decide
    assert f(85) == pytest.approx(0.5 * (1 + math.cos(math.pi * 75 / 90)))  # the steps are further along
    clock.progress = lambda: 1.25
    assert f(19) == 0.0

    train.main(config(tiny_target_dir, data_file, tmp_path / "short", max_minutes=1e-9))
    assert "[budget] stopped after step 1 of 30" in capsys.readouterr().out
    assert (tmp_path / "short" / "head" / "model.safetensors").exists()

    run = config(tiny_target_dir, data_file, tmp_path / "crash", max_steps=12, save_every=4)
    crash_after_checkpoint(run, 4, monkeypatch)
    trained = json.loads((tmp_path / "crash" / "checkpoints" / "step-4" / "trainer_state.json").read_text())["train_seconds"]
    assert trained > 0
    capsys.readouterr()
    train.main(replace(run, resume=True, max_minutes=trained / 2 / 60))  # spent before the crash: no more steps
    assert "[budget] stopped after step 4 of 12" in capsys.readouterr().out

dump_spec = importlib.util.spec_from_file_location("dump_script", ROOT / "train" / "dump_features.py")
dump = importlib.util.module_from_spec(dump_spec)
sys.modules["dump_script"] = dump
dump_spec.loader.exec_module(dump)


def dump_config(tiny_target_dir, data_file, out, **kw):
    return dump.train.TrainConfig(**{**config(tiny_target_dir, data_file, out, **kw).__dict__})


@pytest.mark.parametrize("head", ["medusa", "eagle1", "eagle3"])
def test_offline_features_give_the_online_loss(tiny_target_dir, data_file, tmp_path, head):
    """Guards offline training: stored features (fp32) give the same loss as running the target."""
    from selfdraft.data import collate
    from selfdraft.features import FeatureStore
    from selfdraft.target import load_target

    kw = dict(head=head, draft_vocab_size=64, ttt_steps=3, features_dir=str(tmp_path / "feats"),
              features_dtype="float32", features_per_shard=16)
    dump.main(dump_config(tiny_target_dir, data_file, tmp_path, **kw))
    cfg = config(tiny_target_dir, data_file, tmp_path, **kw)
    store = FeatureStore(cfg.features_dir)
    model = load_target(str(tiny_target_dir), dtype="float32").model
    samples = store.samples()
    _, head_module = train.make_head(cfg, model, samples[cfg.eval_samples :])
    head_module.eval()  # no EAGLE-1 input noise: both paths must see the same inputs
    for ids in ([0, 1, 2, 3], [20, 31, 45, 70]):
        batch = collate([samples[i] for i in ids], 0)
        with torch.no_grad():
            online, m_on = train.head_loss(cfg, head_module, model, batch)
            offline, m_off = train.head_loss(cfg, head_module, model, batch, train.stored(store, ids, batch))
        assert abs(float(online) - float(offline)) < 1e-5, (float(online), float(offline))
        assert m_on.keys() == m_off.keys()


def test_bf16_dump_runs_the_products_training_runs(tiny_target_dir, data_file, tmp_path, monkeypatch):
    """Guards the dump on a bf16 target where bf16 is not native: the frozen products take the fp32 route
    as in online training (PyTorch's bf16 fallback is ~7x slower there), and the stored features are
    the ones online training computes, bit for bit."""
    from selfdraft import kernels
    from selfdraft.data import collate
    from selfdraft.features import FeatureStore, target_features
    from selfdraft.kernels import matmul_mode
    from selfdraft.target import load_target

    monkeypatch.setattr(kernels, "native_bf16_matmul", lambda device_type="cpu": False)
    real_upcast, upcasts = kernels.upcast_linear, []
    monkeypatch.setattr(kernels, "upcast_linear", lambda *a: upcasts.append(1) or real_upcast(*a))

    kw = dict(head="eagle3", draft_vocab_size=64, ttt_steps=2, target_dtype="bfloat16", features_dtype="bfloat16",
              features_per_shard=16, features_dir=str(tmp_path / "feats"), max_samples=24)
    dump.main(dump_config(tiny_target_dir, data_file, tmp_path, **kw))
    assert upcasts, "the dump ran the bf16 target's products on PyTorch's bf16 fallback"
    store = FeatureStore(kw["features_dir"])
    model = load_target(str(tiny_target_dir), dtype="bfloat16").model
    samples = store.samples()
    ids = [0, 1, 2, 3]
    batch = collate([samples[i] for i in ids], 0)
    with matmul_mode(torch.bfloat16, torch.device("cpu"), batch["input_ids"].numel()):  # as train.head_loss runs it
        online = target_features(model, batch["input_ids"], batch["attention_mask"], store.indices)
    offline = train.stored(store, ids, batch)
    mask = batch["attention_mask"].bool()
    for i in store.indices:
        assert torch.equal(online[i][mask], offline[i][mask]), f"stored state {i} differs from the online one"


def test_offline_training_matches_online_and_dump_resumes(tiny_target_dir, data_file, tmp_path, monkeypatch):
    """Guards the offline pipeline end to end: a resumed dump is complete, training from it matches online."""
    import safetensors.torch

    from selfdraft import features

    kw = dict(head="eagle3", draft_vocab_size=64, ttt_steps=2, max_steps=8, features_dtype="float32",
              features_per_shard=16, features_dir=str(tmp_path / "feats"))
    real_save, calls = safetensors.torch.save_file, []

    def save_then_die(tensors, path, *a, **k):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated kill while writing shard 3")
        return real_save(tensors, path, *a, **k)

    monkeypatch.setattr(features, "save_file", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        dump.main(dump_config(tiny_target_dir, data_file, tmp_path / "d", **kw))
    with pytest.raises(ValueError, match="incomplete"):
        features.FeatureStore(kw["features_dir"])
    monkeypatch.setattr(features, "save_file", real_save)
    dump.main(dump_config(tiny_target_dir, data_file, tmp_path / "d", **kw))
    assert len(features.FeatureStore(kw["features_dir"])) == 72

    online = train.main(config(tiny_target_dir, data_file, tmp_path / "on", **{**kw, "features_dir": ""}))
    offline = train.main(config(tiny_target_dir, data_file, tmp_path / "off", **kw))
    from safetensors.torch import load_file

    a, b = load_file(str(online / "model.safetensors")), load_file(str(offline / "model.safetensors"))
    diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert diff < 1e-4, f"offline-trained head differs from the online one by {diff:.2e}"


def test_dump_refuses_over_budget(tiny_target_dir, data_file, tmp_path):
    """Guards the disk budget: the size is estimated before writing and an over-budget dump is refused."""
    cfg = dump_config(tiny_target_dir, data_file, tmp_path, head="eagle3", features_dir=str(tmp_path / "f"),
                      features_budget_gb=1e-6)
    with pytest.raises(ValueError, match="features_budget_gb"):
        dump.main(cfg)
    assert not list((tmp_path / "f").glob("shard-*")), "nothing may be written past the budget"


def test_dump_grows_with_appended_data_and_refuses_other_data(tiny_target_dir, data_file, tmp_path, monkeypatch):
    """Guards growing a dump (more distilled replies appended to the data): complete shards are kept,
    the last partial one and the new ones are written, and the result equals a fresh dump; other data
    (or less of it) in the same folder is refused and the dump is left as it was."""
    import safetensors.torch
    from safetensors.torch import load_file

    from selfdraft import features

    kw = dict(head="eagle3", draft_vocab_size=64, ttt_steps=2, features_dtype="float32", features_per_shard=16,
              features_dir=str(tmp_path / "feats"))
    real_save, saved = safetensors.torch.save_file, []
    monkeypatch.setattr(features, "save_file", lambda t, path, *a, **k: saved.append(Path(path).name) or real_save(t, path, *a, **k))
    dump.main(dump_config(tiny_target_dir, data_file, tmp_path / "a", **kw, max_samples=20))  # 28 samples: 16 + 12
    assert len(features.FeatureStore(kw["features_dir"])) == 28
    saved.clear()
    dump.main(dump_config(tiny_target_dir, data_file, tmp_path / "a", **kw, max_samples=40))  # 48 samples
    assert saved == [".shard-00001.safetensors.tmp", ".shard-00002.safetensors.tmp"], saved
    fresh = {**kw, "features_dir": str(tmp_path / "fresh")}
    dump.main(dump_config(tiny_target_dir, data_file, tmp_path / "b", **fresh, max_samples=40))
    assert len(features.FeatureStore(kw["features_dir"])) == 48
    for shard in ("shard-00000", "shard-00001", "shard-00002"):
        grown, ref = load_file(f"{kw['features_dir']}/{shard}.safetensors"), load_file(f"{fresh['features_dir']}/{shard}.safetensors")
        assert grown.keys() == ref.keys() and all(torch.equal(grown[k], ref[k]) for k in ref), shard

    before = {p.name: p.read_bytes() for p in (tmp_path / "feats").iterdir()}
    other = tmp_path / "other.json"
    records = json.loads(Path(data_file).read_text())
    other.write_text(json.dumps(records[1:] + records[:1]))  # the same kind of data, other samples first
    with pytest.raises(ValueError, match="different feature dump"):
        dump.main(dump_config(tiny_target_dir, other, tmp_path / "a", **kw, max_samples=40))
    with pytest.raises(ValueError, match="different feature dump"):
        dump.main(dump_config(tiny_target_dir, data_file, tmp_path / "a", **kw, max_samples=20))
    assert {p.name: p.read_bytes() for p in (tmp_path / "feats").iterdir()} == before, "a refused dump changed the folder"


def test_medusa2_combined_loss_by_hand():
    """Guards the Medusa-2 loss: backbone next-token CE on assistant tokens + decayed head losses."""
    from conftest import tiny_model

    from selfdraft.heads.medusa import MedusaConfig, MedusaHeads, medusa_loss
    from selfdraft.heads.medusa2 import Medusa2, attach_lora

    model = tiny_model("llama")
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(32, 96, 2, 1, False), model.get_output_embeddings())
    module = Medusa2(attach_lora(model, 4, 8, 0.0, ["q_proj", "v_proj"]), heads)
    ids = torch.randint(3, 96, (2, 9))
    lmask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 0, 0]])
    attn = torch.ones_like(ids)
    with torch.no_grad():
        loss, parts, _ = module(ids, attn, lmask, decay=0.5, lm_weight=0.3)
        out = model(input_ids=ids, output_hidden_states=[-1])
        terms = [torch.nn.functional.cross_entropy(out.logits[b, t], ids[b, t + 1])
                 for b in range(2) for t in range(8) if lmask[b, t + 1]]
        lm = torch.stack(terms).mean()
        head_total, _, _ = medusa_loss(heads, out.hidden_states[-1], ids, lmask, 0.5)
    assert torch.allclose(parts["lm"], lm, atol=1e-5), (parts["lm"], lm)
    assert torch.allclose(loss, 0.3 * lm + head_total, atol=1e-5)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("heads.") for n in trainable), sorted(trainable)[:5]


def test_medusa2_trains_adapters_and_saves_target_with_heads(tiny_target_dir, data_file, tmp_path, capsys):
    """Guards Medusa-2 end to end: loss falls, base weights unchanged, merged target + heads load together."""
    from selfdraft.generate import GenerationConfig, generate
    from selfdraft.heads import HeadMismatchError, head_type, load_head
    from selfdraft.target import load_target

    cfg = config(tiny_target_dir, data_file, tmp_path, head="medusa2", num_heads=2, lora_rank=4, max_steps=20)
    head_dir = train.main(cfg)
    rows = [r for r in metrics(tmp_path) if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.2, (rows[0]["loss"], rows[-1]["loss"])
    assert "loss/lm" in rows[-1] and "eval/tau" in metrics(tmp_path)[-1]
    assert "target weights bit-identical" in capsys.readouterr().out
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    merged = load_target(str(tmp_path / "target"), dtype="float32")
    base = load_target(str(tiny_target_dir), dtype="float32")
    with pytest.raises(HeadMismatchError, match="adapted target"):
        load_head(head_dir, base.model)
    kind, heads, _ = load_head(head_dir, merged.model)
    prompt = [5, 6, 7, 8, 9]
    ref = generate(merged.model, prompt, None, GenerationConfig(max_new_tokens=16)).tokens
    out = generate(merged.model, prompt, head_type(kind).drafter(heads), GenerationConfig(max_new_tokens=16))
    assert out.tokens == ref


def test_max_samples_zero_uses_every_conversation(tiny_target_dir, data_file, capsys):
    """Guards max_samples=0 ('all'): every record is read, eval_samples held out of them (not eval_samples alone)."""
    from accelerate import Accelerator

    from selfdraft.target import load_target

    tokenizer = load_target(str(tiny_target_dir)).tokenizer
    cfg = config(tiny_target_dir, data_file, "unused", max_samples=0, eval_samples=8)
    train_samples, eval_samples = train.build_samples(cfg, tokenizer, Accelerator(cpu=True))
    assert (len(train_samples), len(eval_samples)) == (72, 8)


def test_every_train_config_is_valid():
    """Guards the shipped configs against drift: each loads into TrainConfig and names its command."""
    from selfdraft.config import load

    files = sorted((ROOT / "configs" / "train").glob("*.yaml"))
    assert len(files) >= 7
    for f in files:
        cfg = load(train.TrainConfig, f)
        assert cfg.head in ("medusa", "medusa2", "eagle1", "eagle3"), f
        assert f.read_text().startswith("# accelerate launch") and f.name in f.read_text().splitlines()[0], f


def test_init_head_continues_from_a_trained_head(tiny_target_dir, data_file, tmp_path):
    """Guards init_head: training starts from the saved weights (not a fresh head), and a wrong head type is refused."""
    first = tmp_path / "first"
    head_dir = train.main(config(tiny_target_dir, data_file, first, head="eagle3", draft_vocab_size=64, ttt_steps=3))
    trained = [r for r in metrics(first) if "loss" in r]
    cont = tmp_path / "cont"
    out = train.main(config(tiny_target_dir, data_file, cont, head="eagle3", init_head=str(head_dir), max_steps=2,
                            warmup_steps=0, lr=1e-7, log_every=1, eval_tau_prompts=0, ttt_steps=3))
    start = [r for r in metrics(cont) if "loss" in r][0]
    # a fresh head starts near chance; the continued one starts where the first run ended
    assert start["top1/head0"] > trained[0]["top1/head0"] + 0.3, (trained[0]["top1/head0"], start["top1/head0"])
    assert start["loss/head0"] < trained[0]["loss/head0"] - 0.1, (trained[0]["loss/head0"], start["loss/head0"])
    end_eval = [r for r in metrics(first) if "eval/loss/head0" in r][-1]["eval/loss/head0"]
    cont_eval = [r for r in metrics(cont) if "eval/loss/head0" in r][-1]["eval/loss/head0"]
    assert abs(cont_eval - end_eval) < 1e-3  # lr 1e-7 for two steps: the same head
    # the saved config (draft vocabulary included) is carried over, whatever the fresh-head options say
    assert json.loads((out / "config.json").read_text())["head_config"] == json.loads((head_dir / "config.json").read_text())["head_config"]
    with pytest.raises(ValueError, match="holds a 'eagle3' head"):
        train.main(config(tiny_target_dir, data_file, tmp_path / "bad", head="eagle1", init_head=str(head_dir)))


def test_extra_data_adds_first_exchanges_for_training_only(tiny_target_dir, data_file, tmp_path):
    """Guards extra_data: its first exchanges follow data's samples (eval stays data's first eval_samples),
    prompts data already holds are not added twice, and extra_samples without extra_data is refused."""
    from accelerate import Accelerator

    from selfdraft.target import load_target

    extra = tmp_path / "extra.jsonl"
    rows = [{"conversations": [{"from": "human", "value": "say aaa"}, {"from": "gpt", "value": "written aaa"}]}]
    rows += [{"conversations": [{"from": "human", "value": f"new {i}"}, {"from": "gpt", "value": f"reply {i}"},
                                {"from": "human", "value": "more"}, {"from": "gpt", "value": "later turn"}]} for i in range(5)]
    extra.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tokenizer = load_target(str(tiny_target_dir)).tokenizer
    acc = Accelerator(cpu=True)
    base_train, base_eval = train.build_samples(config(tiny_target_dir, data_file, "unused"), tokenizer, acc)
    cfg = config(tiny_target_dir, data_file, "unused", extra_data=str(extra), extra_samples=3)
    train_samples, eval_samples = train.build_samples(cfg, tokenizer, acc)
    assert eval_samples == base_eval and train_samples[: len(base_train)] == base_train
    added = [tokenizer.decode(s.input_ids) for s in train_samples[len(base_train) :]]
    assert len(added) == 3 and all(f"new {i}" in t and f"reply {i}" in t and "later turn" not in t for i, t in enumerate(added))
    with pytest.raises(ValueError, match="extra_data"):
        config(tiny_target_dir, data_file, "unused", extra_samples=3)
