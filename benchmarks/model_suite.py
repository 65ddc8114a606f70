"""Third-party models under ``coordinator-run`` against plain ``torchrun``: never slower, every graph once;
with ``--split``, cold starts of the suite's DDP models, stock against ours, step by step, frame by frame.

    python benchmarks/model_suite.py --label cpu-suite --models llama bert convnext qwen-fsdp llama-dynamic \\
        --ranks 1 2 3 --repeat 3
    python benchmarks/model_suite.py --label gpu-suite --models llama bert --ranks 1 2 4 --repeat 3 --gpu
    python benchmarks/model_suite.py --label cpu-trace --ranks 1 3 --plain-ranks --traced 1 --repeat 2
    python benchmarks/model_suite.py --split --label gpu-split-cold-n4 --models llama phi3 --size restart \\
        --ranks 4 --gpu
    python benchmarks/model_suite.py --split --label gpu-split-cold-n1 --models llama phi3 --size restart \\
        --ranks 1 --gpu --order ours-first

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

``--split`` (defaults: models llama and phi3, N=1 and 3, size ``split``, one pair): for each
model and world size N, pairs of jobs (``--steps`` steps, then one at a new shape, a
recompile whose frame DDPOptimizer splits again), each on empty Inductor and Triton dirs
that its ranks share: ``stock cold`` (``torchrun``) and ``ours cold`` (``coordinator-run`` with
a ``file://`` store in a new dir). ``--repeat R`` runs R pairs alternating (with ``--order
stock-first``: stock, ours, ours, stock, stock, ours, ...), so that drift on the machine falls
on both; each run is a row, and a row per model and N gives the ratios of the means.
``--trace`` keeps ours' ``coordinator report`` of each run (``--job-logs`` DIR). Before the
first job, one process imports what the jobs import, so that no job pays for a cold page cache.

Its columns: wall from launch to exit, ÷ stock's; step 1 and the recompile's step (the last),
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

import common
from model_suite_job import MODELS

#: Row name -> module run; "traced" is coordinator-run with ``--coordinator-trace`` (``--traced``).
LAUNCHERS = {"plain": common.TORCHRUN, "coordinator": common.COORDINATOR_RUN, "traced": common.COORDINATOR_RUN}
#: The defaults that depend on the mode: (the suite's, ``--split``'s).
DEFAULTS = {"models": (list(MODELS), ["llama", "phi3"]), "ranks": ([1, 2, 3], [1, 3]), "size": ("bench", "split"),
            "repeat": (3, 1), "order": (None, "stock-first")}
#: The options of one mode: their value when not given.
SUITE_ONLY = {"node_cache": False, "plain_ranks": None, "traced": [], "from_json": None}
SPLIT_ONLY = {"order": None, "trace": False, "profile_ranks": None}
#: ``--split``: the first pair's order.
ORDERS = {"stock-first": ("stock cold", "ours cold"), "ours-first": ("ours cold", "stock cold")}


# -- the suite -----------------------------------------------------------------------------


def suite_job(model: str, n: int, launcher: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        trace = ("--coordinator-trace", str(Path(tmp) / "trace")) if launcher == "traced" else ()
        cmd = common.suite_command(LAUNCHERS[launcher], n, model, out, args,
                                   *([] if args.node_cache else ["--cache-per-rank"]), launcher_args=trace)
        env = common.job_env(tmp)
        common.suite_backend(env, n, args.gpu)
        log = common.log_file(args.job_logs, f"{args.label}-{model}-{launcher}-n{n}-{time.time():.0f}.log")
        result = common.run_job(cmd, env, out, timeout=args.timeout, log=log).result
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
    shares = [common.split_shares(rank) for rank in run["ranks"]]
    if any(shares):
        ran = sum(x.get("compiled", 0) + x.get("skipped", 0) + x.get("failed", 0) + x.get("missed", 0)
                  for x in shares)
        graphs = sum(graphs for graphs, *_ in frames(run))
        return (ran, graphs) if graphs else None
    bypassed = [rank["aot_autograd"].get("autograd_cache_bypass", 0) for rank in run["ranks"]]
    return (sum(bypassed), max(bypassed)) if any(bypassed) else None


def loss_difference(losses: list[str], reference: list[dict]) -> float:
    """0 if ``losses`` equal a plain N=1 run's bit for bit, else the smallest relative
    difference from one (its largest over the steps)."""
    return min(common.losses_apart(losses, plain["ranks"][0]["losses"]) for plain in reference)


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
        *common.heading(args.label, f"Command: `{raw['command']}`"),
        f"Machine: {raw['machine']}. Medians of the runs listed, run in rounds. "
        f"{'One cache dir per job (one node)' if args.node_cache else 'An empty cache dir per rank (separate nodes)'}; "
        f"{args.steps} steps, then one at a new shape (a recompile).",
        "",
        *common.table_head("model", "N", "launcher", "all steps (s)", "÷ plain N=1", "runs (s)", "step 1 (s)",
                           "÷ plain N=1", "FX compiles (sum)", "plain N=1 compiles",
                           "split graphs through AOTAutograd (sum) / split graphs", "losses: ranks equal",
                           "losses vs plain N=1"),
    ]
    for r in table:
        split = r.get("split_aot")
        lines.append(
            f"| {r['model']} | {r['n']} | {r['launcher']} | {r['all_steps_s']:.1f} | {r['ratio']:.2f}× | "
            f"{', '.join(f'{t:.1f}' for t in r['runs_s'])} | {r['step1_s']:.1f} | {r['step1_ratio']:.2f}× | "
            f"{r['fx_compiles']:g} | {r['fx_compiles_alone']:g} | {f'{split[0]} / {split[1]}' if split else '-'} | "
            f"{'yes' if r['ranks_equal'] else '**no**'} | {common.apart(r['vs_plain'])} |"
        )
    return "\n".join(lines) + "\n"


def run_suite(args: argparse.Namespace) -> None:
    if args.from_json:
        sources = [json.loads(Path(path).read_text()) for path in args.from_json]
        raw = {"command": " and ".join(source["command"] for source in sources),
               "machine": "; ".join(dict.fromkeys(source["machine"] for source in sources))}
        table = make_table(sources)
        common.write_section(Path(args.out), args.label, markdown(args, raw, table))
        print(markdown(args, raw, table))
        return
    plain_ranks = sorted({1, *(args.ranks if args.plain_ranks is None else args.plain_ranks)})
    ours = [(launcher, n) for n in args.ranks for launcher in ("coordinator", "traced")
            if launcher == "coordinator" or n in args.traced]
    plan = [("plain", 1)] + ours + [("plain", n) for n in plain_ranks if n > 1]
    raw = common.record("model_suite.py", args, runs={})
    table: list[dict] = []
    for model in args.models:
        runs: dict[tuple[str, int], list[dict]] = {}
        for rep in range(args.repeat):
            for launcher, n in plan:
                result = suite_job(model, n, launcher, args)
                runs.setdefault((launcher, n), []).append(result)
                print(f"{model} N={n} {launcher:<11} run {rep + 1}: all steps {result['all_steps_s']:6.1f}s, "
                      f"step 1 {result['step1_s']:6.1f}s, FX compiles {[r['fx_misses'] for r in result['ranks']]}",
                      flush=True)
                raw["runs"][model] = {f"{launcher_}-n{n_}": r for (launcher_, n_), r in runs.items()}
                table = make_table([raw])
                save_run(args, raw, table)
    print(markdown(args, raw, table))


# -- --split: cold starts, stock against ours, per split frame ----------------------------


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


def per_frame(job: dict) -> list[list[dict]]:
    """Per split frame of ours' job, the counts of each rank that ran it."""
    per_rank = [common.split_shares(r).get("frames") or [] for r in job["ranks"]]
    return [[f[n] for f in per_rank if len(f) > n] for n in range(max(map(len, per_rank), default=0))]


