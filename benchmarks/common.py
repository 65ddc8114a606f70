"""What the benchmark runners share: launching a job and timing it, reading its ranks' results,
and writing them (``results/<label>.json`` and the run's section of ``RESULTS.md``).

A runner imports it as a sibling (``from common import ...``): run as ``python benchmarks/X.py``
it has this folder on ``sys.path``; a runner loaded by its path (``tests/test_store_scale.py``
loads ``store_scale.py``) puts the folder there itself.

* the machine: :func:`gpu_count`, :func:`machine`, :func:`cpu_busy_seconds`, :class:`GpuSampler`;
* a job: :func:`launch_command`, :func:`job_env`, :func:`run_job` (to its end or its deadline:
  :class:`JobTimedOut`), :func:`log_file`, :func:`warm_page_cache`, :func:`wait_for_port`;
* the two training jobs: :func:`run_cold_start_job` (``cold_start_job.py``, the example GPT) and
  :func:`suite_command` / :func:`stock_or_ours_job` (``model_suite_job.py``, the suite's models);
* a job's ranks: :func:`aot_counts`, :func:`compile_seconds`, :func:`split_shares`,
  :func:`losses_apart`;
* the results: :func:`add_output_args`, :func:`add_suite_args`, :func:`command`, :func:`record`,
  :func:`heading`, :func:`table_head`, :func:`apart`, :func:`fmt_bytes`, :func:`save`,
  :func:`write_section`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
RESULTS_MD = BENCHMARKS / "RESULTS.md"
RESULTS_DIR = BENCHMARKS / "results"
COLD_START_JOB = BENCHMARKS / "cold_start_job.py"
SUITE_JOB = BENCHMARKS / "model_suite_job.py"
TORCHRUN = "torch.distributed.run"
COORDINATOR_RUN = "coordinator.jobs.launcher"

# -- the machine ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def gpu_count() -> int:
    """CUDA GPUs this machine has (0 without CUDA), read in a child process so that this
    one does not initialize CUDA before it starts jobs."""
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    return int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout)


def machine(gpus: int) -> str:
    import torch

    desc = f"{os.cpu_count()} CPU cores, Python {platform.python_version()}, torch {torch.__version__}"
    if gpus:
        import triton

        desc += f", triton {triton.__version__}, CUDA {torch.version.cuda}, {gpus} x {torch.cuda.get_device_name(0)}"
    return desc


def cpu_busy_seconds() -> float | None:
    """CPU seconds all cores of this machine spent busy since boot (``/proc/stat``), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class GpuSampler:
    """Mean GPU utilization (percent, summed over GPUs) from ``nvidia-smi`` once a second, or None."""

    def __init__(self) -> None:
        try:
            query = ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits", "-lms", "1000"]
            self.proc = subprocess.Popen(query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None

    def stop(self) -> float | None:
        if self.proc is None:
            return None
        self.proc.terminate()
        out, _ = self.proc.communicate()
        rows = [line.split(",") for line in out.splitlines() if line.count(",") == 1]
        try:
            samples = [(int(index), float(percent)) for index, percent in rows]
        except ValueError:
            return None
        ticks = sum(1 for index, _ in samples if index == 0)
        return round(sum(percent for _, percent in samples) / ticks, 1) if ticks else None


# -- a job ---------------------------------------------------------------------------------


class JobTimedOut(Exception):
    """A job still running at its deadline; it and its ranks were killed."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"still running after {seconds:.0f} s; killed")
        self.seconds = seconds


@dataclass
class Finished:
    """A job that ran to its end: what its ranks wrote (its ``--json`` file), its output, its wall
    time and, where sampled, the machine's busy cores and GPUs over its life."""

    result: dict
    output: str
    wall_s: float
    cpu_busy_cores: float | None = None
    gpu_busy_percent: float | None = None


def launch_command(launcher: str, n: int, script: Path, *args: str, launcher_args: tuple[str, ...] = ()) -> list[str]:
    """``python -m LAUNCHER [launcher_args] --standalone --nproc-per-node=N SCRIPT ARGS``."""
    return [sys.executable, "-m", launcher, *launcher_args, "--standalone", f"--nproc-per-node={n}", str(script),
            *args]


def job_env(tmp: str | Path, **extra: str) -> dict[str, str]:
    """This process's environment for a job: its temporary files (and working directory,
    :func:`run_job`) in ``tmp``, and ``extra``. The job imports the coordinator installed in
    this Python (``pip install`` of the wheel, or ``-e .``), as a user's would: nothing of
    this checkout is put on its path."""
    return dict(os.environ, TMPDIR=str(tmp), **extra)


def run_job(cmd: list[str], env: dict[str, str], out: Path, *, timeout: float, log: Path | None = None,
            sample: bool = False) -> Finished:
    """Run a job to its end, from its ``TMPDIR``, and read ``out``, the JSON its rank 0 writes; its output goes to
    ``log`` where one is named. ``sample``: the machine's busy cores and GPUs over the job.
    A job still running after ``timeout`` s, or one this process is interrupted in, is stopped
    with its ranks (:class:`JobTimedOut`); a job that fails ends the benchmark (``SystemExit``)."""
    started = time.monotonic()
    cpu_before = cpu_busy_seconds() if sample else None
    gpu = GpuSampler() if sample else None
    # Run from the job's temporary dir: ``python -m`` puts its working dir first on the path.
    job = subprocess.Popen(cmd, env=env, cwd=env.get("TMPDIR"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    try:
        output, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if gpu:
            gpu.stop()
        output = _stop(job)
        if log:
            log.write_text(output)
        raise JobTimedOut(timeout) from None
    except BaseException:
        if gpu:
            gpu.stop()
        _stop(job)
        raise
    gpu_percent = gpu.stop() if gpu else None
    wall = time.monotonic() - started
    cpu_after = cpu_busy_seconds() if sample else None
    if log:
        log.write_text(output)
    if job.returncode != 0 or not out.exists():
        print(output[-4000:], file=sys.stderr)
        raise SystemExit(f"job failed: {' '.join(cmd)}")
    done = Finished(json.loads(out.read_text()), output, wall)
    # Whole-machine figures over the job's life: how many cores were busy on average, and
    # how busy the GPUs were (percent summed over GPUs). A lone rank that keeps every core
    # busy leaves nothing for the ranks that share its host to take over.
    if cpu_before is not None and cpu_after is not None:
        done.cpu_busy_cores = round((cpu_after - cpu_before) / wall, 2)
    done.gpu_busy_percent = gpu_percent
    return done


def _stop(job: subprocess.Popen) -> str:
    """Stop a job started in a session of its own, and return its output."""
    job.terminate()  # torchrun stops the ranks it started (each in a session of its own)
    try:
        output, _ = job.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
    return output or ""


def log_file(directory: str | None, name: str) -> Path | None:
    """``directory/name``, the directory made if needed; ``None`` without a directory."""
    if not directory:
        return None
    Path(directory).mkdir(parents=True, exist_ok=True)
    return Path(directory) / name


def warm_page_cache() -> None:
    """Import what the suite's jobs import, once, so that no job pays for a cold page cache."""
    subprocess.run([sys.executable, "-c", "import torch, transformers, torch._inductor.compile_fx"], check=True)


def wait_for_port(port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> bool:
    """Whether a server on this machine's ``port`` accepts a connection within ``timeout_s``
    (False at once where ``proc``, the server, has exited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
                return False
            time.sleep(0.05)


# -- the two training jobs -----------------------------------------------------------------


def run_cold_start_job(n: int, method: str, job_args: list[str], *, gpus: int, store: str | None = None,
                       redis_url: str | None = None, cache_dir: str | None = None, timeout: float = 1800,
                       profile: Path | None = None, profile_ranks: Path | None = None,
                       log: Path | None = None) -> dict:
    """``cold_start_job.py`` (the example GPT under DDP) on N ranks under torchrun: its JSON with
    ``wall_s``, ``cpu_busy_cores`` and ``gpu_busy_percent``. With ``gpus``, N <= gpus runs a
    rank per GPU (``--virtual-local-rank``), more ranks share the GPUs over gloo."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        extra = []
        launcher_args: tuple[str, ...] = ()
        if gpus and n <= gpus:
            launcher_args = ("--virtual-local-rank",)  # every rank sees its GPU as cuda:0
        elif gpus:
            extra = ["--backend", "gloo", "--emulate-gpus", str(gpus)]
        cmd = launch_command(TORCHRUN, n, COLD_START_JOB, "--method", method, "--json", str(out), *extra, *job_args,
                             launcher_args=launcher_args)
        if profile:  # sample every process of the job, idle time and threads included
            cmd = ["py-spy", "record", "--subprocesses", "--idle", "--threads", "--format", "raw",
                   "--rate", "50", "--output", str(profile), "--", *cmd]
        for flag, value in (("--store", store), ("--redis-url", redis_url), ("--profile-self", profile_ranks),
                            ("--cache-dir", cache_dir)):
            if value:
                cmd += [flag, str(value)]
        env = job_env(tmp)
        env.setdefault("OMP_NUM_THREADS", "1")
        done = run_job(cmd, env, out, timeout=timeout, log=log, sample=True)
        result = done.result
        result["wall_s"] = done.wall_s
        if done.cpu_busy_cores is not None:
            result["cpu_busy_cores"] = done.cpu_busy_cores
        result["gpu_busy_percent"] = done.gpu_busy_percent
        return result


def suite_command(launcher: str, n: int, model: str, out: Path, args: argparse.Namespace, *job_args: str,
                  launcher_args: tuple[str, ...] = ()) -> list[str]:
    """``model_suite_job.py`` with ``args.size`` and ``args.steps`` on N ranks."""
    return launch_command(launcher, n, SUITE_JOB, "--model", model, "--size", args.size, "--steps", str(args.steps),
                          "--json", str(out), *job_args, launcher_args=launcher_args)


def ranks_label(n: int, emulated: int) -> str:
    """A table's N: ``"2"``, or ``"2, emulated on 1 GPU (gloo)"`` where the ranks shared the
    machine's ``emulated`` GPUs."""
    return f"{n}, emulated on {emulated} GPU (gloo)" if emulated else str(n)


def suite_backend(env: dict[str, str], n: int, gpu: bool) -> None:
    """Where ``n`` ranks on GPUs outnumber the machine's GPUs, they share them over gloo."""
    if gpu and n > 1 and n > gpu_count():
        env["SUITE_BACKEND"] = "gloo"


def stock_or_ours_job(name: str, model: str, n: int, args: argparse.Namespace, *, cache: Path, work: Path,
                      store: Path | None, env: dict[str, str] | None = None,
                      profile: str | None = None, log_label: str | None = None) -> tuple[dict, str]:
    """One job of ``model_suite_job.py`` named ``name``: ``stock ...`` under torchrun, ``ours ...``
    under coordinator-run with a ``file://`` store in ``store`` (none: the job's own TCPStore);
    its ranks share the Inductor (and Triton) cache dir ``cache``, as on one node. Returns
    ``{"job", "model", "n", "wall_s", **what rank 0 wrote}`` and the job's output, which goes to
    ``args.job_logs`` too (named after ``log_label``, default ``args.label``)."""
    ours = name.startswith("ours")
    out = work / f"{name.replace(' ', '-')}-{model}-n{n}.json"
    cmd = suite_command(COORDINATOR_RUN if ours else TORCHRUN, n, model, out, args,
                        *(["--profile", profile] if profile else []))
    env = job_env(work, TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton"),
                  SUITE_LAUNCHED=repr(time.time()), **(env or {}))
    if ours and store is not None:
        env["COORDINATOR_STORE"] = f"file://{store}"
    elif ours:
        env.pop("COORDINATOR_STORE", None)
    suite_backend(env, n, args.gpu)
    log = log_file(args.job_logs, f"{log_label or args.label}-{model}-n{n}-{name.replace(' ', '-')}.log")
    done = run_job(cmd, env, out, timeout=args.timeout, log=log)
    for rank in done.result.get("ranks", []):  # what each rank's exit took, written after the result
        exit_times = Path(f"{out}.exit-rank{rank['rank']}.json")
        if exit_times.exists():
            rank.update(json.loads(exit_times.read_text()))
    # Ranks that share the machine's GPUs over gloo emulate a node: labelled so (the GPUs shared).
    emulated = gpu_count() if env.get("SUITE_BACKEND") == "gloo" else 0
    return {"job": name, "model": model, "n": n, "emulated": emulated, "wall_s": done.wall_s, **done.result}, \
        done.output


# -- a job's ranks -------------------------------------------------------------------------


def aot_counts(ranks: list[dict]) -> dict[str, int]:
    """AOTAutograd's cache hits, misses and bypasses, summed over the ranks."""
    return {k: sum(r["aot_autograd"].get(f"autograd_cache_{k}", 0) for r in ranks) for k in ("hit", "miss", "bypass")}


def compile_seconds(ranks: list[dict], metric: str = "entire_frame_compile") -> list[float]:
    """Each rank's seconds inside ``torch.compile`` (``entire_frame_compile``: Dynamo,
    AOTAutograd and Inductor per frame; ``total_wall_time``: with the lazy backward compiles)."""
    return [r["compile_s"].get(metric, 0.0) for r in ranks]


def split_shares(rank: dict) -> dict:
    """A rank's counts of DDP's split frames (``coordinator.stats()``; empty for stock's)."""
    return (rank.get("stats") or {}).get("split_shares") or {}


def losses_apart(losses: list[str], reference: list[str]) -> float:
    """The largest relative difference from ``reference``'s losses over the steps (0: bit for
    bit); losses as ``float.hex`` strings."""
    pairs = zip(losses, reference, strict=True)
    return max(abs(float.fromhex(a) - float.fromhex(b)) / abs(float.fromhex(b)) for a, b in pairs)


# -- the results ---------------------------------------------------------------------------


def add_output_args(p: argparse.ArgumentParser, *, label: str | None = None, job_logs: bool = True) -> None:
    """``--label`` (required unless it has a default), ``--results-dir``, ``--out`` and ``--job-logs``."""
    p.add_argument("--label", required=label is None, default=label,
                   help="names the RESULTS.md section and the raw JSON file")
    p.add_argument("--results-dir", default=str(RESULTS_DIR), help="where <label>.json goes")
    p.add_argument("--out", default=str(RESULTS_MD), help="the RESULTS.md the section goes into")
    if job_logs:
        p.add_argument("--job-logs", default=None, metavar="DIR", help="keep each job's output in DIR")


def add_suite_args(p: argparse.ArgumentParser, *, models: list[str] | None, ranks: list[int] | None,
                   size: str | None, helps: dict[str, str] | None = None) -> None:
    """The arguments of a runner of ``model_suite_job.py``, and of its output; ``helps``: the
    help of ``models``, ``ranks`` or ``size`` (where their defaults depend on the runner's mode)."""
    from model_suite_job import MODELS

    helps = helps or {}
    add_output_args(p)
    p.add_argument("--models", nargs="+", choices=MODELS, default=models, help=helps.get("models"))
    p.add_argument("--ranks", type=int, nargs="+", default=ranks, help=helps.get("ranks"))
    p.add_argument("--size", default=size, help=helps.get("size"))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--gpu", action="store_true",
                   help="a GPU per rank over NCCL where there are enough, else ranks share cuda:0 over gloo")
    p.add_argument("--timeout", type=float, default=1800)


def command(script: str) -> str:
    """How this runner was called: its command in a results section."""
    return f"python benchmarks/{script} " + " ".join(sys.argv[1:])


def record(script: str, args: argparse.Namespace, **rest: object) -> dict:
    """A suite runner's raw record: its command and machine (``args.gpu``: its GPUs), then ``rest``."""
    return {"command": command(script), "machine": machine(gpu_count() if args.gpu else 0), **rest}


def heading(label: str, command_line: str) -> list[str]:
    """A run's section begins: its label and date, then ``command_line`` (``Command: `...```)."""
    return [f"#### Run `{label}` ({time.strftime('%Y-%m-%d')})", "", command_line, ""]


def table_head(*columns: str) -> list[str]:
    """A Markdown table's header row and its rule."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def apart(difference: float) -> str:
    """A loss difference in a table: ``equal`` (bit for bit) or ``1e-03 apart``."""
    return "equal" if difference == 0 else format(difference, ".0e") + " apart"


def fmt_bytes(n: float) -> str:
    return "0" if not n else f"{n / 1e6:.1f} MB"


def save(label: str, raw: dict, section: str | None, *, results_dir: str | Path = RESULTS_DIR,
         out: str | Path = RESULTS_MD) -> None:
    """Write the raw runs to ``<results_dir>/<label>.json`` and ``section`` into ``out``."""
    results = Path(results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{label}.json").write_text(json.dumps(raw, indent=1))
    if section is not None:
        write_section(Path(out), label, section)


def write_section(path: Path, label: str, section: str) -> None:
    """Replace this label's section of RESULTS.md, keeping everything else. The markers keep the
    name of the script that wrote the first sections (``cold_start.py``), for every runner."""
    begin, end = f"<!-- cold_start.py {label}: begin -->", f"<!-- cold_start.py {label}: end -->"
    text = path.read_text() if path.exists() else "# Benchmark results\n\n"
    block = f"{begin}\n{section}{end}\n"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) + 1 :]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)
