"""Any training script, stock against ours, in alternating pairs, launched the ways users launch it.

    python benchmarks/user_script.py --label gpu-user-llama-n2 --ranks 2 --pairs 2 --rows stock ours cm \\
        --cm-wrapper benchmarks/user_scripts/compile_once_wrapper.py -- benchmarks/user_scripts/user_llama_ddp.py
    python benchmarks/user_script.py --label gpu-hf-gpt2-n2 --ranks 2 -- benchmarks/user_scripts/hf_ddp.py --model gpt2
    python benchmarks/user_script.py --label probe --ranks 2 --until-step 1 \\
        --rows stock ours ours-nowarm:COORDINATOR_WARM_COMPILE_POOL=0 -- train.py

Rows, one job each per pair, on N ranks of this host (``--ranks``, one GPU each where there
are enough; the script picks its devices):

* ``stock``: ``torchrun --standalone --nproc-per-node N SCRIPT ARGS``;
* ``ours``: ``coordinator-run`` (the console script installed with the package) with the
  same arguments: the job's own store, every worker under ``compile_once``;
* ``cm``: plain ``torchrun`` running ``--cm-wrapper`` (default ``benchmarks/in_compile_once.py``,
  which enters ``compile_once`` around the script), then the script: the context-manager way.

A row may carry variables, ``NAME:VAR=VALUE,VAR=VALUE`` (``ours-nowarm:COORDINATOR_WARM_COMPILE_POOL=0``);
its launcher is its name up to the first ``-``. ``--env VAR=VALUE`` sets a variable for every job.

Every job starts in a new empty directory, its working directory, ``TMPDIR``,
``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR``: a cold start of a script run from
elsewhere. Nothing of this checkout is on the jobs' ``PYTHONPATH``: ours runs the coordinator
installed in this Python (the wheel with its dependencies, as users install it; where it
was found goes into the raw results). Pairs alternate: the first runs the rows in the order
given, the second in reverse (stock, ours, ours, stock), so that drift falls on both.

With ``--restart``, each row first runs one cold job (pair 0, ``<row> cold``), then the pairs
are restarts: a ``stock`` row restarts on the Inductor and Triton dirs its cold job left (its
own dirs, as a user's rerun on one machine), an ``ours`` or ``cm`` row restarts from the
``file://`` store its cold job filled (``COORDINATOR_STORE``, set for every job of the row),
each time on new, EMPTY dirs (a fresh node). Ratios are then to stock's restarts; the
summary adds each row's restarts against stock's cold job.

Each job's wall runs from its launch to its exit, or, with ``--until-step K``, to the moment
every rank has ended step K (the job is then stopped). Steps come from the script's own
marks on its output (``--marks``: a regex with the groups ``what`` (``start``/``end``),
``rank``, ``step`` and ``t``, seconds since the epoch; the default reads
``HFSTEP start rank=0 step=1 ... t=...``): a step's time is its longest rank's end minus
start. Step 1, and the recompile step: the last step the script marks (``--recompile-step``
names another). A script with no marks: ``--compile-records`` sets ``TORCH_TRACE`` for every
job and reads Dynamo's compile records instead (its chromium events): the span of each
rank's first compiles (frame compile ids ``F/0``, their lazy backward compiles included) and
of its recompiles (``F/1``), the longest rank.

Prints and writes (``results/<label>.json``, the label's section of ``RESULTS.md``) a row per
job, then per N and row the means and their ratio to stock's mean. ``--from-json FILE`` runs
nothing: it makes the table of the runs FILE holds (with ``--job-logs``, their steps read again
from the jobs' logs there).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import common

DEFAULT_MARKS = r"HFSTEP (?P<what>start|end) rank=(?P<rank>\d+) step=(?P<step>\d+)\b.*?\bt=(?P<t>[0-9.]+)"
IN_COMPILE_ONCE = common.BENCHMARKS / "in_compile_once.py"
LAUNCHERS = ("stock", "ours", "cm")


def parse_row(text: str) -> tuple[str, str, dict[str, str]]:
    """``NAME[:VAR=VALUE,...]`` -> (name, launcher, variables)."""
    name, _, assignments = text.partition(":")
    launcher = name.split("-", 1)[0]
    if launcher not in LAUNCHERS:
        raise SystemExit(f"row {text!r}: its name must start with one of {', '.join(LAUNCHERS)}")
    variables = dict(pair.split("=", 1) for pair in assignments.split(",") if pair)
    return name, launcher, variables


def coordinator_run() -> str:
    """The ``coordinator-run`` console script of this Python's environment."""
    found = shutil.which("coordinator-run", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                                   os.environ.get("PATH", "")]))
    if found is None:
        raise SystemExit("coordinator-run is not installed in this Python: pip install the project first")
    return found


