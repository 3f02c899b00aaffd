"""Benchmark plots (matplotlib, PNG): accept-length histogram, acceptance by depth, speedup bars.

Input is the list of result rows that :func:`selfdraft.benchmark.run_benchmark` returns (the
``results`` of its JSON file), so old JSON files can be re-plotted.
"""

from __future__ import annotations

from pathlib import Path


def plot_benchmark(rows: list[dict], out_dir: str | Path, title: str = "") -> list[Path]:
    """Write ``accept_lengths.png``, ``acceptance_by_depth.png`` and ``speedup.png``; returns their paths.

    Decoders without draft statistics (HF, plain) are left out of the first two plots.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    drafted = [r for r in rows if r.get("accept_length_counts") and r.get("acceptance_by_depth")]
    paths = []

    # 1. accept-length histogram: share of target forwards that committed k tokens, per decoder
    fig, ax = plt.subplots(figsize=(7, 4))
    lengths = sorted({int(k) for r in drafted for k in r["accept_length_counts"]}) or [1]
    width = 0.8 / max(len(drafted), 1)
    for i, r in enumerate(drafted):
        counts = {int(k): v for k, v in r["accept_length_counts"].items()}
        total = sum(counts.values()) or 1
        xs = [k + (i - (len(drafted) - 1) / 2) * width for k in lengths]
        ax.bar(xs, [counts.get(k, 0) / total for k in lengths], width, label=f"{r['decoder']} (tau {r['tau']:.2f})")
    ax.set(xlabel="accept length (tokens per target forward)", ylabel="share of target forwards",
           title=f"Accept lengths {title}".strip(), xticks=lengths)
    if drafted:
        ax.legend(fontsize=8)
    paths.append(_save(fig, out / "accept_lengths.png"))

    # 2. acceptance rate at each draft depth
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in drafted:
        acc = r["acceptance_by_depth"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=r["decoder"])
    depth = max([len(r["acceptance_by_depth"]) for r in drafted] + [1])
    ax.set(xlabel="draft depth", ylabel="P(accept | depth reached)", ylim=(0, 1.05), xticks=range(1, depth + 1),
           title=f"Acceptance by depth {title}".strip())
    if drafted:
        ax.legend(fontsize=8)
    paths.append(_save(fig, out / "acceptance_by_depth.png"))

    # 3. speedup vs HF generate (tokens/s when the table has no 'hf' row)
    fig, ax = plt.subplots(figsize=(7, 4))
    has_hf = any(r.get("speedup_vs_hf") is not None for r in rows)
    values = [r["speedup_vs_hf"] if has_hf else r["tokens_per_s"] for r in rows]
    ax.bar([r["decoder"] for r in rows], values, color="#4c72b0")
    if has_hf:
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set(ylabel="speedup vs HF generate" if has_hf else "tokens/s", title=f"Speed {title}".strip())
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", fontsize=8)
    paths.append(_save(fig, out / "speedup.png"))
    return paths


def _save(fig: object, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
