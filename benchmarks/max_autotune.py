"""Max-autotune: time until every rank finishes step 1, against one stock rank.

    python benchmarks/max_autotune.py --label gpu1-mac --gpus 1 --rows stock:1 ours:2 ours:4 \\
        -- --dim 512 --seq 256 --layers 4 --mode max-autotune-no-cudagraphs

Rows (``kind:N``, run once each, in the order given; one invocation is one device call):

* ``stock:N``: N ranks compiling alone, no coordinator (``stock:1`` is the reference every
  ratio divides by: one stock rank alone on the same machine, in the same invocation);
* ``ours:N``: ``compile_once`` over the job's store with its defaults (each GEMM choice
  compiled once, early backward compiles on);
* ``noearly:N``: ``compile_once`` with ``COORDINATOR_EARLY_BACKWARD=0``;
* ``twice:N``: ``compile_once`` with neither early backward compiles nor each choice compiled
  once (``COORDINATOR_COMPILE_CHOICES_ONCE=0``: Inductor's own precompile);
* ``upstream:N``: no coordinator, every rank compiling with Inductor's
  ``TORCHINDUCTOR_DISTRIBUTED_MAX_AUTOTUNE_GEMM=1``.

With ``--gpus G``, N <= G runs one rank per GPU over NCCL, N > G shares the G GPUs over
gloo (``benchmarks/cold_start_job.py``, the example GPT under DDP). Columns: all ranks done
(s), ÷ ours:1 and ÷ stock:1, FX graphs each rank compiled (and of them the backward graphs it
compiled early), Triton compiles summed over ranks, the most bytes one rank received, each
rank's steady step time, and the machine's mean busy CPU cores and GPU utilization over the
job (ranks that share a host share its cores: where one rank keeps them busy, N ranks cannot
finish N times sooner). Rows that would not start before ``--budget-s`` are
skipped; a row still running at the end of the budget is killed and shown as a lower bound
(a killed ``stock:1`` makes the ratios upper bounds). Prints the table and one JSON line per run, writes the runs to
``benchmarks/results/<label>.json`` and the table into ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import common

KINDS = {  # kind -> (cold_start_job method, extra environment)
    "stock": ("alone", {}),
    "ours": ("compile-once", {}),
    "noearly": ("compile-once", {"COORDINATOR_EARLY_BACKWARD": "0"}),
    "twice": ("compile-once", {"COORDINATOR_COMPILE_CHOICES_ONCE": "0", "COORDINATOR_EARLY_BACKWARD": "0"}),
    "upstream": ("alone", {"TORCHINDUCTOR_DISTRIBUTED_MAX_AUTOTUNE_GEMM": "1"}),
}


def summarize(row: str, run: dict, reference_s: float | None) -> dict:
    ranks = run["ranks"]
    return {
        "row": row,
        "all_done_s": round(run["all_done_s"], 2),
        "ratio": round(run["all_done_s"] / reference_s, 3) if reference_s else None,
        "fx_compiles": sum(r["fx_misses"] for r in ranks),
        "triton_compiles": sum(r["triton_compiles"] for r in ranks),
        "follower_bytes": max((r["stats"].get("bytes_received", 0) for r in ranks if r["stats"]), default=0),
        "graphs_per_rank": [r["fx_misses"] for r in ranks],
        "early_backward": [(r["stats"].get("early_backward") or {}).get("compiled", 0) for r in ranks],
        "step2_ms": [round(1000 * r["step2_s"], 1) for r in ranks if r.get("step2_s") is not None],
        "cpu_busy_cores": run.get("cpu_busy_cores"),
        "gpu_busy_percent": run.get("gpu_busy_percent"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_output_args(p)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--rows", nargs="+", default=["stock:1", "ours:2"])
    p.add_argument("--budget-s", type=float, default=560,
                   help="seconds for all rows; a row still running then is killed")
    p.add_argument("job_args", nargs=argparse.REMAINDER, help="after --: model flags for cold_start_job.py")
    args = p.parse_args()
    job_args = [a for a in args.job_args if a != "--"]
    rows = []
    for spec in args.rows:
        kind, _, n = spec.partition(":")
        if kind not in KINDS or not n.isdigit():
            p.error(f"rows are kind:N with kind in {sorted(KINDS)}: {spec}")
        rows.append((spec, kind, int(n)))
    started = time.monotonic()
    reference_s = None
    reference_is_bound = False  # stock:1 was killed at its deadline: it took longer
    ours_one_s = None  # ours:1 in the same invocation: the ratio the N-rank rows are judged by
    raw = {"command": common.command("max_autotune.py"), "runs": [], "skipped": []}
    table = []
    for spec, kind, n in rows:
        left = args.budget_s - (time.monotonic() - started)
        if left < 30:
            raw["skipped"].append(spec)
            print(f"{spec}: skipped ({left:.0f}s of the budget left)", flush=True)
            continue
        method, env = KINDS[kind]
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            log = common.log_file(args.job_logs, f"{args.label}-{kind}-{n}.log")
            run = common.run_cold_start_job(n, method, job_args, gpus=args.gpus, timeout=left, log=log)
        except common.JobTimedOut as exc:  # a lower bound: the row took longer than this
            if spec == "stock:1":
                reference_s, reference_is_bound = exc.seconds, True
            row = {"row": spec, "timed_out_after_s": round(exc.seconds, 1)}
            table.append(row)
            raw["runs"].append(row)
            print(json.dumps(row), flush=True)
            continue
        except Exception as exc:  # a row past the budget or failing: keep the others
            raw["skipped"].append(spec)
            print(f"{spec}: {type(exc).__name__}: {exc}", flush=True)
            continue
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if spec == "stock:1":
            reference_s = run["all_done_s"]
        if spec == "ours:1":
            ours_one_s = run["all_done_s"]
        row = summarize(spec, run, reference_s)
        row["vs_ours_1"] = round(run["all_done_s"] / ours_one_s, 3) if ours_one_s else None
        row["ratio_is_upper_bound"] = reference_is_bound
        table.append(row)
        raw["runs"].append({**row, "run": run})
        print(json.dumps(row), flush=True)
        raw["machine"] = common.machine(args.gpus)
        common.save(args.label, raw, None, results_dir=args.results_dir)
    section = markdown(args.label, raw, table, job_args)
    print(section)
    common.write_section(Path(args.out), args.label, section)


def _or_dash(value: float | None, unit: str, of: int | None = None) -> str:
    if value is None:
        return "-"
    return f"{value:g}{unit}" + (f" of {of}" if of else "")


def markdown(label: str, raw: dict, table: list[dict], job_args: list[str]) -> str:
    lines = [
        *common.heading(label, f"Command: `{raw['command']}`"),
        f"Machine: {raw.get('machine', '?')}. Model flags: `{' '.join(job_args)}`. One run per row."
        + (f" Skipped (budget): {', '.join(raw['skipped'])}." if raw["skipped"] else ""),
        "",
        *common.table_head("row", "all ranks done step 1 (s)", "÷ ours:1", "÷ stock:1", "FX graphs compiled per rank",
                           "of them backward graphs compiled early", "Triton compiles", "most bytes a rank received",
                           "steps 2-6, median per rank (ms)", "CPU cores busy, mean", "GPU busy, mean"),
    ]
    for r in table:
        if "timed_out_after_s" in r:
            lines.append(f"| {r['row']} | > {r['timed_out_after_s']:.0f} (killed) |" + " - |" * 9)
            continue
        ratio = "-" if r["ratio"] is None else ("< " if r["ratio_is_upper_bound"] else "") + f"{r['ratio']:.2f}×"
        vs_ours = "-" if r.get("vs_ours_1") is None else f"{r['vs_ours_1']:.2f}×"
        lines.append(f"| {r['row']} | {r['all_done_s']:.2f} | {vs_ours} | {ratio} | "
                     f"{', '.join(map(str, r['graphs_per_rank']))} | {', '.join(map(str, r['early_backward']))} | "
                     f"{r['triton_compiles']} | {common.fmt_bytes(r['follower_bytes'])} | "
                     f"{', '.join(map(str, r['step2_ms']))} | "
                     f"{_or_dash(r.get('cpu_busy_cores'), '', os.cpu_count())} | "
                     f"{_or_dash(r.get('gpu_busy_percent'), '%')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