def installed_coordinator(cwd: str) -> str:
    """Where a job's Python finds ``coordinator``, from a directory outside the checkout."""
    probe = "import coordinator; print(coordinator.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True,
                         env=clean_env(cwd))
    return out.stdout.strip() or out.stderr.strip().splitlines()[-1]


def clean_env(tmp: str, cache: str | None = None, **extra: str) -> dict[str, str]:
    """This process's environment less this checkout on ``PYTHONPATH``, with ``tmp`` for the
    job's temporary files and ``cache`` (default: in ``tmp``) for its caches, and ``extra``."""
    root = str(common.ROOT)
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != root]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    cache = cache or f"{tmp}/inductor"
    env.update(TMPDIR=tmp, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=f"{cache}/triton")
    env.update(extra)
    return env


def command(launcher: str, n: int, script: list[str], cm_wrapper: Path) -> list[str]:
    torchrun = [sys.executable, "-m", common.TORCHRUN]
    head = {"stock": torchrun, "ours": [coordinator_run()], "cm": torchrun}[launcher]
    body = [str(cm_wrapper), *script] if launcher == "cm" else script
    return [*head, "--standalone", f"--nproc-per-node={n}", *body]


class Job:
    """One launched job, its output read as it comes: the step marks, ``HFJOB`` lines and
    the coordinator's summary lines."""

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: str, marks: re.Pattern, n: int,
                 until_step: int | None) -> None:
        self.marks, self.n, self.until_step = marks, n, until_step
        self.steps: dict[int, dict[int, dict[str, float]]] = {}  # step -> rank -> {start, end}
        self.lines: list[str] = []
        self.reached = threading.Event()
        self.launched = time.time()
        self.began = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if add_marks(self.steps, self.marks, line) and self.until_step is not None \
                    and self._all_ended(self.until_step):
                self.reached.set()

    def _all_ended(self, step: int) -> bool:
        ranks = self.steps.get(step, {})
        return len(ranks) == self.n and all("end" in marks for marks in ranks.values())

    def wait(self, timeout: float) -> dict:
        """Run to the end (or to ``until_step``); the job's record."""
        deadline = self.began + timeout
        stopped = timed_out = False
        while self.proc.poll() is None:
            if self.reached.wait(timeout=0.2):
                stopped = True
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
        wall = time.monotonic() - self.began
        if self.proc.poll() is None:
            self._stop()
        self.reader.join(timeout=30)
        return {"wall_s": round(wall, 2), "returncode": self.proc.returncode, "stopped_after_step": stopped or None,
                "timed_out": timed_out, "steps": self.step_times(), "launched": self.launched,
                "ranks": [json.loads(line.split("HFJOB ", 1)[1]) for line in self.lines if "HFJOB {" in line],
                "summaries": [line.strip() for line in self.lines if "compile_once rank" in line]}

    def _stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def step_times(self) -> dict[str, float]:
        return step_times(self.steps)


def add_marks(steps: dict[int, dict[int, dict[str, float]]], marks: re.Pattern, line: str) -> bool:
    """Record the step marks in ``line`` (ranks writing at once can share a line); whether any."""
    found = False
    for mark in marks.finditer(line):
        steps.setdefault(int(mark["step"]), {}).setdefault(int(mark["rank"]), {})[mark["what"]] = float(mark["t"])
        found = True
    return found


