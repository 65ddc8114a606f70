"""Where a rank's time goes, as a tree: py-spy's raw samples of one process, seconds per frame.

    python benchmarks/tools/stack_tree.py SAMPLES-rank0.txt --under before_chain --min-s 0.3
    python benchmarks/tools/stack_tree.py A.txt B.txt --under compile_submod --not-under before_chain

Reads the samples of one thread (by default the rank's main thread) from files written by
``py-spy record --format raw`` (``model_suite.py --split --profile-ranks``, ``cold_start.py
--profile-ranks``), keeps those whose stack holds a frame matching ``--under`` (and none
matching ``--not-under``), re-roots each at its outermost such frame, and prints the call
tree with inclusive seconds (samples ÷ ``--rate``), children largest first, down to
``--min-s``. py-spy drops samples it cannot read in time (its log counts them as errors), so
compare shares of a tree, not its seconds, between runs. Frames are shown as py-spy names
them, ``function (file)``, the line dropped so that calls from one function add up.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

_LINE = re.compile(r"(?:process (\d+):\"[^\"]*\";)?thread \((\d+)\)(?:: ([^;]*))?;(.*) (\d+)$")
_FRAME_LINE = re.compile(r":\d+\)$")


def read(path: Path) -> dict[str, Counter]:
    """Thread id -> Counter of stacks (tuples of frames, root first)."""
    threads: dict[str, Counter] = defaultdict(Counter)
    for line in path.read_text(errors="replace").splitlines():
        match = _LINE.match(line)
        if not match:
            continue
        frames = tuple(_FRAME_LINE.sub(")", frame) for frame in match.group(4).split(";") if frame)
        name = match.group(2) + (f" {match.group(3)}" if match.group(3) else "")
        threads[name][frames] += int(match.group(5))
    return threads


def tree(stacks: Counter, under: str | None, not_under: str | None) -> dict:
    root: dict = {"n": 0, "kids": {}}
    for frames, count in stacks.items():
        if not_under and any(not_under in frame for frame in frames):
            continue
        if under:
            start = next((i for i, frame in enumerate(frames) if under in frame), None)
            if start is None:
                continue
            frames = frames[start:]
        node = root
        node["n"] += count
        for frame in frames:
            node = node["kids"].setdefault(frame, {"n": 0, "kids": {}})
            node["n"] += count
    return root


def show(node: dict, rate: float, min_s: float, depth: int = 0, max_depth: int = 60) -> None:
    for frame, kid in sorted(node["kids"].items(), key=lambda item: -item[1]["n"]):
        seconds = kid["n"] / rate
        if seconds < min_s or depth > max_depth:
            continue
        own = (kid["n"] - sum(k["n"] for k in kid["kids"].values())) / rate
        print(f"{'  ' * depth}{seconds:7.2f}s (own {own:5.2f}) {frame}")
        show(kid, rate, min_s, depth + 1, max_depth)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("samples", nargs="+", type=Path)
    p.add_argument("--under", default=None, help="keep samples with a frame containing this text; root there")
    p.add_argument("--not-under", default=None, help="drop samples with a frame containing this text")
    p.add_argument("--thread", default=None,
                   help="thread id (default: the main thread, else the one with the most samples)")
    p.add_argument("--rate", type=float, default=50.0, help="py-spy's samples per second (default 50)")
    p.add_argument("--min-s", type=float, default=0.3)
    p.add_argument("--max-depth", type=int, default=60)
    args = p.parse_args()
    for path in args.samples:
        threads = read(path)
        if not threads:
            print(f"{path}: no samples")
            continue
        named = [t for t in threads if t.endswith(" MainThread")]
        tid = next((t for t in threads if t.split()[0] == args.thread), None) if args.thread else (
            named[0] if named else max(threads, key=lambda t: sum(threads[t].values())))
        root = tree(threads[tid], args.under, args.not_under)
        print(f"== {path.name}: thread {tid}, {root['n'] / args.rate:.1f}s kept")
        show(root, args.rate, args.min_s, max_depth=args.max_depth)


if __name__ == "__main__":
    main()
