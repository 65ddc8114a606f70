"""Cold start of an N-rank job: time until every rank has finished step 1.

For each N, runs ``examples/train.py`` under torchrun twice: every rank compiling
alone (each with an empty Inductor cache dir, as on separate nodes), and with
``compile_once`` over the job's own TCPStore. Prints a table and writes
``benchmarks/RESULTS.md`` (``--out``) with the command and the machine.

    python benchmarks/cold_start.py --ranks 1 2 4 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_job(n: int, coordinated: bool, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               str(ROOT / "examples" / "train.py"), "--steps", "2", "--json", str(out), *extra]
        if not coordinated:
            cmd.append("--no-coordinator")
        env = dict(os.environ, TMPDIR=tmp, OMP_NUM_THREADS="1")
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    p.add_argument("extra", nargs=argparse.REMAINDER, help="arguments passed to examples/train.py after --")
    args = p.parse_args()
    extra = [a for a in args.extra if a != "--"]

    rows = []
    baseline = None
    for n in args.ranks:
        for coordinated in (False, True):
            runs = [run_job(n, coordinated, extra) for _ in range(args.repeat)]
            times = [r["all_done_s"] for r in runs]
            median = statistics.median(times)
            if n == min(args.ranks) and not coordinated and n == 1:
                baseline = median
            rows.append({
                "n": n,
                "mode": "compile_once" if coordinated else "every rank compiles",
                "median_s": median,
                "runs_s": times,
                "compiled": runs[0]["ranks"] and sum(r["fx_misses"] for r in runs[0]["ranks"]),
                "received": sum(r["fx_hits"] for r in runs[0]["ranks"]),
            })
            row = rows[-1]
            print(f"N={n} {row['mode']:<20} {median:7.2f}s  runs {', '.join(f'{t:.1f}' for t in times)}  "
                  f"FX compiled {row['compiled']}, received {row['received']}", flush=True)

    header = "| N | mode | all ranks done step 1 (median s) | ÷ N=1 alone | runs (s) | FX graphs compiled (sum) | received |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for row in rows:
        ratio = f"{row['median_s'] / baseline:.2f}×" if baseline else "-"
        lines.append(f"| {row['n']} | {row['mode']} | {row['median_s']:.2f} | {ratio} | "
                     f"{', '.join(f'{t:.1f}' for t in row['runs_s'])} | {row['compiled']} | {row['received']} |")
    table = "\n".join(lines)
    print(table)

    import torch

    command = "python benchmarks/cold_start.py " + " ".join(sys.argv[1:])
    machine = f"{platform.node()}: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}"
    section = (
        f"## Cold start on CPU (gloo), {time.strftime('%Y-%m-%d')}\n\n"
        f"Command: `{command}`\n\nMachine: {machine}. Model: `examples/train.py` defaults "
        f"(GPT, 4 layers, d=128, T=64, batch 8, fwd+bwd+AdamW, DDP), each rank with an empty "
        f"Inductor cache dir. Time = from a barrier after `init_process_group` until the last rank "
        f"finishes step 1; median of {args.repeat} runs.\n\n{table}\n"
    )
    write_section(Path(args.out), section)


BEGIN, END = "<!-- cold_start.py: begin -->", "<!-- cold_start.py: end -->"


def write_section(path: Path, section: str) -> None:
    """Replace this script's section of RESULTS.md, keeping everything else."""
    text = path.read_text() if path.exists() else "# Benchmark results\n\n"
    block = f"{BEGIN}\n{section}{END}\n"
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) + 1 :]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


if __name__ == "__main__":
    main()