def frames(job: dict) -> list[tuple[int, int, int, int]]:
    """Per split frame, over the ranks: (graphs, compiled for the job, served, missed)."""
    return [(max(c["graphs"] for c in counted), sum(c["compiled"] for c in counted),
             sum(c["served"] for c in counted), sum(c["missed"] for c in counted)) for counted in per_frame(job)]


def frame_seconds(rank: dict, compile_id: str) -> float:
    """Seconds one rank spent compiling frame ``compile_id`` past its tracing: the backend
    of the frame's compile (DDPOptimizer's chain; ours' shares run inside it) and the
    backward graphs compiled lazily for it."""
    total = 0.0
    for record in rank.get("compiles", ()):
        if record["id"] != compile_id:
            continue
        total += (record["backend_s"] or 0.0) if record["forward"] else record["end"] - record["start"]
    return total


def rank_parts(job: dict) -> list[list[dict]]:
    """Per split frame, each rank's part: the submodules dealt to it, those it compiled (taken
    from other ranks' deals among them), its share's seconds and its chain's waits on others."""
    per_rank = [(r["rank"], common.split_shares(r).get("frames") or []) for r in job["ranks"]]
    return [[{"rank": rank, "dealt": f[n].get("dealt", 0), "compiled": f[n].get("compiled", 0),
              "taken": f[n].get("taken", 0), "share_s": f[n].get("share_s", 0.0), "waited_s": f[n].get("waited_s", 0.0)}
             for rank, f in sorted(per_rank) if len(f) > n]
            for n in range(max((len(f) for _, f in per_rank), default=0))]


