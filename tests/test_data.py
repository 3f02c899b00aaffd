"""Conversation loading: cut-off JSON recovery, validation with counted skips, assistant-only loss mask."""

from __future__ import annotations

import json

import pytest
from conftest import char_tokenizer

from selfdraft.data import (
    collate,
    first_exchanges,
    load_conversations,
    normalize,
    parse_json_array,
    prepare_samples,
    tokenize_conversation,
)


def record(i: int) -> dict:
    return {"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}


def test_cut_off_array_recovers_every_complete_record(tmp_path):
    """Guards the truncated ShareGPT file: all complete records load, the broken tail is reported."""
    text = json.dumps([record(i) for i in range(5)], indent=2)
    cut = text[: text.index('"id": "4"') + 12]  # cut inside the last record
    path = tmp_path / "cut.json"
    path.write_text(cut)
    convs, report = load_conversations(path)
    assert len(convs) == 4 and report.records == 4, report.describe()
    assert report.truncated_bytes > 0 and "cut off" in report.describe()
    items, left = parse_json_array(text)
    assert len(items) == 5 and left == 0


def test_jsonl_messages_and_folder(tmp_path):
    """Guards the other input shapes: OpenAI messages in JSONL, and a folder of files."""
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n"
    )
    (tmp_path / "b.json").write_text(json.dumps([record(1)]))
    convs, report = load_conversations(tmp_path)
    assert len(convs) == 2, report.describe()


def test_jsonl_keeps_records_with_unicode_line_separators(tmp_path):
    """Guards JSONL reading: U+2028 / U+0085 written raw inside a string (ensure_ascii=False) do not split a record."""
    rec = {"conversations": [{"from": "human", "value": "a\u2028b"}, {"from": "gpt", "value": "c\x85d\x0ce"}]}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(rec, ensure_ascii=False) + "\n" + json.dumps(record(1)) + "\n", encoding="utf-8")
    convs, report = load_conversations(path)
    assert len(convs) == 2 and not report.skipped, report.describe()
    assert convs[0][1]["content"] == "c\x85d\x0ce"


@pytest.mark.parametrize(
    "bad,reason",
    [
        ({"conversations": []}, "empty conversation"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown role"),
        ({"conversations": [{"from": "human", "value": 3}]}, "non-string content"),
        ({"conversations": [{"from": "human", "value": "x"}]}, "no assistant turn"),
        ({"text": "x"}, "no conversations/messages field"),
    ],
)
def test_bad_records_are_counted_skips(bad, reason):
    """Guards against crashing (or silently training) on malformed records."""
    assert normalize(bad) == (None, reason)


def test_missing_source_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_conversations(tmp_path / "nope.json")


def test_loss_mask_covers_assistant_tokens_only():
    """Guards the loss mask: exactly the assistant content (and its end marker) is trained."""
    tok = char_tokenizer()
    msgs = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cde"},
            {"role": "user", "content": "f"}, {"role": "assistant", "content": "gh"}]
    sample = tokenize_conversation(tok, msgs, max_len=100)
    text = [tok.decode([i]) for i in sample.input_ids]
    trained = "".join(t for t, m in zip(text, sample.loss_mask) if m)
    assert trained == "cde</s>gh</s>", trained
    batch = collate([sample, tokenize_conversation(tok, msgs[:2], 100)], pad_id=0)
    assert batch["input_ids"].shape == batch["loss_mask"].shape == (2, len(sample.input_ids))


def test_truncation_rule_and_counts():
    """Guards the stated rule: keep the first max_len tokens; drop when no assistant token survives."""
    tok = char_tokenizer()
    long_user = [{"role": "user", "content": "x" * 50}, {"role": "assistant", "content": "y"}]
    ok = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b" * 40}]
    samples, counts = prepare_samples(tok, [long_user, ok], max_len=20)
    assert len(samples) == 1 and len(samples[0].input_ids) == 20
    assert counts["dropped: no assistant token within max_len"] == 1 and counts["truncated to max_len"] == 1


