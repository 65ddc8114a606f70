"""A job's restart: stock torch on its own Inductor dir against ours from the store with an empty one.

    python benchmarks/restart.py --label cpu-restart --models llama convnext --ranks 1 3
    python benchmarks/restart.py --label gpu-restart --models llama --size restart --ranks 1 2 --gpu

For each model and world size N, four jobs of ``benchmarks/model_suite_job.py`` (a training
script that never imports the coordinator; 2 steps, then one at a new shape, a recompile),
in this order:

* ``stock cold``: ``torchrun``, an empty Inductor (and Triton) cache dir shared by the ranks,
  as on one node;
* ``ours cold``: ``coordinator-run`` with a ``file://`` store in a new dir, an empty cache dir;
* ``stock restart``: ``torchrun`` again on the cache dir its cold job left;
* ``ours restart``: ``coordinator-run`` on the same store with a new, EMPTY cache dir.

Columns: wall from launch to exit (what a restart costs), ÷ stock restart; each rank's
seconds inside ``torch.compile`` (``entire_frame_compile``: Dynamo, AOTAutograd and Inductor
per frame; in brackets with the lazy backward compiles, ``total_wall_time``); AOTAutograd's
cache hits/misses/bypasses summed over ranks; of the hits, DDP split graphs (ours); seconds
loading compiled modules (``PyCodeCache.load_by_key_path``, rank 0); how far the losses are from
its cold job's ("equal": bit for bit; on a GPU, atomics in the backward make steps after the
first differ in the last digits between any two runs, stock's too). With ``--gpu`` each rank
has a GPU of its own over NCCL where the machine has one per rank (as on a real node), else
the ranks share ``cuda:0`` over gloo. Before the first job, one process imports what the jobs
import, so that no job pays for a cold page cache.
Prints the table, writes the raw jobs to ``benchmarks/results/<label>.json`` and the table
into ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "benchmarks" / "model_suite_job.py"
from cold_start import gpu_count, machine, write_section  # noqa: E402
from model_suite_job import MODELS  # noqa: E402

JOBS = ("stock cold", "ours cold", "stock restart", "ours restart")


def run_job(name: str, model: str, n: int, dirs: dict[str, Path], args: argparse.Namespace,
            profile: str | None = None) -> dict:
    ours = name.startswith("ours")
    cache = dirs[name] if name != "stock restart" else dirs["stock cold"]
    out = dirs["work"] / f"{name.replace(' ', '-')}-{model}-n{n}.json"
    launcher = "coordinator.jobs.launcher" if ours else "torch.distributed.run"
    cmd = [sys.executable, "-m", launcher, "--standalone", f"--nproc-per-node={n}", str(JOB), "--model", model,
           "--size", args.size, "--steps", str(args.steps), "--json", str(out)]
    if profile:
        cmd += ["--profile", profile]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton"),
               TMPDIR=str(dirs["work"]), SUITE_LAUNCHED=repr(time.time()),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if ours:
        env["COORDINATOR_STORE"] = f"file://{dirs['store']}"
        if args.precompile:
            env["COORDINATOR_PRECOMPILE"] = "1"
    if args.gpu and n > 1 and n > gpu_count():
        env["SUITE_BACKEND"] = "gloo"
    if ours and args.bypass_split_graphs and name == "ours cold":
        env["COORDINATOR_CACHE_DDP_GRAPHS"] = "0"  # no split graph in the store: the restart runs AOTAutograd
    begin = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=args.timeout)
    wall = time.perf_counter() - begin
    if args.job_logs:
        Path(args.job_logs).mkdir(parents=True, exist_ok=True)
        (Path(args.job_logs) / f"{args.label}-{model}-n{n}-{name.replace(' ', '-')}.log").write_text(done.stdout)
    if done.returncode != 0 or not out.exists():
        print(done.stdout[-4000:], file=sys.stderr)
        raise SystemExit(f"job failed: {' '.join(cmd)}")
    return {"job": name, "model": model, "n": n, "wall_s": wall, **json.loads(out.read_text())}


def row(job: dict, stock_restart_s: float, cold_losses: list[str]) -> dict:
    ranks = job["ranks"]
    aot = {k: sum(r["aot_autograd"].get(f"autograd_cache_{k}", 0) for r in ranks) for k in ("hit", "miss", "bypass")}
    served = sum(((r.get("stats") or {}).get("ddp_split_graphs") or {}).get("served", 0) for r in ranks)
    return {
        "model": job["model"], "n": job["n"], "job": job["job"], "wall_s": job["wall_s"],
        "ratio": job["wall_s"] / stock_restart_s,
        "compile_s": [r["compile_s"].get("entire_frame_compile", 0.0) for r in ranks],
        "compile_all_s": [r["compile_s"].get("total_wall_time", 0.0) for r in ranks],
        "aot": aot, "served": served, "loads_s": ranks[0].get("module_loads_s", 0.0),
        "losses_apart": max(loss_difference(r["losses"], cold_losses) for r in ranks),
        "frames": sum(r.get("frames_traced", 0) for r in ranks),
    }


def loss_difference(losses: list[str], cold: list[str]) -> float:
    """The largest relative difference from the cold job's losses over the steps (0: bit for bit)."""
    pairs = zip(losses, cold, strict=True)
    return max(abs(float.fromhex(a) - float.fromhex(b)) / abs(float.fromhex(b)) for a, b in pairs)


