"""Cold starts of the suite's DDP models: stock torch against ours, step by step, frame by frame.

    python benchmarks/split_cold.py --label gpu-split-cold-n4 --models llama phi3 --size restart --ranks 4 --gpu
    python benchmarks/split_cold.py --label gpu-split-cold-n1 --models llama phi3 --size restart --ranks 1 --gpu \\
        --order ours-first

For each model and world size N, pairs of jobs of ``benchmarks/model_suite_job.py`` (a
training script that never imports the coordinator; ``--steps`` steps, then one at a new
shape, a recompile whose frame DDPOptimizer splits again), each on empty Inductor and Triton
dirs: ``stock cold`` (``torchrun``) and ``ours cold`` (``coordinator-run`` with a ``file://``
store in a new dir). ``--repeat R`` runs R pairs alternating (with ``--order stock-first``:
stock, ours, ours, stock, stock, ours, ...), so that drift on the machine falls on both; each
run is a row, and a row per model and N gives the ratios of the means. ``--trace`` keeps
ours' ``coordinator report`` of each run (``--job-logs`` DIR).

Columns: wall from launch to exit, ÷ stock's; step 1 and the recompile's step (the last),
from the ranks' common start or the step before, until the last rank ends it, each ÷ stock's;
each rank's seconds inside ``torch.compile`` (``entire_frame_compile``); AOTAutograd's cache
misses / hits summed over ranks (stock: its bypasses); FX graphs compiled, summed over ranks;
per split frame, the graphs compiled for the job (shares) and the chains' lookups served and
missed, summed over ranks; per split frame, its price: the seconds all ranks spent
compiling it (Dynamo's records of the frame's compile, without its tracing: the backend,
which is ours' shares and chain, or stock's chain, plus the backward graphs compiled
lazily for it) against the seconds one stock rank spent (the mean over stock's ranks), in
brackets ours' shares and chains summed over ranks; the losses against stock's ("equal":
bit for bit; on a GPU, atomics in the backward make steps after the first differ in the
last digits between any two runs). Prints the table, writes the raw jobs to
``benchmarks/results/<label>.json`` and the table into ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def pair_order(first: str, pair: int) -> tuple[str, str]:
    """The jobs of pair ``pair`` (from 0): ``first``'s order, then swapped, alternating."""
    order = ORDERS[first]
    return order if pair % 2 == 0 else order[::-1]


def step_times(job: dict) -> list[float]:
    """Each step's seconds: from the ranks' common start (or the end of the step before,
    on the last rank) until the last rank ends it."""
    ranks = job["ranks"]
    ends = [max(r["step_ends"][k] for r in ranks) for k in range(len(ranks[0]["step_ends"]))]
    begin = min(r["start"] for r in ranks)
    return [end - before for end, before in zip(ends, [begin, *ends[:-1]], strict=True)]


def split_counts(job: dict) -> list[list[dict]]:
    """Each rank's counts per split frame (ours only)."""
    return [((r.get("stats") or {}).get("split_shares") or {}).get("frames") or [] for r in job["ranks"]]


def frames(job: dict) -> list[tuple[int, int, int, int]]:
    """Per split frame, over the ranks: (graphs, compiled for the job, served, missed)."""
    per_rank = split_counts(job)
    if not any(per_rank):
        return []
    count = max(len(f) for f in per_rank)
    return [(max(f[n]["graphs"] for f in per_rank if len(f) > n),
             sum(f[n]["compiled"] for f in per_rank if len(f) > n),
             sum(f[n]["served"] for f in per_rank if len(f) > n),
             sum(f[n]["missed"] for f in per_rank if len(f) > n)) for n in range(count)]


def compile_seconds(rank: dict, compile_id: str) -> float:
    """Seconds one rank spent compiling frame ``compile_id`` past its tracing: the backend
    of the frame's compile (DDPOptimizer's chain; ours' shares run inside it) and the
    backward graphs compiled lazily for it."""
    total = 0.0
    for record in rank.get("compiles", ()):
        if record["id"] != compile_id:
            continue
        total += (record["backend_s"] or 0.0) if record["forward"] else record["end"] - record["start"]
    return total