def test_without_chat_template_renders_plain_text_like_inference():
    """Guards base-model training: the conversation is the newline-joined text that encode_chat feeds
    the model, and exactly the assistant contents are trained."""
    from selfdraft.target import Target

    tok = char_tokenizer()
    tok.chat_template = None
    msgs = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cde"},
            {"role": "user", "content": "f"}, {"role": "assistant", "content": "gh"}]
    sample = tokenize_conversation(tok, msgs, max_len=100)
    prompt = Target(model=None, tokenizer=tok, name="t").encode_chat(msgs)
    assert sample.input_ids == prompt  # the same ids as the prompt rendering
    trained = "".join(tok.decode([i]) for i, m in zip(sample.input_ids, sample.loss_mask) if m)
    assert trained == "cdegh", trained
    assert tokenize_conversation(tok, msgs[:2], max_len=3) is None  # <s>, a, b: nothing to train


def test_reply_content_renders_back_what_the_target_said():
    """Guards distilled base-model turns: a continuation that starts with the separator renders back
    to exactly the text the target produced after its prompt; chat replies lose their padding."""
    from selfdraft.data import PLAIN_SEPARATOR, plain_text, reply_content

    history = [{"role": "user", "content": "What is 2+2?"}]
    for said in (PLAIN_SEPARATOR + PLAIN_SEPARATOR + "It is 4.", PLAIN_SEPARATOR + " 4", PLAIN_SEPARATOR + "4\n\n"):
        turn = {"role": "assistant", "content": reply_content(said, chat=False)}
        assert plain_text(history + [turn]) == plain_text(history) + said.rstrip()
    assert reply_content(" Answer: 4", chat=False) == " Answer: 4"  # a continuation of the prompt's own line
    assert reply_content("  It is 4.\n", chat=True) == "It is 4."


def test_plain_text_needs_character_offsets():
    class Slow:  # what a slow (Python) tokenizer without a template looks like to the renderer
        chat_template = None
        is_fast = False

    with pytest.raises(ValueError, match="fast tokenizer"):
        tokenize_conversation(Slow(), [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], 10)


@pytest.mark.slow
def test_shipped_sharegpt_recovers_17671_records():
    """Guards the real cut-off ShareGPT V3 file: 17,671 complete records, the rest reported."""
    from selfdraft.data import sharegpt_path

    _, report = load_conversations(sharegpt_path())
    assert report.records == 17671, report.describe()
    assert report.truncated_bytes > 0


@pytest.mark.slow
def test_sharegpt_heldout_prompts_are_disjoint_from_training_records():
    """Guards tune's default prompt set: user turns of the last records, far from the records training reads first."""
    from selfdraft.benchmark import HELDOUT_MAX_CHARS, sharegpt_heldout
    from selfdraft.benchmark import load_conversations as load_prompt_set
    from selfdraft.data import sharegpt_path

    held = sharegpt_heldout(50)
    records, _ = load_conversations(sharegpt_path())
    used = []  # record index of each held-out prompt, walking back from the end
    for i in range(len(records) - 1, -1, -1):
        user = [m["content"] for m in records[i] if m["role"] == "user"]
        if user and user[0].strip() and len(user[0]) <= HELDOUT_MAX_CHARS:
            used.append(i)
        if len(used) == 50:
            break
    assert [c.turns for c in held] == [tuple(m["content"] for m in records[i] if m["role"] == "user") for i in used]
    assert min(used) > 10_000  # training configs read the first few thousand records
    assert [c.turns for c in load_prompt_set("sharegpt-heldout", 5, "first")] == [c.turns[:1] for c in held[:5]]


def test_first_exchanges_skip_known_and_long_prompts():
    """Guards first_exchanges: the first (user, assistant) pair only, prompts already held or over the
    length limit skipped, repeats taken once, conversations not opening with a user turn skipped, limit kept."""
    def conv(*turns):
        return [{"role": r, "content": c} for r, c in turns]

    held = [conv(("user", "distilled"), ("assistant", "target's reply"))]
    pool = [
        conv(("user", "distilled"), ("assistant", "written reply")),
        conv(("system", "be brief"), ("user", "q0"), ("assistant", "a0")),
        conv(("user", "x" * 21), ("assistant", "too long a prompt")),
        conv(("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2")),
        conv(("user", "q1"), ("assistant", "the same prompt again")),
        conv(("user", "q3"), ("assistant", "  ")),
        conv(("user", "q4"), ("assistant", "a4")),
        conv(("user", "q5"), ("assistant", "a5")),
    ]
    out = first_exchanges(pool, 2, held, max_prompt_chars=20)
    assert out == [conv(("user", "q1"), ("assistant", "a1")), conv(("user", "q4"), ("assistant", "a4"))]
    assert len(first_exchanges(pool, 10, held, 20)) == 3
