"""Third-party models under ``coordinator-run`` against plain ``torchrun``: never slower, every graph once.

    python benchmarks/model_suite.py --label cpu-suite --models llama bert convnext qwen-fsdp llama-dynamic \\
        --ranks 1 2 3 --repeat 3
    python benchmarks/model_suite.py --label gpu-suite --models llama bert --ranks 1 2 4 --repeat 3 --gpu
    python benchmarks/model_suite.py --label cpu-trace --ranks 1 3 --plain-ranks --traced 1 --repeat 2

Each job is ``benchmarks/model_suite_job.py``, a training script that never imports the
coordinator, launched by ``torchrun`` ("plain") or ``coordinator-run`` ("coordinator"). Every
rank has an empty Inductor cache dir of its own, as ranks on separate nodes do
(``--node-cache``: one dir per job, as ranks on one node share). Runs are interleaved in
rounds (per model: plain N=1, coordinator N=1, coordinator N=2.., plain N=2..), so drift on
the host spreads over the rows. ``--traced N`` adds rows "traced": ``coordinator-run
--coordinator-trace DIR`` (tracing's cost; the raw runs count the events written). With
``--gpu``, each rank has a GPU of its own over NCCL where the machine has one per rank (as
on a real node), else the ranks share ``cuda:0`` over gloo.

Columns: the time until every rank has finished every step (the shape change's recompile
included) and step 1, medians; each ÷ plain N=1, the median of each run's ratio to the
median plain N=1 run of its own invocation (the same machine); FX graphs compiled summed
over ranks (median), against plain N=1's; DDP's split graphs that went through AOTAutograd,
summed over ranks, against the split graphs (the middle run; ours compiles each once in the
job: its shares and its chains' misses); whether the losses were bitwise equal across the
ranks of every run; and how far they were from the closest plain N=1 run of the same
invocation ("equal": bit for bit; else the largest relative difference over the steps). Prints the
table, writes the raw runs to
``benchmarks/results/<label>.json`` and the table into ``benchmarks/RESULTS.md``.
``--from-json A.json B.json`` makes the table of runs saved by earlier invocations (each
file keeps its own plain N=1 reference), for a table measured in more than one call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "benchmarks" / "model_suite_job.py"
from cold_start import gpu_count, machine, write_section  # noqa: E402
from model_suite_job import MODELS  # noqa: E402

#: Row name -> module run; "traced" is coordinator-run with ``--coordinator-trace`` (``--traced``).
LAUNCHERS = {"plain": "torch.distributed.run", "coordinator": "coordinator.jobs.launcher",
             "traced": "coordinator.jobs.launcher"}


def run_job(model: str, n: int, launcher: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        trace = ["--coordinator-trace", str(Path(tmp) / "trace")] if launcher == "traced" else []
        cmd = [sys.executable, "-m", LAUNCHERS[launcher], *trace, "--standalone", f"--nproc-per-node={n}", str(JOB),
               "--model", model, "--size", args.size, "--steps", str(args.steps), "--json", str(out)]
        if not args.node_cache:
            cmd.append("--cache-per-rank")
        env = dict(os.environ, TMPDIR=tmp, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if args.gpu and n > gpu_count():
            env["SUITE_BACKEND"] = "gloo"
        done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=args.timeout)
        if args.job_logs:
            Path(args.job_logs).mkdir(parents=True, exist_ok=True)
            log_name = f"{args.label}-{model}-{launcher}-n{n}-{time.time():.0f}.log"
            (Path(args.job_logs) / log_name).write_text(done.stdout)
        if done.returncode != 0 or not out.exists():
            print(done.stdout[-4000:], file=sys.stderr)
            raise SystemExit(f"job failed: {' '.join(cmd)}")
        result = json.loads(out.read_text())
        if trace:
            result["trace_events"] = sum(len(path.read_text().splitlines()) - 1
                                         for path in (Path(tmp) / "trace").glob("rank*.json"))
        return result


def row(model: str, n: int, launcher: str, runs: list[dict]) -> dict:
    """One table row from the runs of (model, N, launcher); each run carries ``reference``,
    the plain N=1 runs of the invocation it came from."""
    median = statistics.median
    return {
        "model": model, "n": n, "launcher": launcher,
        "all_steps_s": median(r["all_steps_s"] for r in runs),
        "runs_s": [r["all_steps_s"] for r in runs],
        "ratio": median(r["all_steps_s"] / median(x["all_steps_s"] for x in r["reference"]) for r in runs),
        "step1_s": median(r["step1_s"] for r in runs),
        "step1_ratio": median(r["step1_s"] / median(x["step1_s"] for x in r["reference"]) for r in runs),
        "fx_compiles": median(sum(rank["fx_misses"] for rank in r["ranks"]) for r in runs),
        "fx_compiles_alone": median(x["ranks"][0]["fx_misses"] for r in runs for x in r["reference"]),
        "split_aot": split_graphs_through_aot(runs[len(runs) // 2]),
        "ranks_equal": all(rank["losses"] == r["ranks"][0]["losses"] for r in runs for rank in r["ranks"]),
        "vs_plain": max(loss_difference(r["ranks"][0]["losses"], r["reference"]) for r in runs),
    }


def split_graphs_through_aot(run: dict) -> tuple[int, int] | None:
    """(AOTAutograd's runs on DDP's split graphs summed over ranks, the split graphs), or
    ``None`` where no frame was split. Ours: each rank's shares (compiled, skipped or
    failed) and its chains' misses; stock: AOTAutograd's bypasses (its cache refuses every
    split graph), the split graphs being one rank's."""
    shares = [((rank.get("stats") or {}).get("split_shares") or {}) for rank in run["ranks"]]
    if any(shares):
        ran = sum(x.get("compiled", 0) + x.get("skipped", 0) + x.get("failed", 0) + x.get("missed", 0)
                  for x in shares)
        frames = [x.get("frames", []) for x in shares]
        graphs = sum(max(f[n]["graphs"] for f in frames if len(f) > n) for n in range(max(map(len, frames))))
        return (ran, graphs) if graphs else None
    bypassed = [rank["aot_autograd"].get("autograd_cache_bypass", 0) for rank in run["ranks"]]
    return (sum(bypassed), max(bypassed)) if any(bypassed) else None


