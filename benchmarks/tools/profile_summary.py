"""Where a cold-start job's time goes: py-spy samples of ``cold_start.py --profile``, by phase.

    python benchmarks/cold_start.py --label L --rows d e --profile prof ...   # samples every job
    python benchmarks/cold_start.py --label L --rows a d --profile-ranks prof ...  # or each rank's process
    python benchmarks/tools/profile_summary.py benchmarks/results/L.json            # this table

For each profiled run, takes the main thread of the leader (the rank that compiled
graphs) and of one follower, and puts every sample (idle ones included: py-spy ran
with ``--idle``) in the first phase below whose frames it contains, so the phases add
up to the thread's whole life (on a GPU, with the autograd engine's thread in place of
the main thread's wait for it). Prints seconds per phase, one column per run.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

#: Phase -> frame substrings; a sample goes to the first phase with a match anywhere in its stack
#: (OWN_WORK is told apart by :func:`coordinator_own`).
OWN_WORK = "coordinator's own work (hooks, packing, loading)"
PHASES = [
    ("coordinator store calls", ["coordinator/protocol/stores/"]),
    ("coordinator waits for another rank", ["wait (coordinator/protocol/waiting.py"]),
    ("imports", ["_find_and_load"]),
    (OWN_WORK, []),
    ("C++ kernel compile (gcc, in this process)", ["cpp_builder.py"]),
    ("Inductor waits on compile workers", ["async_compile.py", "concurrent/futures"]),
    ("Triton kernels (load, launch, tune)", ["triton_heuristics.py", "triton/runtime"]),
    ("Inductor (lowering, codegen, cache)", ["torch/_inductor/"]),
    ("AOTAutograd", ["torch/_functorch/"]),
    ("Dynamo tracing", ["torch/_dynamo/"]),
    ("coordinator frames around Inductor's work (its wrappers)", ["coordinator/"]),
    ("torch.distributed (init, barrier, collectives)", ["torch/distributed/"]),
    ("other (step 1 itself, Python)", [""]),
]
#: The main thread's wait for the autograd engine, and the root frame of the engine thread's
#: Python stacks (see :func:`main_thread_phases`).
_ENGINE_WAIT = "_engine_run_backward (torch/autograd/graph.py"
_ENGINE_ROOT = "BackwardCFunction.apply (torch/autograd/function.py"
ENGINE_OUTSIDE_PYTHON = "autograd engine outside Python (backward kernels)"
_STAGE = re.compile(r"CUDABackend\.(make_\w+)")
# A sample: with --profile, the chain of processes from the one py-spy started ("process
# PID:\"cmd\";"; none in a rank's own file from --profile-ranks), then "thread (TID)[: name]",
# the frames root first, and the count.
_LINE = re.compile(r"(?:process (\d+):\"[^\"]*\";)?thread \((\d+)\)[^;]*;(.*) (\d+)$")


def coordinator_own(frames: list[str]) -> bool:
    """Whether the coordinator, not Inductor or Triton, does the work of this sample: no torch
    or Triton frame below its deepest coordinator frame. A hook that wraps an Inductor
    function (``_compat.triton_tuning_hooks``) has Inductor below it, so its samples are
    Inductor's; what the coordinator adds around the call (hashing, packing, routing) is its own."""
    deepest = max((i for i, frame in enumerate(frames) if "coordinator/" in frame), default=None)
    if deepest is None:
        return False
    return not any("torch/" in frame or "triton/" in frame for frame in frames[deepest + 1:])


def phase_of(stack: str) -> str:
    """The phase of one sample's stack (frames root first, ``;``-separated)."""
    for name, needles in PHASES:
        if name == OWN_WORK:
            if coordinator_own(stack.split(";")):
                return name
        elif any(n in stack for n in needles):
            return name
    raise AssertionError("the last phase matches every stack")


def triton_stage(stack: str) -> str:
    """Where in Triton a sample of the Triton phase is: a compiler stage (``make_llir``:
    LLVM in this process; ``make_cubin``: waiting for ptxas, a child process), the rest
    of a compile, a GPU benchmark, or anything else (loading, launching)."""
    stages = _STAGE.findall(stack)
    if stages:
        return f"compile: {stages[-1]}"
    if "compile (triton/compiler/compiler.py" in stack:
        return "compile: other"
    return "benchmark" if "benchmark" in stack else "load, launch, other"


