"""The head-side subcommands (train, distill, tune, export, import) through the real entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "selfdraft.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli-data") / "convs.jsonl"
    rows = [{"conversations": [{"from": "human", "value": f"say {w}"}, {"from": "gpt", "value": f"{w} {w} {w}"}]}
            for w in ["abc", "xyz", "hello", "qqq"] * 6]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_train_then_tune_then_generate(tiny_target_dir, data_file, tmp_path):
    """Guards the command chain a user runs: train a head, tune its tree, generate with the tuned tree."""
    out = tmp_path / "run"
    proc = run("train", "--target", str(tiny_target_dir), "--data", str(data_file), "--head", "eagle1",
               "--max-samples", "20", "--eval-samples", "4", "--max-len", "48", "--max-steps", "4", "--log-every", "2",
               "--eval-every", "0", "--save-every", "0", "--report-to", "none", "--draft-vocab-size", "48",
               "--ttt-steps", "2", "--eval-tau-prompts", "1", "--eval-tau-tokens", "8", "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    head = out / "head"
    assert (head / "model.safetensors").is_file()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "say abc"}) + "\n" + json.dumps({"prompt": "say xyz"}))
    proc = run("tune", "--head", str(head), "--target", str(tiny_target_dir), "--dtype", "float32",
               "--prompts", str(prompts), "--limit", "2", "--max-new-tokens", "8", "--max-nodes", "4",
               "--max-depth", "2", "--top-ks", "1 2", "--reps", "1", "--context", "8", "--json", "--quiet")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads((head / "tune.json").read_text())["drafter_options"] == result["drafter_options"]
    proc = run("generate", "--target", str(tiny_target_dir), "--dtype", "float32", "--prompt", "say abc",
               "--max-new-tokens", "6", "--drafter", f"head:path={head}", "--json", "--quiet")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tuned for this machine" in proc.stderr
    first = json.loads(proc.stdout)  # nothing but the JSON object on stdout
    # export to SGLang's EAGLE layout (positional head folder), import back, same generation
    proc = run("export", str(head), "--format", "eagle1-sglang", "--out", str(tmp_path / "vllm"), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    proc = run("import", str(tmp_path / "vllm"), "--out", str(tmp_path / "back"), "--target", str(tiny_target_dir))
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run("generate", "--target", str(tiny_target_dir), "--dtype", "float32", "--prompt", "say abc",
               "--max-new-tokens", "6", "--drafter", f"head:path={tmp_path / 'back'},depth=2,top_k=2,total_tokens=4",
               "--json", "--quiet")
    again = json.loads(proc.stdout)
    assert again["text"] == first["text"], (again["text"], first["text"])


def test_training_commands_reject_bad_input(tiny_target_dir, data_file, tmp_path):
    """Guards the error contract of train/tune/distill: one line, exit 2, no traceback."""
    cases = [
        (("tune",), "give the head folder"),
        (("tune", "--head", str(tmp_path / "nope"), "--target", str(tiny_target_dir)), "not a head folder"),
        (("train", "--launch", str(tmp_path / "missing.yaml"), "--target", str(tiny_target_dir)), "accelerate config not found"),
        (("train", "--config", str(tmp_path / "missing.yaml")), "config file not found"),
        (("train", "--target", str(tiny_target_dir), "--data", str(data_file), "--head", "nohead",
          "--report-to", "none", "--out-dir", str(tmp_path / "x")), "unknown head"),
        (("distill", "--target", str(tiny_target_dir), "--data", str(data_file), "--turns", "some"), "turns must be"),
        (("export", str(tmp_path / "nohead"), "--format", "eagle3", "--out", str(tmp_path / "o")), "nohead"),
        (("export", str(tmp_path / "nohead"), "--format", "nosuch", "--out", str(tmp_path / "o")), "nosuch"),
        (("import", str(tmp_path / "nohead"), "--out", str(tmp_path / "o"), "--target", str(tiny_target_dir)), "nohead"),
    ]
    for args, needle in cases:
        proc = run(*args)
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr[-800:])
        assert "Traceback" not in proc.stderr and needle in proc.stderr, (args, proc.stderr[-800:])


def test_distill_then_features_commands(tiny_target_dir, data_file, tmp_path):
    """Guards the data-side commands end to end: distil replies, then dump features from them, quietly."""
    distilled = tmp_path / "d.jsonl"
    proc = run("distill", "--target", str(tiny_target_dir), "--dtype", "float32", "--data", str(data_file),
               "--max-samples", "3", "--max-new-tokens", "4", "--out", str(distilled), "--quiet")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(distilled.read_text().splitlines()) == 3
    assert "distill:" not in proc.stderr, f"--quiet still drew a progress bar: {proc.stderr[-300:]}"
    feats = tmp_path / "feats"
    proc = run("features", "--target", str(tiny_target_dir), "--target-dtype", "float32", "--data", str(distilled),
               "--head", "eagle1", "--max-samples", "3", "--eval-samples", "1", "--max-len", "48",
               "--features-dir", str(feats), "--features-dtype", "float32")
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((feats / "manifest.json").read_text())
    assert manifest["num_samples"] == 3 and manifest["indices"] == [-1], manifest
    assert "GB" in proc.stdout and "features:" in proc.stderr, "size estimate and progress bar expected"


def tune_prompts(tmp_path: Path) -> Path:
    """Two prompts for the scripts' tuning stage (the tiny target knows no held-out ShareGPT)."""
    path = tmp_path / "tune_prompts.jsonl"
    path.write_text(json.dumps({"prompt": "say abc"}) + "\n" + json.dumps({"prompt": "say xyz"}))
    return path


