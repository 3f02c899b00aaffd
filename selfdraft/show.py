"""Showing what the draft did: each generated token coloured by where it came from.

Sources are the ones ``generate`` reports per token (see ``GenerationOutput.sources``):
'draft' (a draft token the target accepted), 'correction' (the target's own token after a
rejection), 'bonus' (the target's extra token after a fully accepted path) and 'target' (no draft
was proposed, e.g. the prefill token). Everything here is a pure function of (token texts, sources)
except :class:`TokenTexts`, which holds the incremental decoding state while streaming.
"""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from selfdraft.heads.artifact import write_text_atomic
from selfdraft.stats import acceptance_rates

SOURCES = ("draft", "correction", "bonus", "target")

ANSI = {"draft": "\x1b[32m", "correction": "\x1b[31m", "bonus": "\x1b[36m", "target": ""}
"""Foreground colours: green, red, cyan, terminal default."""
ANSI_RESET = "\x1b[0m"

LABELS = {
    "draft": "accepted draft token",
    "correction": "target correction (draft rejected)",
    "bonus": "bonus token (whole draft path accepted)",
    "target": "target token (no draft)",
}

CSS_COLORS = {"draft": "#b7f5b0", "correction": "#ffb3a7", "bonus": "#a9d8ff", "target": "#ffffff"}
"""Background colours of the HTML spans (light, so the text stays readable)."""


class TokenTexts:
    """Incremental detokenizer: the text each new token adds to the decoded reply.

    Pieces concatenate to ``tokenizer.decode(all_tokens, skip_special_tokens=True)``. A token that
    ends inside a multi-byte character gets '' and the completed character goes to the next token.
    """

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""

    def push(self, tokens: Sequence[int]) -> list[str]:
        pieces = []
        for tok in tokens:
            self.tokens.append(int(tok))
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                pieces.append("")
                continue
            pieces.append(text[len(self.text):])
            self.text = text
        return pieces


def token_texts(tokenizer: object, tokens: Sequence[int]) -> list[str]:
    """Per-token text of a finished generation (see :class:`TokenTexts`)."""
    return TokenTexts(tokenizer).push(tokens)


def _check(pieces: Sequence[str], sources: Sequence[str]) -> None:
    if len(pieces) != len(sources):
        raise ValueError(f"{len(pieces)} token texts but {len(sources)} sources")
    unknown = sorted(set(sources) - set(SOURCES))
    if unknown:
        raise ValueError(f"unknown token source(s) {unknown}; known: {SOURCES}")


def ansi_text(pieces: Sequence[str], sources: Sequence[str]) -> str:
    """Terminal text with each token coloured by its source (ANSI escape codes)."""
    _check(pieces, sources)
    out = []
    for piece, src in zip(pieces, sources):
        out.append(f"{ANSI[src]}{piece}{ANSI_RESET}" if ANSI[src] and piece else piece)
    return "".join(out)


def ansi_legend() -> str:
    """One line naming the colour of each source, coloured itself."""
    return "  ".join(f"{ANSI[s]}{LABELS[s]}{ANSI_RESET}" if ANSI[s] else LABELS[s] for s in SOURCES)


def summary(stats: object) -> dict:
    """The numbers shown under a page: tau, tokens/s, accept-length counts, acceptance by depth.

    ``stats`` is a :class:`selfdraft.stats.GenerationStats` (or anything with the same fields).
    """
    counts = Counter(stats.accept_lengths)
    return {
        "new_tokens": stats.new_tokens,
        "tau": stats.tau,
        "tokens_per_s": stats.tokens_per_s,
        "target_forwards": stats.steps,
        "accept_length_counts": {int(k): counts[k] for k in sorted(counts)},
        "acceptance_by_depth": acceptance_rates(stats.depth_attempts, stats.depth_accepts),
    }


PAGE_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #111; background: #fff; }
h1 { font-size: 20px; margin: 0 0 12px; }
.prompt { background: #f2f2f2; padding: 8px 12px; border-radius: 4px; white-space: pre-wrap; }
.text { font-family: ui-monospace, monospace; font-size: 15px; line-height: 1.7; white-space: pre-wrap;
        border: 1px solid #ccc; padding: 12px; border-radius: 4px; }
.tok { border-radius: 2px; }
.tok.draft, .tok.correction, .tok.bonus { box-shadow: inset -1px 0 0 rgba(0, 0, 0, 0.18); }
.legend span.tok { display: inline-block; padding: 2px 8px; margin: 0 8px 6px 0; border: 1px solid #bbb; }
table { border-collapse: collapse; margin-top: 12px; }
td, th { border: 1px solid #ccc; padding: 3px 10px; text-align: left; }
""" + "".join(f".tok.{s} {{ background: {c}; }}\n" for s, c in CSS_COLORS.items())


def _label(key: str) -> str:
    return "tokens/s" if key == "tokens_per_s" else str(key).replace("_", " ")


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) or "-"
    if isinstance(value, list):
        return " / ".join(_fmt(v) for v in value) or "-"
    return str(value)


def html_page(
    pieces: Sequence[str],
    sources: Sequence[str],
    stats: dict | None = None,
    title: str = "selfdraft: what the draft did",
    prompt: str | None = None,
) -> str:
    """A standalone HTML page (inline CSS, no scripts): one ``<span class="tok SOURCE">`` per token.

    ``stats`` is a flat dict of numbers shown in a table under the text (e.g. :func:`summary`).
    """
    _check(pieces, sources)
    esc = html.escape
    spans = "".join(f'<span class="tok {s}" title="{s}">{esc(p)}</span>' for p, s in zip(pieces, sources))
    counts = Counter(sources)
    legend = "".join(
        f'<span class="tok {s}">{esc(LABELS[s])}: {counts.get(s, 0)}</span>' for s in SOURCES
    )
    rows = "".join(f"<tr><th>{esc(_label(k))}</th><td>{esc(_fmt(v))}</td></tr>" for k, v in (stats or {}).items())
    prompt_html = f'<p>Prompt</p><div class="prompt">{esc(prompt)}</div><p>Reply</p>' if prompt is not None else ""
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{esc(title)}</title>\n<style>{PAGE_CSS}</style>\n</head>\n<body>\n"
        f"<h1>{esc(title)}</h1>\n<p class=\"legend\">{legend}</p>\n{prompt_html}"
        f"<div class=\"text\">{spans}</div>\n"
        f"<table class=\"summary\">{rows}</table>\n</body>\n</html>\n"
    )


def write_page(path: str | Path, page: str) -> Path:
    """Write ``page`` atomically (a temp file in the same folder, then a rename); makes the folder."""
    return write_text_atomic(path, page)