def step_times(steps: dict[int, dict[int, dict[str, float]]]) -> dict[str, float]:
    """Each marked step's time: its longest rank's end minus start."""
    times = {}
    for step, ranks in sorted(steps.items()):
        spans = [m["end"] - m["start"] for m in ranks.values() if "start" in m and "end" in m]
        if spans:
            times[str(step)] = round(max(spans), 3)
    return times


def compile_records(trace_dir: Path) -> dict[str, float]:
    """From ``TORCH_TRACE``'s files: the longest rank's span of its first compiles (frame
    compile ids ``F/0``, as step ``1``) and of its recompiles (``F/1``, as ``2``), in seconds:
    from the first to the last of Dynamo's chromium events of those compiles, the lazy
    backward compiles of their graphs included."""
    spans: dict[str, list[float]] = {"1": [], "2": []}
    for path in trace_dir.glob("*.log"):
        lines = path.read_text(errors="replace").splitlines()
        times: dict[str, list[float]] = {"1": [], "2": []}
        for i, line in enumerate(lines):
            if '{"chromium_event"' not in line:
                continue
            head = json.loads(line[line.index("{"):])
            step = {0: "1", 1: "2"}.get(head.get("frame_compile_id"))
            payload = []
            for following in lines[i + 1:]:
                if not following.startswith("\t"):
                    break
                payload.append(following[1:])
            event = json.loads("\n".join(payload)) if payload else {}
            if step and event.get("ph") in ("B", "E") and "ts" in event:
                times[step].append(event["ts"] / 1e6)
        for step, stamps in times.items():
            if stamps:
                spans[step].append(max(stamps) - min(stamps))
    return {step: round(max(values), 3) for step, values in spans.items() if values}


def run_one(name: str, launcher: str, variables: dict[str, str], n: int, pair: int,
            args: argparse.Namespace, marks: re.Pattern, home: str | None = None) -> dict:
    """One job. ``home``: the row's dir across a restart's jobs (``--restart``): stock's
    caches, ours' ``file://`` store."""
    with tempfile.TemporaryDirectory(prefix="user-script-") as tmp:
        extra = dict(args.env, **variables)
        if args.compile_records:
            extra["TORCH_TRACE"] = f"{tmp}/trace"
        cache = None
        if home is not None and launcher == "stock":
            cache = f"{home}/inductor"
        elif home is not None:
            extra.setdefault("COORDINATOR_STORE", f"file://{home}/store")
        env = clean_env(tmp, cache, **extra)
        cmd = command(launcher, n, args.script, args.cm_wrapper)
        job = Job(cmd, env, tmp, marks, n, args.until_step)
        record = job.wait(args.timeout)
        if args.compile_records:
            record["steps"] = compile_records(Path(tmp) / "trace")
        log = common.log_file(args.job_logs, f"{args.label}-n{n}-{pair}-{name}.log")
        if log:
            log.write_text("".join(job.lines))
    if record["returncode"] not in (0, None) and not record["stopped_after_step"] or record["timed_out"]:
        print("".join(job.lines)[-4000:], file=sys.stderr)
        raise SystemExit(f"job {name} (N={n}, pair {pair}) failed: {' '.join(cmd)}")
    record.update(job=name, launcher=launcher, variables=variables, n=n, pair=pair, command=cmd)
    return record


def step_of(record: dict, which: str) -> float | None:
    """Step 1 (``"1"``) or the recompile step (``"last"``, or ``--recompile-step``)."""
    steps = record["steps"]
    if not steps:
        return None
    return steps.get(str(max(int(s) for s in steps)) if which == "last" else which)


def mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.mean(values), 2) if values else None