def test_cpu2h_recipe_script_runs_its_four_stages(tiny_target_dir, tmp_path):
    """Guards the 2-hour recipe's driver: distil, dump (with the extra first exchanges), train from the dump and tune, each stage timed."""
    root = Path(__file__).resolve().parents[1]
    prompts = tune_prompts(tmp_path)
    out = tmp_path / "cpu2h"
    data_file = tmp_path / "convs.jsonl"  # ten distinct prompts: 6 distilled, the other 4 taken as written
    data_file.write_text("\n".join(json.dumps({"conversations": [{"from": "human", "value": f"say {w}"},
                                                                 {"from": "gpt", "value": f"{w} {w} {w}"}]})
                                   for w in ["abc", "xyz", "hello", "qqq", "zz", "yy", "ab", "cd", "ef", "gh"]))
    env = {**os.environ, "OUT": str(out), "PROMPTS": "6", "STEPS": "2", "REPLY_TOKENS": "4",
           "TARGET": str(tiny_target_dir), "DATA": str(data_file), "DISTILLED": str(tmp_path / "d.jsonl"),
           "FEATURES": str(tmp_path / "feats"), "CONTEXT": "8", "TUNE_PROMPTS": str(prompts),
           "OVERRIDES": "target_dtype=float32 max_len=48 batch_size=2 eval_samples=1 eval_every=0 eval_tau_prompts=0 save_every=0 "
                        "extra_samples=8",
           "PYTHON": sys.executable, "SELFDRAFT_QUIET": "1"}
    proc = subprocess.run(["bash", str(root / "scripts" / "train_cpu2h.sh")], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((tmp_path / "d.jsonl").read_text().splitlines()) == 6
    assert (out / "head" / "tune.json").is_file()
    # extra_samples=8 takes DATA's first exchanges whose prompts were not distilled: the 4 left
    assert json.loads((tmp_path / "feats" / "manifest.json").read_text())["num_samples"] == 6 + 4
    stages = [line.split()[0] for line in Path(f"{out}.timings").read_text().splitlines()]
    assert stages == ["distill", "dump", "train", "tune"], stages
    assert "6 prompts, 2 steps" in proc.stderr and "min end to end" in proc.stderr, proc.stderr[-1000:]


def test_main_job_script_trains_tunes_and_reports(tiny_target_dir, data_file, tmp_path):
    """Guards the README's main job: the script trains, tunes, benchmarks and prints tau and speedup."""
    root = Path(__file__).resolve().parents[1]
    prompts = tune_prompts(tmp_path)
    env = {**os.environ, "OUT": str(tmp_path / "job"), "STEPS": "2", "PROMPTS": "1", "TOKENS": "6",
           "TARGET": str(tiny_target_dir), "DATA": str(data_file), "MAX_SAMPLES": "20", "EVAL_SAMPLES": "4", "MAX_LEN": "48",
           "CONTEXT": "8", "TUNE_PROMPTS": str(prompts), "PYTHON": sys.executable, "SELFDRAFT_QUIET": "1"}
    proc = subprocess.run(["bash", str(root / "scripts" / "main_job.sh")], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "job" / "head" / "tune.json").is_file()
    summary = [line for line in proc.stdout.splitlines() if line.startswith("[main job]")]
    assert len(summary) == 4 and summary[0].startswith("[main job] head trained 2 steps on "), proc.stdout[-2000:]
    assert all(" tau " in s and "x HF generate" in s and "the same tokens as plain decoding" in s for s in summary[1:3]), \
        proc.stdout[-2000:]
    assert "min end to end" in summary[3]
    rows = json.loads((tmp_path / "job" / "bench.json").read_text())["results"]
    head = f"head:path={tmp_path / 'job'}/head"
    assert [r["decoder"] for r in rows] == ["hf", "plain", head, f"{head},lookup=10"]
