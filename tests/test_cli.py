"""The selfdraft command end to end on a tiny random target, through the real entry point."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from selfdraft.hugepages import huge_pages_apply


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
    """Guards the benchmark program: a row per decoder, per-depth acceptance, a JSON file with the numbers."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["hello hello", "xyz xyz xyz"]))
    out = tmp_path / "r.json"
    proc = run("bench", "--target", str(tiny_target_dir), "--dtype", "float32", "--prompts", str(prompts),
               "--max-new-tokens", "8", "--decoders", "hf plain prompt_lookup layer_skip:layers=2",
               "--out", str(out), "--carry-gate", "false")  # a fresh gate per reply drafts its first steps
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert [r["decoder"] for r in rows] == ["hf", "plain", "prompt_lookup", "layer_skip:layers=2"]
    assert all(r["identical_frac"] == 1.0 for r in rows if r["decoder"] != "plain"), rows
    assert "speedup" in proc.stdout and "acc%@1.." in proc.stdout
    skip = next(r for r in rows if r["decoder"] == "layer_skip:layers=2")
    assert skip["acceptance_by_depth"] and all(0 <= a <= 1 for a in skip["acceptance_by_depth"]), skip
    assert sum(skip["accept_length_counts"].values()) > 0, skip
    assert "bench" in proc.stderr, "no progress bar on stderr without --quiet"


