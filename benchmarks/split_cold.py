"""Cold starts of the suite's DDP models: stock torch against ours, step by step, frame by frame.

    python benchmarks/split_cold.py --label gpu-split-cold-n4 --models llama phi3 --size restart --ranks 4 --gpu
    python benchmarks/split_cold.py --label gpu-split-cold-n1 --models llama phi3 --size restart --ranks 1 --gpu \\
        --order ours-first

For each model and world size N, two jobs of ``benchmarks/model_suite_job.py`` (a training
script that never imports the coordinator; ``--steps`` steps, then one at a new shape, a
recompile whose frame DDPOptimizer splits again), each on empty Inductor and Triton dirs:
``stock cold`` (``torchrun``) and ``ours cold`` (``coordinator-run`` with a ``file://`` store in
a new dir), in the order ``--order`` gives, so that two calls with the order swapped show
how much the machine drifts.

Columns: wall from launch to exit, ÷ stock's; step 1 and the recompile's step (the last),
from the ranks' common start or the step before, until the last rank ends it, each ÷ stock's;
each rank's seconds inside ``torch.compile`` (``entire_frame_compile``); AOTAutograd's cache
misses / hits summed over ranks (stock: its bypasses); FX graphs compiled, summed over ranks;
per split frame, the graphs compiled for the job (shares) and the chains' lookups served and
missed, summed over ranks; the losses against stock's ("equal": bit for bit; on a GPU,
atomics in the backward make steps after the first differ in the last digits between any
two runs). Prints the table, writes the raw jobs to ``benchmarks/results/<label>.json`` and
the table into ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from cold_start import gpu_count, machine, write_section  # noqa: E402
from model_suite_job import MODELS  # noqa: E402
from restart import loss_difference, run_job  # noqa: E402

ORDERS = {"stock-first": ("stock cold", "ours cold"), "ours-first": ("ours cold", "stock cold")}


def step_times(job: dict) -> list[float]:
    """Each step's seconds: from the ranks' common start (or the end of the step before,
    on the last rank) until the last rank ends it."""
    ranks = job["ranks"]
    ends = [max(r["step_ends"][k] for r in ranks) for k in range(len(ranks[0]["step_ends"]))]
    begin = min(r["start"] for r in ranks)
    return [end - before for end, before in zip(ends, [begin, *ends[:-1]], strict=True)]


def frames(job: dict) -> list[tuple[int, int, int, int]]:
    """Per split frame, over the ranks: (graphs, compiled for the job, served, missed)."""
    per_rank = [((r.get("stats") or {}).get("split_shares") or {}).get("frames") or [] for r in job["ranks"]]
    if not any(per_rank):
        return []
    count = max(len(f) for f in per_rank)
    return [(max(f[n]["graphs"] for f in per_rank if len(f) > n),
             sum(f[n]["compiled"] for f in per_rank if len(f) > n),
             sum(f[n]["served"] for f in per_rank if len(f) > n),
             sum(f[n]["missed"] for f in per_rank if len(f) > n)) for n in range(count)]


def row(job: dict, stock: dict) -> dict:
    ranks = job["ranks"]
    aot = {k: sum(r["aot_autograd"].get(f"autograd_cache_{k}", 0) for r in ranks) for k in ("hit", "miss", "bypass")}
    steps, stock_steps = step_times(job), step_times(stock)
    return {
        "model": job["model"], "n": job["n"], "job": job["job"], "wall_s": job["wall_s"],
        "ratio": job["wall_s"] / stock["wall_s"], "steps_s": steps,
        "step_ratios": [a / b for a, b in zip(steps, stock_steps, strict=True)],
        "compile_s": [r["compile_s"].get("entire_frame_compile", 0.0) for r in ranks],
        "aot": aot, "fx_compiled": sum(r["fx_misses"] for r in ranks), "frames": frames(job),
        "losses_apart": max(loss_difference(r["losses"], stock["ranks"][0]["losses"]) for r in ranks),
    }


def markdown(args: argparse.Namespace, raw: dict, table: list[dict]) -> str:
    lines = [
        f"#### Run `{args.label}` ({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `{raw['command']}`",
        "",
        f"Machine: {raw['machine']}. Model size `{args.size}`, {args.steps} steps, then one at a new shape (a "
        f"recompile). Jobs in the order {args.order}, each on empty Inductor and Triton dirs.",
        "",
        "| model | N | job | wall (s) | ÷ stock | step 1 (s) | ÷ stock | recompile step (s) | ÷ stock | "
        "compile inside, per rank (s) | AOT miss / hit (bypass) | FX compiled | per frame: graphs, shares compiled, "
        "served / missed in the chains | losses vs stock |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        compile_s = ", ".join(f"{c:.1f}" for c in r["compile_s"])
        per_frame = "; ".join(f"{g}: {c}, {s} / {m}" for g, c, s, m in r["frames"]) or "-"
        lines.append(
            f"| {r['model']} | {r['n']} | {r['job']} | {r['wall_s']:.1f} | {r['ratio']:.2f}× | "
            f"{r['steps_s'][0]:.1f} | {r['step_ratios'][0]:.2f}× | {r['steps_s'][-1]:.1f} | "
            f"{r['step_ratios'][-1]:.2f}× | {compile_s} | {r['aot']['miss']} / {r['aot']['hit']} "
            f"({r['aot']['bypass']}) | {r['fx_compiled']} | {per_frame} | "
            f"{'equal' if r['losses_apart'] == 0 else format(r['losses_apart'], '.0e') + ' apart'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", required=True, help="names the RESULTS.md section and the raw JSON file")
    p.add_argument("--models", nargs="+", choices=MODELS, default=["llama", "phi3"])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 3])
    p.add_argument("--size", default="split")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--order", choices=tuple(ORDERS), default="stock-first")
    p.add_argument("--gpu", action="store_true",
                   help="a GPU per rank over NCCL where there are enough, else ranks share cuda:0 over gloo")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--job-logs", default=None, metavar="DIR", help="keep each job's output in DIR")
    p.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    args = p.parse_args()
    # What restart.run_job reads of the arguments.
    args.precompile, args.bypass_split_graphs = False, False
    raw = {"command": "python benchmarks/split_cold.py " + " ".join(sys.argv[1:]),
           "machine": machine(gpu_count() if args.gpu else 0), "jobs": []}
    table: list[dict] = []
    subprocess.run([sys.executable, "-c", "import torch, transformers, torch._inductor.compile_fx"], check=True)
    for model in args.models:
        for n in args.ranks:
            with tempfile.TemporaryDirectory(prefix="split-cold-") as tmp:
                dirs = {"work": Path(tmp), "store": Path(tmp) / "store",
                        **{name: Path(tmp) / name.replace(" ", "-") for name in ORDERS[args.order]}}
                jobs = {}
                for name in ORDERS[args.order]:
                    jobs[name] = run_job(name, model, n, dirs, args)
                    raw["jobs"].append(jobs[name])
                    save(args, raw, table)
                    print(f"{model} N={n} {name:<10}: wall {jobs[name]['wall_s']:6.1f}s, steps "
                          f"{[round(s, 1) for s in step_times(jobs[name])]}", flush=True)
                table += [row(jobs[name], jobs["stock cold"]) for name in ("stock cold", "ours cold")]
            save(args, raw, table)
    print(markdown(args, raw, table))


def save(args: argparse.Namespace, raw: dict, table: list[dict]) -> None:
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{args.label}.json").write_text(json.dumps(raw, indent=1))
    write_section(Path(args.out), args.label, markdown(args, raw, table))


if __name__ == "__main__":
    main()
