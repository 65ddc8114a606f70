"""Plot cold-start ratios from ``benchmarks/cold_start.py`` output logs.

    python benchmarks/plot.py --out benchmarks/cold_start.png NAME=LOG [NAME=LOG ...]

Each LOG is the printed output of one or more ``cold_start.py`` runs (the per-row lines
``N=2 (d) compile_once, job store   21.04s (1.52x) ...``), or the Markdown it writes. One panel per NAME, two to a row: for each N,
a bar per row, height = time until all ranks finish step 1 ÷ one rank compiling alone,
with the 1.10× target drawn in. When several logs of a panel have the same row, the bar is
the last log's and the earlier ones are drawn as dots on it.

A LOG written ``LOG@REF.json[+REF.json...]`` is divided by the mean one-rank time of those
results files (each file's own (a) N=1 runs, else its references) instead of the ratio it
printed: for a run whose one-rank references were measured beside it, before and after,
on the same machine.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import textwrap
from pathlib import Path

ROW = re.compile(r"^N=(\d+) (\([a-f]\)[^\d]+?)\s+([\d.]+)s \(([\d.]+)x\)")
#: The same row in the Markdown table ``cold_start.py --out`` writes (for a run cut off
#: before it printed its summary lines).
TABLE_ROW = re.compile(r"^\| (\d+) \| (\([a-f]\)[^|]+?) \| ([\d.]+) \| ([\d.]+)× \|")


def parse(log: str, alone_s: float | None = None) -> dict[int, dict[str, float]]:
    """{N: {row: ratio}}: the ratios the log printed, or its times ÷ ``alone_s``."""
    rows: dict[int, dict[str, float]] = {}
    for line in log.splitlines():
        m = ROW.match(line.strip()) or TABLE_ROW.match(line.strip())
        if m:
            ratio = float(m.group(3)) / alone_s if alone_s else float(m.group(4))
            rows.setdefault(int(m.group(1)), {})[m.group(2).strip()] = ratio
    return rows


def one_rank_s(results: list[str]) -> float:
    """Mean one-rank time over results files: each file's (a) N=1 runs, else its references."""
    times: list[float] = []
    for path in results:
        raw = json.loads(Path(path).read_text())
        alone = [run["all_done_s"] for row in raw["rows"] if row["n"] == 1 and row["row"].startswith("(a)")
                 for run in row["runs"]]
        times += alone or [raw["references"]["alone_s"]]
    return statistics.mean(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(Path(__file__).with_name("cold_start.png")))
    p.add_argument("panels", nargs="+", help="NAME=LOG[@REF.json[+REF.json...]][,LOG...]")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(len(args.panels), 2)
    rows_of_panels = -(-len(args.panels) // cols)
    fig, axes = plt.subplots(rows_of_panels, cols, figsize=(7 * cols, 4.5 * rows_of_panels), squeeze=False)
    for ax in axes.flat[len(args.panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, args.panels):
        name, _, logs = panel.partition("=")
        rows: dict[int, dict[str, float]] = {}
        earlier: dict[int, dict[str, list[float]]] = {}
        for entry in logs.split(","):
            log, _, refs = entry.partition("@")
            alone_s = one_rank_s(refs.split("+")) if refs else None
            for n, found in parse(Path(log).read_text(), alone_s).items():
                for method, ratio in found.items():
                    if method in rows.get(n, {}):
                        earlier.setdefault(n, {}).setdefault(method, []).append(rows[n][method])
                    rows.setdefault(n, {})[method] = ratio
        methods = sorted({m for found in rows.values() for m in found})
        width = 0.8 / max(len(rows), 1)
        dot_label = "earlier run"  # once per panel
        for i, n in enumerate(sorted(rows)):
            xs = [j + i * width for j in range(len(methods))]
            heights = [rows[n].get(m, 0.0) for m in methods]
            bars = ax.bar(xs, heights, width, label=f"N={n}")
            ax.bar_label(bars, labels=[f"{h:.2f}" if h else "not run" for h in heights], fontsize=7)
            for x, m in zip(xs, methods):
                if previous := earlier.get(n, {}).get(m):
                    ax.plot([x] * len(previous), previous, "k.", markersize=5, label=dot_label)
                    dot_label = None
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.axhline(1.1, color="red", linestyle="--", linewidth=0.8, label="target 1.10×")
        ax.set_ylim(top=max(ax.get_ylim()[1], 1.25))  # room above the target line
        ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(methods))])
        ax.set_xticklabels([textwrap.fill(m, 14) for m in methods], fontsize=7)
        ax.set_ylabel("all ranks done step 1 ÷ one rank compiling alone")
        ax.set_title(textwrap.fill(name, 75), fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
