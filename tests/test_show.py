"""``--show-draft``: per-token texts, ANSI colours, the HTML page's spans, and the page in a real browser."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import char_tokenizer, tiny_model

from selfdraft.drafters import build_drafter
from selfdraft.generate import GenerationConfig, generate
from selfdraft.show import (
    ANSI,
    ANSI_RESET,
    CSS_COLORS,
    SOURCES,
    ansi_text,
    html_page,
    summary,
    token_texts,
    write_page,
)
from selfdraft.stats import acceptance_rates

CHROMIUM = shutil.which("chromium")


class SpanParser(HTMLParser):
    """Collects (classes, text) of every token span inside ``<div class="text">``."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[tuple[list[str], str]] = []
        self.in_text = False
        self.current: list[str] | None = None
        self.buf = ""

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class", "").split()
        if tag == "div" and "text" in cls:
            self.in_text = True
        elif tag == "span" and self.in_text:
            assert self.current is None, "nested span inside a token span"
            self.current, self.buf = cls, ""

    def handle_endtag(self, tag):
        if tag == "span" and self.current is not None:
            self.spans.append((self.current, self.buf))
            self.current = None
        elif tag == "div" and self.in_text:
            self.in_text = False

    def handle_data(self, data):
        if self.current is not None:
            self.buf += data


def parse_spans(page: str) -> list[tuple[list[str], str]]:
    p = SpanParser()
    p.feed(page)
    p.close()
    return p.spans