def test_bench_multi_turn_conversations(tiny_target_dir, tmp_path):
    """Guards multi-turn prompt sets: every turn of 'turns' and 'messages' records runs, greedy-identical."""
    prompts = tmp_path / "mt.jsonl"
    records = [
        {"turns": ["hello there", "abc"]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abcabc"},
                      {"role": "assistant", "content": "old reply, regenerated"}, {"role": "user", "content": "xyz"}]},
        {"prompt": "one turn only"},
    ]
    prompts.write_text("\n".join(json.dumps(r) for r in records))
    out = tmp_path / "r.json"
    proc = run("bench", "--target", str(tiny_target_dir), "--dtype", "float32", "--prompts", str(prompts),
               "--turns", "all", "--max-new-tokens", "6", "--decoders", "plain prompt_lookup", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["meta"]["num_prompts"] == 3 and data["meta"]["num_turns"] == 5, data["meta"]
    assert (data["meta"]["huge_page_weights_bytes"] > 0) == huge_pages_apply(), data["meta"]  # recorded as it happened
    rows = data["results"]
    assert all(len(r["per_prompt_tok_s"]) == 5 for r in rows), rows
    assert rows[1]["identical_frac"] == 1.0, rows[1]
    assert "3 prompts / 5 turns" in proc.stdout, proc.stdout
    assert all(r["reused_tokens"] == 0 for r in rows), rows
    # with the prefix cache the second turns prefill only their new tokens, and the replies stay the same
    again = tmp_path / "reuse.json"
    proc = run("bench", "--target", str(tiny_target_dir), "--dtype", "float32", "--prompts", str(prompts),
               "--turns", "all", "--max-new-tokens", "6", "--decoders", "plain prompt_lookup", "--out", str(again),
               "--prefix-cache", "true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    reused = json.loads(again.read_text())["results"]
    assert reused[1]["identical_frac"] == 1.0, reused[1]
    for old, new in zip(rows, reused):
        assert new["prompt_tokens"] == old["prompt_tokens"], (old, new)  # the same conversations
        assert 0 < new["reused_tokens"] < new["prompt_tokens"], new


def test_bench_sampling_json_plots_quiet(tiny_target_dir, tmp_path):
    """Guards temperature > 0 (HF prompt lookup included), --json on stdout, --plots PNGs and --quiet."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["hello hello", "xyz xyz xyz"]))
    plots = tmp_path / "plots"
    proc = run("bench", "--target", str(tiny_target_dir), "--dtype", "float32", "--prompts", str(prompts),
               "--max-new-tokens", "8", "--temperature", "0.8", "--decoders", "hf hf_prompt_lookup prompt_lookup",
               "--out", str(tmp_path / "r.json"), "--plots", str(plots), "--json", "--quiet")
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)  # exactly one JSON object, no table
    rows = {r["decoder"]: r for r in data["results"]}
    assert set(rows) == {"hf", "hf_prompt_lookup", "prompt_lookup"}, rows
    assert rows["hf_prompt_lookup"]["new_tokens"] > 0 and rows["hf_prompt_lookup"]["speedup_vs_hf"] is not None
    assert rows["prompt_lookup"]["identical_frac"] is None, "identity is not defined when sampling"
    for name in ("accept_lengths.png", "acceptance_by_depth.png", "speedup.png"):
        png = plots / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert str(png) in data["plots"], data["plots"]
    assert "bench" not in proc.stderr and "Loading" not in proc.stderr, f"--quiet still printed: {proc.stderr[-500:]}"


def test_bench_greedy_and_sampled_in_one_run(tiny_target_dir, tmp_path):
    """Guards one bench run at several temperatures: a table each, rows tagged, speedups per temperature."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["hello hello", "xyz xyz xyz"]))
    out = tmp_path / "r.json"
    proc = run("bench", "--target", str(tiny_target_dir), "--dtype", "float32", "--prompts", str(prompts),
               "--max-new-tokens", "6", "--temperature", "0 1.0", "--decoders", "hf plain prompt_lookup",
               "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert [(r["temperature"], r["decoder"]) for r in rows] == [
        (0.0, "hf"), (0.0, "plain"), (0.0, "prompt_lookup"), (1.0, "hf"), (1.0, "plain"), (1.0, "prompt_lookup")]
    assert rows[2]["identical_frac"] == 1.0 and rows[5]["identical_frac"] is None
    assert "temperature 0," in proc.stdout and "temperature 1," in proc.stdout, proc.stdout


def test_generate_json_is_one_object(tiny_target_dir):
    """Guards --json for generate: stdout is a single JSON object with text, sources and tau."""
    proc = run("generate", "--target", str(tiny_target_dir), "--dtype", "float32", "--prompt", "abcabcabc",
               "--max-new-tokens", "12", "--json", "--quiet")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert "oading" not in proc.stderr, f"--quiet still printed loading notes or bars: {proc.stderr[-500:]}"
    assert len(result["tokens"]) == len(result["sources"]) == result["summary"]["new_tokens"], result
    assert result["summary"]["tau"] >= 1.0 and isinstance(result["text"], str), result


def test_generate_show_draft_colours_the_stream(tiny_target_dir):
    """Guards --show-draft in the terminal: accepted draft tokens are green, and a legend is printed."""
    proc = run("generate", "--target", str(tiny_target_dir), "--dtype", "float32", "--prompt", "abc<&>abc abc",
               "--max-new-tokens", "30", "--drafter", "prompt_lookup", "--show-draft", "--quiet")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "\x1b[32m" in proc.stdout and "\x1b[0m" in proc.stdout, repr(proc.stdout)
    assert "accepted draft token" in proc.stderr and "tau" in proc.stderr


def test_chat_keeps_history_resets_and_quits(tiny_target_dir):
    """Guards the chat REPL: two turns with history, /reset forgets it, /quit stops reading, stats per reply."""
    turns = "hello there\nabc\n/reset\nabc\n/quit\nnever answered\n"
    proc = subprocess.run(
        [sys.executable, "-m", "selfdraft.cli", "chat", "--target", str(tiny_target_dir), "--dtype", "float32",
         "--max-new-tokens", "12", "--quiet"],
        input=turns, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    replies = proc.stdout.split("\n")[:-1]
    stats = [line for line in proc.stderr.splitlines() if "tau" in line and "tok/s" in line]
    assert len(replies) == 3 and len(stats) == 3, (replies, proc.stderr)
    assert all(replies), f"an empty reply: {replies}"
    # the same user turn 'abc' answered with and without the first exchange in the history
    assert replies[1] != replies[2], f"history had no effect: {replies}"
    assert "[history cleared]" in proc.stderr
    # the second turn prefilled only its new tokens; after /reset nothing is reused
    assert ["reused from the last turn" in line for line in stats] == [False, True, False], stats


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


def test_bench_prompt_longer_than_context_is_clean_error(tiny_target_dir, tmp_path):
    """Guards bench on an over-long prompt: a located one-line error, not HF generate running off the context."""
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"prompt": "short"}) + "\n" + json.dumps({"prompt": "a" * 300}) + "\n")
    proc = run("bench", "--target", str(tiny_target_dir), "--dtype", "float32", "--prompts", str(prompts),
               "--max-new-tokens", "4", "--decoders", "hf plain", "--out", str(tmp_path / "r.json"), "--quiet")
    assert_clean_error(proc, "prompt 2, turn 1")
    assert "exceeds the target's context" in proc.stderr


