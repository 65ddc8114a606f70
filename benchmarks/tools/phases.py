"""Compare where compile time went, phase by phase, between cold-start runs.

    python benchmarks/tools/phases.py benchmarks/results/gpu-small-mac-s12-a1.json \
        benchmarks/results/gpu-small-mac-s12-d.json

For each results JSON (``cold_start.py``), takes the rank that compiled the most FX graphs
in each run (the leader; the only rank of a one-rank reference) and prints its timed phases
(``cold_start_job.py``'s ``phases``: Dynamo's and Inductor's ``dynamo_timed`` totals) side
by side, with the ratio of each run to the first. Phases nest, so a column does not add up;
a phase that grew points at where a slower compile spent its time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def compiling_ranks(path: str) -> list[tuple[str, dict]]:
    """(label, rank) for the compiling rank of every run in a results JSON."""
    raw = json.loads(Path(path).read_text())
    runs = [("alone", run) for run in raw.get("references", {}).get("alone", []) if "from" not in raw["references"]]
    runs += [(row["row"][:3], run) for row in raw.get("rows", []) for run in row["runs"]]
    found = []
    for i, (label, run) in enumerate(runs):
        leader = max(run["ranks"], key=lambda r: (r["fx_misses"], r["cpu_s"]))
        if "phases" in leader:
            found.append((f"{Path(path).stem} {label} #{i} r{leader['rank']}", leader))
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="benchmarks/results/<label>.json files")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    columns = [found for path in args.results for found in compiling_ranks(path)]
    if not columns:
        raise SystemExit("no run with phases (cold_start_job.py records them in each rank's JSON)")
    first = columns[0][1]["phases"]
    names = sorted(first, key=lambda name: -first[name][0])[: args.top]
    print("| phase | " + " | ".join(label for label, _ in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for rank_label, rank in [("step 1 (s)", "own_step1_s"), ("CPU-s", "cpu_s")]:
        print(f"| {rank_label} | " + " | ".join(f"{r[rank]:.1f}" for _, r in columns) + " |")
    for name in names:
        cells = []
        for _, rank in columns:
            secs, calls = rank["phases"].get(name, [0.0, 0])
            ratio = f" ({secs / first[name][0]:.2f}×)" if first[name][0] and rank is not columns[0][1] else ""
            cells.append(f"{secs:.1f} s / {calls}{ratio}")
        print(f"| `{name}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
