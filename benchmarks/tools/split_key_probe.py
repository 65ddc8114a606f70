"""Why does a split frame's chain miss the entries its shares saved? Record both keys' details.

Runs a training script (``benchmarks/model_suite_job.py`` by default) under the coordinator,
after patching AOTAutograd's cache-key function to record, for every key it computes inside a
split frame, who asked (a share compiling submodule ``i`` out of order, or the chain at
submodule ``i``), the key, its per-field details (AOTAutograd's own debug lines) and the
frame's shape environment at that moment (replacements, divisibility, guards). One JSON line
per key into ``DIR/keys-rank<N>.jsonl``; ``--compare DIR`` prints, per frame and submodule,
whether the share's key equals the chain's, and the fields that differ::

    coordinator-run --standalone --nproc-per-node 2 benchmarks/tools/split_key_probe.py --out DIR -- \\
        --model llama --size split --json DIR/job.json --cache-per-rank
    python benchmarks/tools/split_key_probe.py --compare DIR
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import logging
import os
import runpy
import sys
import threading
import weakref
from pathlib import Path

_where = threading.local()


def _shape_env_state(shape_env) -> dict:
    if shape_env is None:
        return {}
    return {
        "replacements": {str(k): str(v) for k, v in shape_env.replacements.items()},
        "divisible": sorted(str(e) for e in shape_env.divisible),
        "guards": [str(g.expr) for g in shape_env.guards],
        "ranges": {str(k): str(v) for k, v in shape_env.var_to_range.items()},
    }


def install(out: Path) -> None:
    import torch
    from torch._functorch._aot_autograd import autograd_cache

    split_frames = importlib.import_module("coordinator._compat.split_frames")

    rank = int(os.environ.get("RANK", "0"))
    sink = open(out / f"keys-rank{rank}.jsonl", "a")  # noqa: SIM115 - open for the process's life
    lock = threading.Lock()
    logger = logging.getLogger(autograd_cache.__name__)
    logger.setLevel(logging.DEBUG)  # AOTAutograd computes its debug lines only at DEBUG
    logger.propagate = False
    logger.addHandler(logging.NullHandler())

    original_key = autograd_cache.autograd_cache_key
    numbers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a split frame -> its number here
    counter = itertools.count()

    def number(frame) -> int:
        with lock:
            if frame not in numbers:
                numbers[frame] = next(counter)
            return numbers[frame]

    def autograd_cache_key(*args, **kwargs):
        key, lines = original_key(*args, **kwargs)
        share = getattr(_where, "share", None)
        position = split_frames.chain_position()
        if share is not None:
            who, frame, index = "share", share[0], share[1]
        elif position is not None and position[1] is not None:
            who, frame, index = "chain", position[0], position[1]
        else:
            return key, lines
        context = torch._guards.TracingContext.try_get()
        shape_env = context.fake_mode.shape_env if context is not None and context.fake_mode else None
        record = {"rank": rank, "who": who, "frame": number(frame), "index": index, "key": key,
                  "lines": lines, "shape_env": _shape_env_state(shape_env)}
        with lock:
            sink.write(json.dumps(record) + "\n")
            sink.flush()
        return key, lines

    autograd_cache.autograd_cache_key = autograd_cache_key
    original_init = split_frames.SplitFrame.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        number(self)  # frames numbered as this process splits them: alike on every rank

    split_frames.SplitFrame.__init__ = init
    original_compile = split_frames.SplitFrame.compile

    def compile(self, index):
        _where.share = (self, index)
        try:
            return original_compile(self, index)
        finally:
            _where.share = None

    split_frames.SplitFrame.compile = compile


def compare(directory: Path) -> None:
    records = [json.loads(line) for path in sorted(directory.glob("keys-rank*.jsonl"))
               for line in path.read_text().splitlines() if line.strip()]
    for frame in sorted({r["frame"] for r in records}):
        mine = [r for r in records if r["frame"] == frame]
        indices = sorted({r["index"] for r in mine})
        print(f"frame {frame}: {len(indices)} submodules")
        for index in indices:
            shares = [r for r in mine if r["index"] == index and r["who"] == "share"]
            chains = [r for r in mine if r["index"] == index and r["who"] == "chain"]
            if not shares or not chains:
                print(f"  {index}: shares {len(shares)}, chain lookups {len(chains)}")
                continue
            share = shares[0]
            same = [c["rank"] for c in chains if c["key"] == share["key"]]
            print(f"  {index}: share on rank {share['rank']}; chain keys equal on ranks {same} of "
                  f"{[c['rank'] for c in chains]}")
            chain = next((c for c in chains if c["key"] != share["key"]), None)
            if chain is None:
                continue
            theirs, ours = set(share["lines"]), set(chain["lines"])
            for line in sorted(theirs - ours):
                print(f"      share: {line[:600]}")
            for line in sorted(ours - theirs):
                print(f"      chain: {line[:600]}")
            for field in ("replacements", "divisible", "guards"):
                if share["shape_env"].get(field) != chain["shape_env"].get(field):
                    print(f"      shape env {field}: share {share['shape_env'].get(field)}")
                    print(f"      {' ' * (len(field) + 10)} chain {chain['shape_env'].get(field)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="where each rank writes its keys")
    parser.add_argument("--compare", type=Path, help="print the comparison of a run's keys")
    parser.add_argument("--script", default=str(Path(__file__).resolve().parents[1] / "model_suite_job.py"))
    args, rest = parser.parse_known_args()
    if args.compare:
        compare(args.compare)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    install(args.out)
    sys.argv = [args.script, *[a for a in rest if a != "--"]]
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