def test_chat_turn_longer_than_context_is_reported_and_chat_goes_on(tiny_target_dir):
    """Guards the REPL dying (or tracing back) on one over-long turn instead of reporting it and continuing."""
    proc = subprocess.run(
        [sys.executable, "-m", "selfdraft.cli", "chat", "--target", str(tiny_target_dir), "--dtype", "float32",
         "--max-new-tokens", "8", "--quiet"],
        input="a" * 300 + "\nhello there\n", capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "exceeds the target's context" in proc.stderr and "/reset" in proc.stderr
    assert sum("tau" in line for line in proc.stderr.splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
def test_unknown_option_exits_nonzero(command):
    """Guards argparse handling of typos: exit 2, usage line, no traceback."""
    proc = run(command, "--no-such-flag")
    assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "command,args,needle",
    [
        ("chat", ["--max-new-tokens", "0"], "max-new-tokens must be >= 1"),
        ("bench", ["--max-new-tokens", "0"], "max-new-tokens must be >= 1"),
        ("bench", ["--prompts", "/nonexistent/prompts.jsonl"], "prompt file not found"),
        ("bench", ["--turns", "second"], "turns must be one of"),
        ("bench", ["--decoders", "prompt_lookup:oops"], "is not key=value"),
        ("bench", ["--config", "/nonexistent/bench.yaml"], "config file not found"),
    ],
)
def test_bad_input_fails_before_loading(command, args, needle, tmp_path):
    """Guards chat/bench user mistakes: one error line, exit 2, no traceback, no model load first."""
    proc = run(command, "--target", "/nonexistent/model", *args)
    assert_clean_error(proc, needle)


def test_bad_prompt_file_line_is_located(tmp_path):
    """Guards a malformed JSONL prompt file: the error names the file and line instead of a traceback."""
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text(json.dumps({"prompt": "fine"}) + "\n{not json\n")
    assert_clean_error(run("bench", "--prompts", str(prompts)), f"{prompts}:2")
    prompts.write_text(json.dumps({"answer": "no prompt"}) + "\n")
    assert_clean_error(run("bench", "--prompts", str(prompts)), "no 'turns' list")


def test_every_config_field_is_a_documented_flag():
    """Guards the parser against options that exist in a config but not on the command line (or in --help)."""
    import dataclasses

    from selfdraft.cli import build_parser, commands

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, cmd in commands().items():
        help_text = sub.choices[name].format_help()
        for f in dataclasses.fields(cmd.config):
            flag = "--" + f.name.replace("_", "-")
            assert flag in help_text, f"{name}: {flag} missing from --help"
        assert "--config" in help_text and "--quiet" in help_text, name


def test_head_for_another_target_is_refused(tiny_target_dir, tmp_path):
    """Guards against drafting with a head trained for a different model (silently useless or wrong)."""
    from conftest import tiny_model

    from selfdraft.heads import MedusaConfig, MedusaHeads, save

    other = tiny_model("llama", seed=1)
    cfg = MedusaConfig(other.config.hidden_size, other.config.vocab_size, num_heads=2)
    path = save(tmp_path / "head", "medusa", cfg, MedusaHeads(cfg, other.lm_head), other, "other")
    proc = run("generate", "--target", str(tiny_target_dir), "--dtype", "float32", "--drafter", f"head:path={path}")
    assert_clean_error(proc, "trained for another target")


def test_generate_batch_mode_reports_failed_rows(tiny_target_dir, tmp_path):
    """Guards batch mode: every prompt answered in order, greedy as alone, a too-long prompt reported alone."""
    prompts = tmp_path / "p.jsonl"
    texts = ["abc abc abc", "hello", "x" * 400, "xyz xyz"]  # the third does not fit the 256-position context
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in texts))
    proc = run("generate", "--target", str(tiny_target_dir), "--dtype", "float32", "--prompts", str(prompts),
               "--batch-size", "2", "--max-new-tokens", "8", "--drafter", "prompt_lookup", "--json", "--quiet")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "1 of 4 prompts failed" in proc.stderr and "prompt 2 failed" in proc.stderr, proc.stderr[-1000:]
    assert "Traceback" not in proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3] and rows[2]["error"] and not rows[0]["error"]
    alone = run("generate", "--target", str(tiny_target_dir), "--dtype", "float32", "--prompt", texts[3],
                "--max-new-tokens", "8", "--drafter", "none", "--json", "--quiet")
    assert json.loads(alone.stdout)["text"] == rows[3]["text"]
