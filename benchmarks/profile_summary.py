"""Where a cold-start job's time goes: py-spy samples of ``cold_start.py --profile``, by phase.

    python benchmarks/cold_start.py --label L --rows d e --profile prof ...   # samples every job
    python benchmarks/profile_summary.py benchmarks/results/L.json            # this table

For each profiled run, takes the main thread of the leader (the rank that compiled
graphs) and of one follower, and puts every sample (idle ones included: py-spy ran
with ``--idle``) in the first phase below whose frames it contains, so the phases add
up to the thread's whole life. Prints seconds per phase, one column per run.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

#: Phase -> frame substrings; a sample goes to the first phase with a match anywhere in its stack.
PHASES = [
    ("coordinator store calls", ["coordinator/stores/"]),
    ("coordinator waits for another rank", ["_wait (coordinator/singleflight.py"]),
    ("imports", ["_find_and_load"]),
    ("C++ kernel compile (gcc, in this process)", ["cpp_builder.py"]),
    ("Inductor waits on compile workers", ["async_compile.py", "concurrent/futures"]),
    ("Triton kernels (load, launch, tune)", ["triton_heuristics.py", "triton/runtime"]),
    ("Inductor (lowering, codegen, cache)", ["torch/_inductor/"]),
    ("AOTAutograd", ["torch/_functorch/"]),
    ("Dynamo tracing", ["torch/_dynamo/"]),
    ("coordinator other (packing, loading, hooks)", ["coordinator/"]),
    ("torch.distributed (init, barrier, collectives)", ["torch/distributed/"]),
    ("other (step 1 itself, Python)", [""]),
]
# A sample: the chain of processes from the one py-spy started ("process PID:\"cmd\";"),
# then "thread (TID)[: name]", the frames root first, and the count.
_LINE = re.compile(r"process (\d+):\"[^\"]*\";thread \((\d+)\)[^;]*;(.*) (\d+)$")


def main_thread_phases(profile: Path, pid: int, rate: float, detail: str | None = None,
                       frames: Counter | None = None) -> Counter:
    """Seconds per phase of process ``pid``'s main thread; with ``detail``, also adds
    that phase's samples to ``frames`` by their innermost frames."""
    seconds: Counter = Counter()
    for line in profile.read_text(errors="replace").splitlines():
        m = _LINE.search(line)
        if not m or int(m.group(1)) != pid or int(m.group(2)) != pid:
            continue
        stack, count = m.group(3), int(m.group(4))
        phase = next(name for name, needles in PHASES if any(n in stack for n in needles))
        seconds[phase] += count / rate
        if detail and frames is not None and phase.startswith(detail):
            frames[" <- ".join(stack.split(";")[::-1][:4])] += count / rate
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="benchmarks/results/<label>.json of a run with --profile")
    p.add_argument("--rate", type=float, default=50.0, help="py-spy's sampling rate (cold_start.py uses 50)")
    p.add_argument("--detail", action="append", default=[], metavar="PHASE",
                   help="also list the innermost frames of this phase (by its name's start), per column")
    args = p.parse_args()
    raw = json.loads(Path(args.results).read_text())
    columns, details = [], []
    for row in raw["rows"]:
        for index, run in enumerate(row["runs"]):
            if not run.get("profile") or not Path(run["profile"]).exists():
                continue
            ranks = sorted(run["ranks"], key=lambda r: r["rank"])
            leaders = [r for r in ranks if r["fx_misses"] > 0]
            followers = [r for r in ranks if r["fx_misses"] == 0]
            title = f"{row['row'][:3]} N={row['n']} run {index + 1} ({run['all_done_s']:.1f}s)"
            for role, who in (("leader", leaders[:1]), ("follower", followers[:1])):
                if who:
                    r = who[0]
                    name = f"{title} {role} r{r['rank']} step1 {r['step1_s']:.1f}s"
                    for detail in args.detail:
                        frames: Counter = Counter()
                        main_thread_phases(Path(run["profile"]), r["pid"], args.rate, detail, frames)
                        details.append((name, detail, frames))
                    columns.append((name, main_thread_phases(Path(run["profile"]), r["pid"], args.rate)))
    if not columns:
        raise SystemExit(f"no profiled runs in {args.results}")
    print("| phase (main thread, s) | " + " | ".join(title for title, _ in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for phase, _ in PHASES:
        print(f"| {phase} | " + " | ".join(f"{c[phase]:.1f}" for _, c in columns) + " |")
    print("| total sampled | " + " | ".join(f"{sum(c.values()):.1f}" for _, c in columns) + " |")
    for name, detail, frames in details:
        print(f"\n{name}, {detail}... (innermost frames first, seconds):")
        for stack, sec in frames.most_common(12):
            print(f"  {sec:6.2f}  {stack}")


if __name__ == "__main__":
    main()