def loss_difference(losses: list[str], reference: list[dict]) -> float:
    """0 if ``losses`` equal a plain N=1 run's bit for bit, else the smallest relative
    difference from one (its largest over the steps)."""
    def relative(a: list[str], b: list[str]) -> float:
        return max(abs(float.fromhex(x) - float.fromhex(y)) / abs(float.fromhex(y)) for x, y in zip(a, b, strict=True))

    return min(relative(losses, plain["ranks"][0]["losses"]) for plain in reference)


def make_table(sources: list[dict]) -> list[dict]:
    """Rows from the raw runs of one or more invocations (``raw["runs"]`` each)."""
    grouped: dict[tuple[str, str], list[dict]] = {}
    for raw in sources:
        for model, by_row in raw["runs"].items():
            reference = by_row.get("plain-n1", [])
            for name, runs in by_row.items():
                grouped.setdefault((model, name), []).extend({**run, "reference": reference} for run in runs)
    table = []
    for (model, name), runs in grouped.items():
        launcher, n = name.rsplit("-n", 1)
        table.append(row(model, int(n), launcher, runs))
    order = {launcher: i for i, launcher in enumerate(LAUNCHERS)}
    return sorted(table, key=lambda r: (list(MODELS).index(r["model"]), r["n"] > 1 and r["launcher"] == "plain",
                                        r["n"], order[r["launcher"]]))