class ByteTokenizer:
    """Token id = one UTF-8 byte, so a multi-byte character spans several tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def drafted():
    """A real generation on the tiny llama whose sources include accepted drafts and target tokens."""
    tok = char_tokenizer()
    model = tiny_model("llama")
    ids = tok.apply_chat_template([{"role": "user", "content": "abc<&>abc abc"}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    drafter = build_drafter("prompt_lookup", model)
    out = generate(model, ids, drafter, GenerationConfig(max_new_tokens=40), eos_token_ids=(2,))
    return tok, out


def test_token_texts_concatenate_and_hold_partial_characters():
    """Guards per-token texts that drop or duplicate text, or show half a multi-byte character."""
    ids = list("aé€b".encode())
    pieces = token_texts(ByteTokenizer(), ids)
    assert len(pieces) == len(ids), (pieces, ids)
    assert "".join(pieces) == "aé€b", pieces
    assert pieces == ["a", "", "é", "", "", "€", "b"], pieces


def test_token_texts_match_tokenizer_decode(drafted):
    """Guards the streamed text drifting from the decoded reply."""
    tok, out = drafted
    pieces = token_texts(tok, out.tokens)
    assert "".join(pieces) == tok.decode(out.tokens, skip_special_tokens=True)


def test_html_spans_follow_the_generation_sources(drafted):
    """Guards the page mislabelling tokens: one span per token, class = source, in generation order."""
    tok, out = drafted
    assert {"draft", "target"} <= set(out.sources), f"generation drafted nothing: {out.sources}"
    pieces = token_texts(tok, out.tokens)
    spans = parse_spans(html_page(pieces, out.sources, summary(out.stats)))
    assert [c for c, _ in spans] == [["tok", s] for s in out.sources], (spans, out.sources)
    assert [t for _, t in spans] == pieces


def test_html_escapes_markup_in_tokens():
    """Guards token text being injected as HTML (a '<' token would swallow the rest of the page)."""
    pieces = ["<b>", "&amp;", " x>y ", '"q"']
    sources = ["draft", "correction", "bonus", "target"]
    page = html_page(pieces, sources, {"tau": 1.5}, prompt="<script>alert(1)</script>")
    assert "<b>" not in page and "<script>" not in page
    assert "&lt;b&gt;" in page and "&amp;amp;" in page
    assert parse_spans(page) == [(["tok", s], p) for p, s in zip(pieces, sources)]


def test_html_summary_shows_tau_and_accept_lengths(drafted):
    """Guards the page summary: tau, tokens/s and accept-length counts are on the page."""
    tok, out = drafted
    page = html_page(token_texts(tok, out.tokens), out.sources, summary(out.stats))
    assert "tau" in page and "tokens/s" in page and "accept length counts" in page
    assert f"{out.stats.tau:.2f}" in page
    counts = summary(out.stats)["accept_length_counts"]
    assert sum(counts.values()) == out.stats.steps, counts


def test_acceptance_by_depth_stops_at_the_deepest_depth_reached():
    """Guards reporting 0% acceptance for depths no draft ever reached (they were never tried)."""
    assert acceptance_rates([10, 4, 0, 0], [4, 0, 0, 0]) == [0.4, 0.0]
    assert acceptance_rates([], []) == []


def test_ansi_text_colours_each_token_by_source():
    """Guards terminal colours: each coloured source wrapped in its own code and reset, target plain."""
    pieces, sources = ["a", "b", "c", "d"], ["draft", "correction", "bonus", "target"]
    text = ansi_text(pieces, sources)
    for p, s in zip(pieces, sources):
        expected = f"{ANSI[s]}{p}{ANSI_RESET}" if ANSI[s] else p
        assert expected in text, (s, repr(text))
    assert text.endswith(ANSI_RESET + "d")
    with pytest.raises(ValueError, match="unknown token source"):
        ansi_text(["a"], ["guess"])


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "selfdraft.cli", *args], capture_output=True, text=True, timeout=180)


def test_cli_html_page_matches_json_output(tiny_target_dir, tmp_path):
    """Guards the --html page against the generation it claims to show (spans vs the --json sources)."""
    page = tmp_path / "sub" / "draft.html"
    proc = run_cli("generate", "--target", str(tiny_target_dir), "--dtype", "float32", "--prompt", "abc<&>abc abc",
                   "--max-new-tokens", "30", "--drafter", "prompt_lookup", "--json", "--html", str(page), "--quiet")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    spans = parse_spans(page.read_text())
    assert [c[1] for c, _ in spans] == result["sources"]
    assert "".join(t for _, t in spans) == result["text"]
    assert "draft" in result["sources"], result["sources"]


def _screenshot(html_file: Path, png: Path, profile: Path) -> None:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", f"--screenshot={png}", "--window-size=800,600", html_file.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and png.is_file(), f"chromium exit {proc.returncode}: {proc.stderr[-1500:]}"


def _pixels_near(img, rgb: tuple[int, int, int], tol: int = 6) -> int:
    return sum(n for n, c in img.getcolors(800 * 600) if all(abs(a - b) <= tol for a, b in zip(c[:3], rgb)))


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/setup.sh installs it)")
def test_page_renders_coloured_spans_in_headless_chromium(tmp_path):
    """Guards a page that parses but renders blank or uncoloured in a real browser."""
    from PIL import Image

    words = [f"word{i} " for i in range(60)]
    sources = [SOURCES[i % 3] for i in range(60)]  # draft, correction, bonus in turn
    coloured = write_page(tmp_path / "coloured.html", html_page(words, sources, {"tau": 2.0}))
    plain = write_page(tmp_path / "plain.html", html_page(words, ["target"] * 60, {"tau": 1.0}))
    shots = {}
    for name, page in (("coloured", coloured), ("plain", plain)):
        png = tmp_path / f"{name}.png"
        _screenshot(page, png, tmp_path / f"profile-{name}")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{png} is not a PNG"
        img = Image.open(png).convert("RGB")
        assert img.size == (800, 600), img.size
        shots[name] = img
    img = shots["coloured"]
    assert len(img.getcolors(800 * 600)) > 20, "screenshot is (nearly) one colour: blank page"
    for src in ("draft", "correction", "bonus"):
        rgb = tuple(int(CSS_COLORS[src][i:i + 2], 16) for i in (1, 3, 5))
        n_col, n_plain = _pixels_near(img, rgb), _pixels_near(shots["plain"], rgb)
        # the legend shows every colour on both pages; token spans add far more on the coloured one
        assert n_col > n_plain + 2000, f"{src} {rgb}: {n_col} px coloured page vs {n_plain} px plain page"