def ratio(value: float | None, reference: float | None) -> str:
    return f"{value / reference:.2f}×" if value is not None and reference else "-"


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(raw: dict) -> str:
    recompile = raw.get("recompile_step") or "last"
    jobs = raw["jobs"]
    lines = common.heading(raw["label"], f"Command: `{raw['command']}`")
    lines += [f"Machine: {raw['machine']}. Script: `{' '.join(raw['script'])}`; coordinator from "
              f"`{raw['coordinator_at']}`. "
              + ("Each row's cold job, then restarts: stock on the dirs its cold job left, ours from the "
                 "`file://` store its cold job filled, on empty dirs; " if raw.get("restart") else
                 "Every job cold (empty Inductor and Triton dirs, its own working dir); ")
              + f"{raw['pairs']} alternating pair(s) per N"
              + (f"; each job stopped once every rank ended step {raw['until_step']}" if raw.get("until_step") else "")
              + ("; steps from Dynamo's compile records (first compiles, recompiles)"
                 if raw.get("compile_records") else "")
              + ".", ""]
    lines += common.table_head("N", "pair", "job", "wall (s)", "÷ stock", "step 1 (s)", "÷ stock",
                               "recompile step (s)", "÷ stock")
    summary = []
    stopped = raw.get("until_step") and recompile == "last"  # no step after the one it stopped at

    def step(job: dict, which: str) -> float | None:
        return None if stopped and which == recompile else step_of(job, which)

    for n in sorted({job["n"] for job in jobs}):
        of_n = [job for job in jobs if job["n"] == n]
        stock = [job for job in of_n if job["launcher"] == "stock" and job["pair"]]
        ref = {"wall": mean([j["wall_s"] for j in stock]), "1": mean([step(j, "1") for j in stock]),
               "r": mean([step(j, recompile) for j in stock])}
        for job in of_n:
            s1, sr = step(job, "1"), step(job, recompile)
            wall = job["wall_s"]
            lines.append(f"| {n} | {job['pair']} | {job['job']} | {fmt(wall)} | {ratio(wall, ref['wall'])} "
                         f"| {fmt(s1)} | {ratio(s1, ref['1'])} | {fmt(sr)} | {ratio(sr, ref['r'])} |")
        for name in dict.fromkeys(job["job"] for job in of_n):
            runs = [job for job in of_n if job["job"] == name]
            w, s1, sr = (mean([j["wall_s"] for j in runs]), mean([step(j, "1") for j in runs]),
                         mean([step(j, recompile) for j in runs]))
            summary.append(f"| {n} | {name} | {len(runs)} | {fmt(w)} | {ratio(w, ref['wall'])} | {fmt(s1)} "
                           f"| {ratio(s1, ref['1'])} | {fmt(sr)} | {ratio(sr, ref['r'])} |")
        stock_cold = mean([j["wall_s"] for j in of_n if j["launcher"] == "stock" and not j["pair"]])
        if raw.get("restart") and stock_cold:
            for name in dict.fromkeys(job["job"] for job in of_n if job["pair"]):
                w = mean([j["wall_s"] for j in of_n if j["job"] == name and j["pair"]])
                summary.append(f"| {n} | {name} restarts ÷ stock's cold job | | {fmt(w)} | {ratio(w, stock_cold)} "
                               "| | | | |")
    lines += ["", "Means per N and row, ratios to stock's means:", ""]
    lines += common.table_head("N", "job", "runs", "wall (s)", "÷ stock", "step 1 (s)", "÷ stock",
                               "recompile step (s)", "÷ stock")
    lines += summary
    lines += phases(jobs)
    lines += triton_counts(jobs)
    return "\n".join(lines) + "\n"


#: A job's phases, from its launch to its exit, and Dynamo's split of its compile seconds.
PHASES = ("launch", "imports", "set-up", "step 1", "step 2", "step 3", "exit", "Dynamo", "AOTAutograd", "Inductor",
          "kernel loads")