def prices(job: dict, stock: dict) -> list[dict]:
    """Per split frame of ours' job: the seconds all its ranks spent on the frame, the
    seconds one stock rank spent on it (the mean over stock's ranks), and ours' shares and
    chains summed over ranks."""
    per_rank = split_counts(job)
    if not any(per_rank):
        return []
    found = []
    for n in range(max(len(f) for f in per_rank)):
        counted = [f[n] for f in per_rank if len(f) > n]
        compile_id = counted[0].get("compile_id", "")
        if not compile_id:
            continue
        ours_s = sum(compile_seconds(r, compile_id) for r in job["ranks"])
        stock_s = sum(compile_seconds(r, compile_id) for r in stock["ranks"]) / len(stock["ranks"])
        found.append({"frame": n, "compile_id": compile_id, "ours_s": ours_s, "stock_s": stock_s,
                      "ratio": ours_s / stock_s if stock_s else float("nan"),
                      "shares_s": sum(f.get("share_s", 0.0) for f in counted),
                      "chains_s": sum(f.get("chain_s", 0.0) for f in counted)})
    return found


def row(job: dict, stock: dict, pair: int) -> dict:
    ranks = job["ranks"]
    aot = {k: sum(r["aot_autograd"].get(f"autograd_cache_{k}", 0) for r in ranks) for k in ("hit", "miss", "bypass")}
    steps, stock_steps = step_times(job), step_times(stock)
    return {
        "model": job["model"], "n": job["n"], "pair": pair, "job": job["job"], "wall_s": job["wall_s"],
        "ratio": job["wall_s"] / stock["wall_s"], "steps_s": steps,
        "step_ratios": [a / b for a, b in zip(steps, stock_steps, strict=True)],
        "compile_s": [r["compile_s"].get("entire_frame_compile", 0.0) for r in ranks],
        "aot": aot, "fx_compiled": sum(r["fx_misses"] for r in ranks), "frames": frames(job),
        "prices": prices(job, stock) if job["job"] != "stock cold" else [],
        "losses_apart": max(loss_difference(r["losses"], stock["ranks"][0]["losses"]) for r in ranks),
    }


def means(table: list[dict]) -> list[dict]:
    """Per model and N with more than one pair: ours' means over stock's means."""
    found = []
    for key in dict.fromkeys((r["model"], r["n"]) for r in table):
        rows = {name: [r for r in table if (r["model"], r["n"]) == key and r["job"] == name]
                for name in ("stock cold", "ours cold")}
        if len(rows["ours cold"]) < 2:
            continue

        def ratio(value, rows=rows) -> float:
            return (statistics.mean(value(r) for r in rows["ours cold"])
                    / statistics.mean(value(r) for r in rows["stock cold"]))

        price = [statistics.mean(r["prices"][i]["ours_s"] for r in rows["ours cold"]) /
                 statistics.mean(r["prices"][i]["stock_s"] for r in rows["ours cold"])
                 for i in range(min(len(r["prices"]) for r in rows["ours cold"]))]
        found.append({"model": key[0], "n": key[1], "pairs": len(rows["ours cold"]),
                      "wall": ratio(lambda r: r["wall_s"]), "step1": ratio(lambda r: r["steps_s"][0]),
                      "recompile": ratio(lambda r: r["steps_s"][-1]), "prices": price})
    return found