def main_thread_phases(profile: Path, pid: int, rate: float, details: list[str] | tuple[str, ...] = ()
                       ) -> tuple[Counter, dict[str, Counter], Counter]:
    """Seconds per phase of process ``pid``'s main thread; for each phase named (by its name's
    start) in ``details``, that phase's seconds by their innermost frames; and the Triton
    phase's seconds by :func:`triton_stage`. One read.

    On a GPU, ``loss.backward()`` runs the backward graph, and so compiles it, on the
    autograd engine's device thread while the main thread waits in ``_engine_run_backward``
    (its innermost Python frame). That wait is replaced by the engine thread's samples
    (stacks rooted at ``BackwardCFunction.apply``); what the wait held beyond them, the
    engine outside Python, is its own phase. On CPU the engine runs on the main thread: its
    Python frames are the main thread's, and the engine outside Python is the main thread's
    samples with ``_engine_run_backward`` innermost (backward kernels in C++)."""
    seconds: Counter = Counter()
    frames: dict[str, Counter] = {detail: Counter() for detail in details}
    stages: Counter = Counter()
    backward_wait = engine = 0.0
    for line in profile.read_text(errors="replace").splitlines():
        m = _LINE.search(line)
        if not m or (m.group(1) is not None and int(m.group(1)) != pid):
            continue
        stack, count = m.group(3), int(m.group(4))
        if int(m.group(2)) != pid:
            if not stack.startswith(_ENGINE_ROOT):
                continue
            engine += count / rate
        elif stack.rsplit(";", 1)[-1].startswith(_ENGINE_WAIT):  # the main thread in C++ autograd
            backward_wait += count / rate
            continue
        phase = phase_of(stack)
        seconds[phase] += count / rate
        if phase.startswith("Triton"):
            stages[triton_stage(stack)] += count / rate
        for detail in details:
            if phase.startswith(detail):
                frames[detail][" <- ".join(stack.split(";")[::-1][:4])] += count / rate
    seconds[ENGINE_OUTSIDE_PYTHON] += max(0.0, backward_wait - engine)
    return seconds, frames, stages


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+",
                   help="benchmarks/results/<label>.json of runs with --profile or --profile-ranks")
    p.add_argument("--rate", type=float, default=50.0, help="py-spy's sampling rate (cold_start.py uses 50)")
    p.add_argument("--profiles", default=None, metavar="DIR",
                   help="look for each sample file here, by its name, when it is not at its recorded path "
                        "(samples taken on another machine)")
    p.add_argument("--detail", action="append", default=[], metavar="PHASE",
                   help="also list the innermost frames of this phase (by its name's start), per column")
    p.add_argument("--triton-stages", action="store_true", help="also tabulate the Triton phase by compiler stage")
    args = p.parse_args()
    columns, details, stages = [], [], []
    for results in args.results:
        label = f"{Path(results).stem} " if len(args.results) > 1 else ""
        for row in json.loads(Path(results).read_text())["rows"]:
            for index, run in enumerate(row["runs"]):
                ranks = sorted(run["ranks"], key=lambda r: r["rank"])
                leaders = [r for r in ranks if r["fx_misses"] > 0]
                followers = [r for r in ranks if r["fx_misses"] == 0]
                title = f"{label}{row['row'][:3]} N={row['n']} run {index + 1} ({run['all_done_s']:.1f}s)"
                for role, who in (("leader", leaders[:1]), ("follower", followers[:1])):
                    profile = who and (who[0].get("profile") or run.get("profile"))
                    if profile and args.profiles and not Path(profile).exists():
                        profile = str(Path(args.profiles) / Path(profile).name)
                    if not profile or not Path(profile).exists():
                        continue
                    r = who[0]
                    name = f"{title} {role} r{r['rank']} step1 {r['step1_s']:.1f}s"
                    seconds, frames, by_stage = main_thread_phases(Path(profile), r["pid"], args.rate, args.detail)
                    columns.append((name, seconds))
                    stages.append((name, by_stage))
                    details += [(name, detail, frames[detail]) for detail in args.detail]
    if not columns:
        raise SystemExit(f"no profiled runs in {' '.join(args.results)}")
    print("| phase (main thread, s) | " + " | ".join(title for title, _ in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for phase in [name for name, _ in PHASES] + [ENGINE_OUTSIDE_PYTHON]:
        print(f"| {phase} | " + " | ".join(f"{c[phase]:.1f}" for _, c in columns) + " |")
    print("| total sampled | " + " | ".join(f"{sum(c.values()):.1f}" for _, c in columns) + " |")
    if args.triton_stages:
        print("\n| Triton phase by stage (s) | " + " | ".join(name for name, _ in stages) + " |")
        print("|---" * (len(stages) + 1) + "|")
        for stage in sorted(set().union(*(frames for _, frames in stages))):
            print(f"| {stage} | " + " | ".join(f"{frames[stage]:.1f}" for _, frames in stages) + " |")
    for name, detail, frames in details:
        print(f"\n{name}, {detail}... (innermost frames first, seconds):")
        for stack, sec in frames.most_common(12):
            print(f"  {sec:6.2f}  {stack}")


if __name__ == "__main__":
    main()