def markdown(args: argparse.Namespace, raw: dict, table: list[dict]) -> str:
    lines = [
        f"#### Run `{args.label}` ({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `{raw['command']}`",
        "",
        f"Machine: {raw['machine']}. Medians of the runs listed, run in rounds. "
        f"{'One cache dir per job (one node)' if args.node_cache else 'An empty cache dir per rank (separate nodes)'}; "
        f"{args.steps} steps, then one at a new shape (a recompile).",
        "",
        "| model | N | launcher | all steps (s) | ÷ plain N=1 | runs (s) | step 1 (s) | ÷ plain N=1 | "
        "FX compiles (sum) | plain N=1 compiles | split graphs through AOTAutograd (sum) / split graphs | "
        "losses: ranks equal | losses vs plain N=1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        split = r.get("split_aot")
        lines.append(
            f"| {r['model']} | {r['n']} | {r['launcher']} | {r['all_steps_s']:.1f} | {r['ratio']:.2f}× | "
            f"{', '.join(f'{t:.1f}' for t in r['runs_s'])} | {r['step1_s']:.1f} | {r['step1_ratio']:.2f}× | "
            f"{r['fx_compiles']:g} | {r['fx_compiles_alone']:g} | {f'{split[0]} / {split[1]}' if split else '-'} | "
            f"{'yes' if r['ranks_equal'] else '**no**'} | "
            f"{'equal' if r['vs_plain'] == 0 else format(r['vs_plain'], '.0e') + ' apart'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", required=True, help="names the RESULTS.md section and the raw JSON file")
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--size", default="bench")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--gpu", action="store_true",
                   help="a GPU per rank over NCCL where there are enough, else ranks share cuda:0 over gloo")
    p.add_argument("--node-cache", action="store_true", help="one Inductor cache dir per job, not per rank")
    p.add_argument("--plain-ranks", type=int, nargs="*", default=None,
                   help="N for the plain rows beyond N=1 (default: every N in --ranks)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--traced", type=int, nargs="*", default=[], metavar="N",
                   help="after the coordinator row of each N given, the same with --coordinator-trace (its cost)")
    p.add_argument("--job-logs", default=None, metavar="DIR", help="keep each job's output in DIR")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    p.add_argument("--from-json", nargs="+", default=None, metavar="FILE",
                   help="no runs: the table of the raw runs in these files (earlier invocations)")
    args = p.parse_args()
    if args.from_json:
        sources = [json.loads(Path(path).read_text()) for path in args.from_json]
        raw = {"command": " and ".join(source["command"] for source in sources),
               "machine": "; ".join(dict.fromkeys(source["machine"] for source in sources))}
        table = make_table(sources)
        write_section(Path(args.out), args.label, markdown(args, raw, table))
        print(markdown(args, raw, table))
        return
    plain_ranks = sorted({1, *(args.ranks if args.plain_ranks is None else args.plain_ranks)})
    ours = [(launcher, n) for n in args.ranks for launcher in ("coordinator", "traced")
            if launcher == "coordinator" or n in args.traced]
    plan = [("plain", 1)] + ours + [("plain", n) for n in plain_ranks if n > 1]
    raw = {"command": "python benchmarks/model_suite.py " + " ".join(sys.argv[1:]),
           "machine": machine(gpu_count() if args.gpu else 0),
           "runs": {}}
    table: list[dict] = []
    for model in args.models:
        runs: dict[tuple[str, int], list[dict]] = {}
        for rep in range(args.repeat):
            for launcher, n in plan:
                result = run_job(model, n, launcher, args)
                runs.setdefault((launcher, n), []).append(result)
                print(f"{model} N={n} {launcher:<11} run {rep + 1}: all steps {result['all_steps_s']:6.1f}s, "
                      f"step 1 {result['step1_s']:6.1f}s, FX compiles {[r['fx_misses'] for r in result['ranks']]}",
                      flush=True)
                raw["runs"][model] = {f"{launcher_}-n{n_}": r for (launcher_, n_), r in runs.items()}
                table = make_table([raw])
                save(args, raw, table)
    print(markdown(args, raw, table))


def save(args: argparse.Namespace, raw: dict, table: list[dict]) -> None:
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / f"{args.label}.json").write_text(json.dumps(raw, indent=1))
    write_section(Path(args.out), args.label, markdown(args, raw, table))


if __name__ == "__main__":
    main()