def prices(job: dict, stock: dict) -> list[dict]:
    """Per split frame of ours' job: the seconds all its ranks spent on the frame, the
    seconds one stock rank spent on it (the mean over stock's ranks), and ours' shares and
    chains summed over ranks."""
    found = []
    for n, counted in enumerate(per_frame(job)):
        compile_id = counted[0].get("compile_id", "")
        if not compile_id:
            continue
        ours_s = sum(frame_seconds(r, compile_id) for r in job["ranks"])
        stock_s = sum(frame_seconds(r, compile_id) for r in stock["ranks"]) / len(stock["ranks"])
        found.append({"frame": n, "compile_id": compile_id, "ours_s": ours_s, "stock_s": stock_s,
                      "ratio": ours_s / stock_s if stock_s else float("nan"),
                      "shares_s": sum(f.get("share_s", 0.0) for f in counted),
                      "chains_s": sum(f.get("chain_s", 0.0) for f in counted)})
    return found


def split_row(job: dict, stock: dict, pair: int) -> dict:
    ranks = job["ranks"]
    steps, stock_steps = step_times(job), step_times(stock)
    return {
        "model": job["model"], "n": job["n"], "emulated": job.get("emulated", 0), "pair": pair,
        "job": job["job"], "wall_s": job["wall_s"],
        "ratio": job["wall_s"] / stock["wall_s"], "steps_s": steps,
        "step_ratios": [a / b for a, b in zip(steps, stock_steps, strict=True)],
        "compile_s": common.compile_seconds(ranks), "aot": common.aot_counts(ranks),
        "fx_compiled": sum(r["fx_misses"] for r in ranks), "frames": frames(job),
        "prices": prices(job, stock) if job["job"] != "stock cold" else [],
        "parts": rank_parts(job) if job["job"] != "stock cold" else [],
        "losses_apart": max(common.losses_apart(r["losses"], stock["ranks"][0]["losses"]) for r in ranks),
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


def split_markdown(args: argparse.Namespace, raw: dict, table: list[dict]) -> str:
    lines = [
        *common.heading(args.label, f"Command: `{raw['command']}`"),
        f"Machine: {raw['machine']}. Model size `{args.size}`, {args.steps} steps, then one at a new shape (a "
        f"recompile). {args.repeat} pair(s) of jobs per model and N, the first in the order {args.order}, then "
        "alternating; each job on empty Inductor and Triton dirs; ratios against the stock job of the same pair.",
        "",
        *common.table_head("model", "N", "pair", "job", "wall (s)", "÷ stock", "step 1 (s)", "÷ stock",
                           "recompile step (s)", "÷ stock", "compile inside, per rank (s)", "AOT miss / hit (bypass)",
                           "FX compiled", "per frame: graphs, shares compiled, served / missed in the chains",
                           "per frame: price, all ranks ÷ one stock rank (s; ours' shares + chains)",
                           "per frame, per rank: compiled (dealt + taken) share s / waited s", "losses vs stock"),
    ]
    for r in table:
        compile_s = ", ".join(f"{c:.1f}" for c in r["compile_s"])
        per_frame = "; ".join(f"{g}: {c}, {s} / {m}" for g, c, s, m in r["frames"]) or "-"
        price = "; ".join(f"{p['compile_id']}: {p['ratio']:.2f}× ({p['ours_s']:.1f} ÷ {p['stock_s']:.1f}; "
                          f"{p['shares_s']:.1f} + {p['chains_s']:.1f})" for p in r["prices"]) or "-"
        parts = "; ".join(f"#{n}: " + ", ".join(f"r{p['rank']} {p['compiled']} ({p['dealt']}+{p['taken']}) "
                                                f"{p['share_s']:.1f}/{p['waited_s']:.1f}" for p in frame)
                          for n, frame in enumerate(r.get("parts", []))) or "-"
        lines.append(
            f"| {r['model']} | {common.ranks_label(r['n'], r['emulated'])} | {r['pair'] + 1} | {r['job']} | "
            f"{r['wall_s']:.1f} | {r['ratio']:.2f}× | "
            f"{r['steps_s'][0]:.1f} | {r['step_ratios'][0]:.2f}× | {r['steps_s'][-1]:.1f} | "
            f"{r['step_ratios'][-1]:.2f}× | {compile_s} | {r['aot']['miss']} / {r['aot']['hit']} "
            f"({r['aot']['bypass']}) | {r['fx_compiled']} | {per_frame} | {price} | {parts} | "
            f"{common.apart(r['losses_apart'])} |")
    averaged = means(table)
    if averaged:
        lines += ["", "Means over the pairs, ours ÷ stock:", "",
                  *common.table_head("model", "N", "pairs", "wall", "step 1", "recompile step", "per frame: price")]
        lines += [f"| {m['model']} | {m['n']} | {m['pairs']} | {m['wall']:.2f}× | {m['step1']:.2f}× | "
                  f"{m['recompile']:.2f}× | {', '.join(f'{p:.2f}×' for p in m['prices']) or '-'} |" for m in averaged]
    return "\n".join(lines) + "\n"


def run_split(args: argparse.Namespace) -> None:
    raw = common.record("model_suite.py", args, jobs=[])
    table: list[dict] = []
    common.warm_page_cache()
    for model in args.models:
        for n in args.ranks:
            for pair in range(args.repeat):
                order = pair_order(args.order, pair)
                with tempfile.TemporaryDirectory(prefix="split-cold-") as tmp:
                    jobs = {}
                    for name in order:
                        env = {}
                        if args.profile_ranks:
                            Path(args.profile_ranks).mkdir(parents=True, exist_ok=True)
                            env["SUITE_PROFILE_SELF"] = str(Path(args.profile_ranks).resolve() / (
                                f"{args.label}-{model}-n{n}-pair{pair + 1}-{name.replace(' ', '-')}"))
                        if args.trace and name.startswith("ours"):
                            trace = Path(args.job_logs) / f"{args.label}-{model}-n{n}-pair{pair + 1}-trace"
                            env["COORDINATOR_TRACE"] = str(trace)
                        cache = Path(tmp) / name.replace(" ", "-")
                        jobs[name], _ = common.stock_or_ours_job(name, model, n, args, cache=cache, work=Path(tmp),
                                                                 store=Path(tmp) / "store", env=env,
                                                                 log_label=f"{args.label}-pair{pair + 1}")
                        jobs[name]["pair"] = pair
                        raw["jobs"].append(jobs[name])
                        save_run(args, raw, table)
                        print(f"{model} N={n} pair {pair + 1} {name:<10}: wall {jobs[name]['wall_s']:6.1f}s, steps "
                              f"{[round(s, 1) for s in step_times(jobs[name])]}", flush=True)
                        if "COORDINATOR_TRACE" in env:
                            report(Path(env["COORDINATOR_TRACE"]))
                    table += [split_row(jobs[name], jobs["stock cold"], pair) for name in order]
                save_run(args, raw, table)
    print(split_markdown(args, raw, table))


def report(trace: Path) -> None:
    """Print ours' job's report (the rank and frame tables) and keep it beside the trace."""
    done = subprocess.run([sys.executable, "-m", "coordinator.cli", "report", str(trace)], cwd=trace,
                          capture_output=True, text=True)
    (trace / "report.txt").write_text(done.stdout + done.stderr)
    print(done.stdout, flush=True)


# -- both ----------------------------------------------------------------------------------


def save_run(args: argparse.Namespace, raw: dict, table: list[dict]) -> None:
    section = (split_markdown if args.split else markdown)(args, raw, table)
    common.save(args.label, raw, section, results_dir=args.results_dir, out=args.out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--split", action="store_true",
                   help="cold starts of the split frames instead: pairs of jobs, stock cold and ours cold")
    common.add_suite_args(p, models=None, ranks=None, size=None,
                          helps={"models": "default: all; --split: llama phi3", "ranks": "default: 1 2 3; --split: 1 3",
                                 "size": "default: bench; --split: split"})
    p.add_argument("--repeat", type=int, default=None,
                   help="runs per row (default 3); --split: pairs of jobs per model and N, alternating their order "
                        "(default 1)")
    p.add_argument("--node-cache", action="store_true", help="one Inductor cache dir per job, not per rank")
    p.add_argument("--plain-ranks", type=int, nargs="*", default=None,
                   help="N for the plain rows beyond N=1 (default: every N in --ranks)")
    p.add_argument("--traced", type=int, nargs="*", default=[], metavar="N",
                   help="after the coordinator row of each N given, the same with --coordinator-trace (its cost)")
    p.add_argument("--from-json", nargs="+", default=None, metavar="FILE",
                   help="no runs: the table of the raw runs in these files (earlier invocations)")
    p.add_argument("--order", choices=tuple(ORDERS), default=None,
                   help="--split: the first pair's order (default stock-first)")
    p.add_argument("--trace", action="store_true",
                   help="--split: ours' jobs traced (COORDINATOR_TRACE); their reports kept in --job-logs")
    p.add_argument("--profile-ranks", default=None, metavar="DIR",
                   help="--split: each rank samples its own process with py-spy until its steps end, into "
                        "DIR/<label>-<model>-n<N>-pair<P>-<job>-rank<R>.txt (py-spy's raw format)")
    args = p.parse_args()
    foreign = SUITE_ONLY if args.split else SPLIT_ONLY
    given = ["--" + dest.replace("_", "-") for dest, unset in foreign.items() if getattr(args, dest) != unset]
    if given:
        p.error(f"{', '.join(given)}: {'not with' if args.split else 'only with'} --split")
    for dest, (suite, split) in DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, split if args.split else suite)
    if args.split and args.trace and not args.job_logs:
        p.error("--trace keeps the reports in --job-logs DIR: name it")
    (run_split if args.split else run_suite)(args)


if __name__ == "__main__":
    main()