def markdown(args: argparse.Namespace, raw: dict, table: list[dict]) -> str:
    lines = [
        f"#### Run `{args.label}` ({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `{raw['command']}`",
        "",
        f"Machine: {raw['machine']}. Model size `{args.size}`, {args.steps} steps, then one at a new shape (a "
        f"recompile). {args.repeat} pair(s) of jobs per model and N, the first in the order {args.order}, then "
        "alternating; each job on empty Inductor and Triton dirs; ratios against the stock job of the same pair.",
        "",
        "| model | N | pair | job | wall (s) | ÷ stock | step 1 (s) | ÷ stock | recompile step (s) | ÷ stock | "
        "compile inside, per rank (s) | AOT miss / hit (bypass) | FX compiled | per frame: graphs, shares compiled, "
        "served / missed in the chains | per frame: price, all ranks ÷ one stock rank (s; ours' shares + chains) | "
        "losses vs stock |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        compile_s = ", ".join(f"{c:.1f}" for c in r["compile_s"])
        per_frame = "; ".join(f"{g}: {c}, {s} / {m}" for g, c, s, m in r["frames"]) or "-"
        price = "; ".join(f"{p['compile_id']}: {p['ratio']:.2f}× ({p['ours_s']:.1f} ÷ {p['stock_s']:.1f}; "
                          f"{p['shares_s']:.1f} + {p['chains_s']:.1f})" for p in r["prices"]) or "-"
        lines.append(
            f"| {r['model']} | {r['n']} | {r['pair'] + 1} | {r['job']} | {r['wall_s']:.1f} | {r['ratio']:.2f}× | "
            f"{r['steps_s'][0]:.1f} | {r['step_ratios'][0]:.2f}× | {r['steps_s'][-1]:.1f} | "
            f"{r['step_ratios'][-1]:.2f}× | {compile_s} | {r['aot']['miss']} / {r['aot']['hit']} "
            f"({r['aot']['bypass']}) | {r['fx_compiled']} | {per_frame} | {price} | "
            f"{'equal' if r['losses_apart'] == 0 else format(r['losses_apart'], '.0e') + ' apart'} |")
    averaged = means(table)
    if averaged:
        lines += ["", "Means over the pairs, ours ÷ stock:", "",
                  "| model | N | pairs | wall | step 1 | recompile step | per frame: price |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {m['model']} | {m['n']} | {m['pairs']} | {m['wall']:.2f}× | {m['step1']:.2f}× | "
                  f"{m['recompile']:.2f}× | {', '.join(f'{p:.2f}×' for p in m['prices']) or '-'} |" for m in averaged]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", required=True, help="names the RESULTS.md section and the raw JSON file")
    p.add_argument("--models", nargs="+", choices=MODELS, default=["llama", "phi3"])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 3])
    p.add_argument("--size", default="split")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--order", choices=tuple(ORDERS), default="stock-first", help="the first pair's order")
    p.add_argument("--repeat", type=int, default=1, help="pairs of jobs per model and N, alternating their order")
    p.add_argument("--gpu", action="store_true",
                   help="a GPU per rank over NCCL where there are enough, else ranks share cuda:0 over gloo")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--job-logs", default=None, metavar="DIR", help="keep each job's output in DIR")
    p.add_argument("--trace", action="store_true",
                   help="ours' jobs traced (COORDINATOR_TRACE); their reports kept in --job-logs")
    p.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    args = p.parse_args()
    if args.trace and not args.job_logs:
        p.error("--trace keeps the reports in --job-logs DIR: name it")
    # What restart.run_job reads of the arguments.
    args.precompile, args.bypass_split_graphs = False, False
    raw = {"command": "python benchmarks/split_cold.py " + " ".join(sys.argv[1:]),
           "machine": machine(gpu_count() if args.gpu else 0), "jobs": []}
    table: list[dict] = []
    subprocess.run([sys.executable, "-c", "import torch, transformers, torch._inductor.compile_fx"], check=True)
    for model in args.models:
        for n in args.ranks:
            for pair in range(args.repeat):
                order = pair_order(args.order, pair)
                with tempfile.TemporaryDirectory(prefix="split-cold-") as tmp:
                    dirs = {"work": Path(tmp), "store": Path(tmp) / "store",
                            **{name: Path(tmp) / name.replace(" ", "-") for name in order}}
                    jobs = {}
                    for name in order:
                        env = {}
                        if args.trace and name.startswith("ours"):
                            trace = Path(args.job_logs) / f"{args.label}-{model}-n{n}-pair{pair + 1}-trace"
                            env["COORDINATOR_TRACE"] = str(trace)
                        logged = argparse.Namespace(**{**vars(args), "label": f"{args.label}-pair{pair + 1}"})
                        jobs[name] = run_job(name, model, n, dirs, logged, env=env)
                        jobs[name]["pair"] = pair
                        raw["jobs"].append(jobs[name])
                        save(args, raw, table)
                        print(f"{model} N={n} pair {pair + 1} {name:<10}: wall {jobs[name]['wall_s']:6.1f}s, steps "
                              f"{[round(s, 1) for s in step_times(jobs[name])]}", flush=True)
                        if env:
                            report(Path(env["COORDINATOR_TRACE"]))
                    table += [row(jobs[name], jobs["stock cold"], pair) for name in order]
                save(args, raw, table)
    print(markdown(args, raw, table))


def report(trace: Path) -> None:
    """Print ours' job's report (the rank and frame tables) and keep it beside the trace."""
    done = subprocess.run([sys.executable, "-m", "coordinator.cli", "report", str(trace)], capture_output=True,
                          text=True)
    (trace / "report.txt").write_text(done.stdout + done.stderr)
    print(done.stdout, flush=True)


def save(args: argparse.Namespace, raw: dict, table: list[dict]) -> None:
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{args.label}.json").write_text(json.dumps(raw, indent=1))
    write_section(Path(args.out), args.label, markdown(args, raw, table))


if __name__ == "__main__":
    main()