def job_phases(job: dict) -> dict[str, float | None] | None:
    """Where a job's wall went, from its ranks' ``HFJOB`` records (the slowest rank's each):
    launch (the job's start to the script's first line), imports, set-up, each step, exit (the
    script's last line to the job's end: the process group, the interpreter's exit, the
    launcher's), and the compile's parts as Dynamo times them (``calculate_time_spent``):
    Dynamo's own tracing, AOTAutograd (the backend and lazy backward compiles less Inductor's),
    Inductor, and of it the waits for kernels to load or compile (``async_compile.wait``)."""
    ranks = [r for r in job.get("ranks", []) if "t_start_abs" in r and "total_s" in r]
    if not ranks:
        return None
    end = job["launched"] + job["wall_s"]
    found: dict[str, float | None] = {
        "launch": max(r["t_start_abs"] for r in ranks) - job["launched"],
        "imports": max(r["import_s"] for r in ranks), "set-up": max(r["setup_s"] for r in ranks),
        "exit": None if job.get("stopped_after_step") else end - max(r["t_start_abs"] + r["total_s"] for r in ranks)}
    for i in range(3):
        found[f"step {i + 1}"] = max((r["step_s"][i] for r in ranks if len(r.get("step_s", [])) > i), default=None)
    spent = [r["time_spent"] for r in ranks if isinstance(r.get("time_spent"), dict)]
    if spent:
        def most(*keys: str, less: tuple[str, ...] = ()) -> float:
            return max(sum(t.get(k, 0.0) for k in keys) - sum(t.get(k, 0.0) for k in less) for t in spent)

        found.update(Dynamo=most("entire_frame_compile", less=("backend_compile",)),
                     AOTAutograd=most("backend_compile", "entire_backward_compile", less=("inductor_compile",)),
                     Inductor=most("inductor_compile"), **{"kernel loads": most("async_compile.wait")})
    return found


def phases(jobs: list[dict]) -> list[str]:
    """Per N and row, the median of each phase over its jobs (``job_phases``)."""
    timed = [(job, job_phases(job)) for job in jobs]
    timed = [(job, found) for job, found in timed if found is not None]
    if not timed:
        return []
    lines = ["", "Where each row's wall goes: medians over its jobs of the slowest rank's phases (s): launch "
             "(the job's start to the script's first line), the script's imports, set-up and steps, exit (its "
             "last line to the job's end); the compile's parts as Dynamo times them (Dynamo's tracing, "
             "AOTAutograd less Inductor, Inductor, and of it the waits for kernels):", ""]
    lines += common.table_head("N", "job", "runs", *PHASES)
    for n in sorted({job["n"] for job, _ in timed}):
        of_n = [(job, found) for job, found in timed if job["n"] == n]
        for name in dict.fromkeys(job["job"] for job, _ in of_n):
            runs = [found for job, found in of_n if job["job"] == name]
            cells = []
            for phase in PHASES:
                values = [found.get(phase) for found in runs if found.get(phase) is not None]
                cells.append(f"{statistics.median(values):.2f}" if values else "-")
            lines.append(f"| {n} | {name} | {len(runs)} | " + " | ".join(cells) + " |")
    return lines


