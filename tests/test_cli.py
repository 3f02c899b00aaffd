"""The selfdraft command end to end on a tiny random target, through the real entry point."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "selfdraft.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def assert_clean_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, f"exit {proc.returncode}: {proc.stderr[-500:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-1000:]
    assert needle in proc.stderr, proc.stderr[-500:]


def test_generate_streams_and_reports(tiny_target_dir):
    """Guards the generate path: text on stdout, tau and tok/s on stderr, exit 0."""
    proc = run("generate", "--target", str(tiny_target_dir), "--dtype", "float32", "--prompt", "abcabcabc",
               "--max-new-tokens", "12", "--drafter", "prompt_lookup:max_candidates=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tau" in proc.stderr and "tok/s" in proc.stderr


def test_bench_writes_table_and_json(tiny_target_dir, tmp_path):
    """Guards the benchmark program: a row per decoder and a JSON file with the numbers."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["hello hello", "xyz xyz xyz"]))
    out = tmp_path / "r.json"
    proc = run("bench", "--target", str(tiny_target_dir), "--dtype", "float32", "--prompts", str(prompts),
               "--max-new-tokens", "8", "--decoders", "hf plain prompt_lookup layer_skip:layers=2",
               "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert [r["decoder"] for r in rows] == ["hf", "plain", "prompt_lookup", "layer_skip:layers=2"]
    assert all(r["identical_frac"] == 1.0 for r in rows if r["decoder"] != "plain"), rows
    assert "speedup" in proc.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--target", "/nonexistent/model"], "not found"),
        (["--max-new-tokens", "0"], "max-new-tokens"),
        (["--drafter", "nosuch"], "unknown drafter"),
        (["--drafter", "prompt_lookup:bogus=1"], "bad options"),
        (["--temperature", "-1"], "temperature"),
        (["--drafter", "head:path=/nonexistent/head"], "not a head folder"),
    ],
)
def test_generate_bad_input_is_one_clean_line(tiny_target_dir, args, needle):
    """Guards user mistakes against tracebacks: one error line and exit status 2."""
    base = ["generate", "--target", str(tiny_target_dir), "--dtype", "float32"]
    if "--target" in args:
        base = ["generate"]
    assert_clean_error(run(*base, *args), needle)


def test_prompt_longer_than_context_is_clean_error(tiny_target_dir):
    """Guards the context limit at the command line."""
    proc = run("generate", "--target", str(tiny_target_dir), "--dtype", "float32", "--prompt", "a" * 300)
    assert_clean_error(proc, "exceeds the target's context")


def test_unknown_option_exits_nonzero():
    """Guards argparse handling of typos."""
    proc = run("generate", "--no-such-flag")
    assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr


def test_head_for_another_target_is_refused(tiny_target_dir, tmp_path):
    """Guards against drafting with a head trained for a different model (silently useless or wrong)."""
    from conftest import tiny_model

    from selfdraft.heads import MedusaConfig, MedusaHeads, save

    other = tiny_model("llama", seed=1)
    cfg = MedusaConfig(other.config.hidden_size, other.config.vocab_size, num_heads=2)
    path = save(tmp_path / "head", "medusa", cfg, MedusaHeads(cfg, other.lm_head), other, "other")
    proc = run("generate", "--target", str(tiny_target_dir), "--dtype", "float32", "--drafter", f"head:path={path}")
    assert_clean_error(proc, "trained for another target")