def markdown(args: argparse.Namespace, raw: dict, table: list[dict]) -> str:
    lines = [
        f"#### Run `{args.label}` ({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `{raw['command']}`",
        "",
        f"Machine: {raw['machine']}. Model size `{args.size}`, {args.steps} steps, then one at a new shape (a "
        "recompile). Stock restarts on the cache dir its cold job left; ours restarts from the store with an "
        "empty one.",
        "",
        "| model | N | job | wall (s) | ÷ stock restart | compile inside, per rank (s) | AOT hit / miss / bypass | "
        "DDP split graphs served | frames traced, all ranks | module loads, rank 0 (s) | losses vs its cold job |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        compile_s = ", ".join(f"{a:.1f} ({b:.1f})" for a, b in zip(r["compile_s"], r["compile_all_s"], strict=True))
        lines.append(
            f"| {r['model']} | {r['n']} | {r['job']} | {r['wall_s']:.1f} | {r['ratio']:.2f}× | {compile_s} | "
            f"{r['aot']['hit']} / {r['aot']['miss']} / {r['aot']['bypass']} | {r['served']} | {r.get('frames', '')} | "
            f"{r['loads_s']:.2f} | "
            f"{'equal' if r['losses_apart'] == 0 else format(r['losses_apart'], '.0e') + ' apart'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", required=True, help="names the RESULTS.md section and the raw JSON file")
    p.add_argument("--models", nargs="+", choices=MODELS, default=["llama", "convnext"])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 3])
    p.add_argument("--size", default="bench")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--gpu", action="store_true",
                   help="a GPU per rank over NCCL where there are enough, else ranks share cuda:0 over gloo")
    p.add_argument("--precompile", action="store_true", help="ours with precompiled functions (setting precompile)")
    p.add_argument("--bypass-split-graphs", action="store_true",
                   help="ours' cold job with cache_ddp_graphs off: no split graph is in the store, so ours' restart "
                        "runs AOTAutograd for every one, as stock's does (the cost of split graphs that are refused)")
    p.add_argument("--profile-restarts", default=None, metavar="DIR",
                   help="after the four jobs, run both restarts once more under cProfile into DIR (not timed)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--job-logs", default=None, metavar="DIR", help="keep each job's output in DIR")
    p.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    args = p.parse_args()
    raw = {"command": "python benchmarks/restart.py " + " ".join(sys.argv[1:]),
           "machine": machine(gpu_count() if args.gpu else 0),
           "jobs": []}
    table: list[dict] = []
    subprocess.run([sys.executable, "-c", "import torch, transformers, torch._inductor.compile_fx"], check=True)
    for model in args.models:
        for n in args.ranks:
            with tempfile.TemporaryDirectory(prefix="restart-") as tmp:
                dirs = {"work": Path(tmp), "store": Path(tmp) / "store",
                        **{name: Path(tmp) / name.replace(" ", "-") for name in JOBS if name != "stock restart"}}
                jobs = {}
                for name in JOBS:
                    jobs[name] = run_job(name, model, n, dirs, args)
                    raw["jobs"].append(jobs[name])
                    save(args, raw, table)  # the raw jobs so far, should a later one not finish
                    print(f"{model} N={n} {name:<13}: wall {jobs[name]['wall_s']:6.1f}s, compile "
                          f"{[round(r['compile_s'].get('entire_frame_compile', 0), 1) for r in jobs[name]['ranks']]}",
                          flush=True)
                for name in JOBS:
                    cold = jobs["ours cold" if name.startswith("ours") else "stock cold"]["ranks"][0]["losses"]
                    table.append(row(jobs[name], jobs["stock restart"]["wall_s"], cold))
                if args.profile_restarts:  # once more each, profiled; not in the table
                    Path(args.profile_restarts).mkdir(parents=True, exist_ok=True)
                    for name in ("stock restart", "ours restart"):
                        if name == "ours restart":
                            dirs[name] = Path(tmp) / "ours-restart-profiled"
                        run_job(name, model, n, dirs, args,
                                profile=str(Path(args.profile_restarts) / f"{model}-n{n}-{name.replace(' ', '-')}"))
            save(args, raw, table)
    print(markdown(args, raw, table))


def save(args: argparse.Namespace, raw: dict, table: list[dict]) -> None:
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{args.label}.json").write_text(json.dumps(raw, indent=1))
    write_section(Path(args.out), args.label, markdown(args, raw, table))


if __name__ == "__main__":
    main()