def triton_counts(jobs: list[dict]) -> list[str]:
    """Where the script reports Triton's own counts per rank (``triton_compiles``,
    ``configs_benchmarked``: ``user_scripts/triton_ddp.py``), each job's, summed over its ranks."""
    counted = [job for job in jobs if job.get("ranks") and "triton_compiles" in job["ranks"][0]]
    if not counted:
        return []
    lines = ["", "Triton's own counts per job: kernels compiled and autotune configs benchmarked, per rank "
             "(rank order) and summed over the ranks:", ""]
    lines += common.table_head("N", "pair", "job", "compiled", "sum", "benchmarked", "sum")
    for job in counted:
        ranks = sorted(job["ranks"], key=lambda r: r["rank"])
        compiled, benched = [r["triton_compiles"] for r in ranks], [r["configs_benchmarked"] for r in ranks]
        lines.append(f"| {job['n']} | {job['pair']} | {job['job']} | {', '.join(map(str, compiled))} | {sum(compiled)} "
                     f"| {', '.join(map(str, benched))} | {sum(benched)} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_output_args(p)
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--rows", nargs="+", default=["stock", "ours"], help="stock, ours, cm, each with :VAR=VALUE,...")
    p.add_argument("--pairs", type=int, default=2, help="alternating pairs of the rows per N")
    p.add_argument("--cm-wrapper", type=Path, default=IN_COMPILE_ONCE, help="the cm row's script around SCRIPT")
    p.add_argument("--env", nargs="*", default=[], metavar="VAR=VALUE", help="for every job")
    p.add_argument("--until-step", type=int, default=None, help="stop each job once every rank ended this step")
    p.add_argument("--recompile-step", default=None, help="the step reported as the recompile's (default: the last)")
    p.add_argument("--marks", default=DEFAULT_MARKS, help="regex of a step mark (groups what, rank, step, t)")
    p.add_argument("--compile-records", action="store_true", help="no marks: read Dynamo's compile records")
    p.add_argument("--restart", action="store_true",
                   help="each row's cold job, then restarts: stock on its own dirs, ours from its store on empty ones")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--from-json", type=Path, default=None, metavar="FILE",
                   help="no jobs: the table of FILE's runs (its steps read again from --job-logs where given)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:split])
    marks = re.compile(args.marks)
    if args.from_json is not None:
        raw = json.loads(args.from_json.read_text())
        raw["label"] = args.label
        if args.job_logs:
            for job in raw["jobs"]:
                steps: dict[int, dict[int, dict[str, float]]] = {}
                log = Path(args.job_logs) / f"{args.label}-n{job['n']}-{job['pair']}-{job['job']}.log"
                for line in log.read_text().splitlines():
                    add_marks(steps, marks, line)
                job["steps"] = step_times(steps)
    else:
        if split >= len(argv) - 1:
            p.error("give the script and its arguments after --")
        args.script = argv[split + 1:]
        args.script[0] = str(Path(args.script[0]).resolve())
        args.cm_wrapper = args.cm_wrapper.resolve()
        args.env = dict(pair.split("=", 1) for pair in args.env)
        raw = run_all(args, marks)
    for name in ("pairs", "until_step", "recompile_step", "compile_records", "restart"):
        raw.setdefault(name, getattr(args, name))
    section = markdown(raw)
    print(section)
    common.save(args.label, raw, section, results_dir=args.results_dir, out=args.out)


def run_all(args: argparse.Namespace, marks: re.Pattern) -> dict:
    """Every job of the invocation, in alternating pairs; the raw record, saved as it grows."""
    rows = [parse_row(row) for row in args.rows]
    common.warm_page_cache()
    with tempfile.TemporaryDirectory() as tmp:
        where = installed_coordinator(tmp)
    print(f"coordinator: {where}", flush=True)
    raw = {"label": args.label, "command": common.command("user_script.py"),
           "machine": common.machine(common.gpu_count()), "coordinator_at": where, "script": args.script,
           "pairs": args.pairs, "until_step": args.until_step, "recompile_step": args.recompile_step,
           "compile_records": args.compile_records, "restart": args.restart, "jobs": []}
    for n in args.ranks:
        homes = {name: tempfile.mkdtemp(prefix=f"user-script-{name}-") for name, _, _ in rows} if args.restart else {}
        if args.restart:
            for name, launcher, variables in rows:
                record = run_one(f"{name} cold", launcher, variables, n, 0, args, marks, homes[name])
                raw["jobs"].append(record)
                print(f"N={n} {name} cold: wall {record['wall_s']:.1f} s, steps {record['steps']}", flush=True)
        for pair in range(1, args.pairs + 1):
            for name, launcher, variables in (rows if pair % 2 else rows[::-1]):
                record = run_one(name, launcher, variables, n, pair, args, marks, homes.get(name))
                raw["jobs"].append(record)
                print(f"N={n} pair {pair} {name}: wall {record['wall_s']:.1f} s, steps {record['steps']}", flush=True)
                common.save(args.label, raw, None, results_dir=args.results_dir)
        for home in homes.values():
            shutil.rmtree(home, ignore_errors=True)
    return raw


if __name__ == "__main__":
    main()
