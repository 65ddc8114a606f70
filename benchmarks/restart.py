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

With ``--pairs K`` the restarts come in K pairs, alternating which goes first (``--pairs 2``:
stock, ours, ours, stock), and ratios are to the mean of stock's restarts.

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
A second table says where each job's wall went: launch (the launcher's start to the
script's first line), set-up (imports, model, NCCL), steps, exit (the last step to the
launcher's end, and of it the ranks' exit handlers), and how many entries ours prepared
ahead (``coordinator.features.prefetch``) and used.
Prints the table, writes the raw jobs to ``benchmarks/results/<label>.json`` and the table
into ``benchmarks/RESULTS.md``.

With ``--persist TARGET ...`` (``moto``: an S3 bucket of a moto server started here, on this
machine; ``file``: a ``file://`` dir; or any store URL), ours' cold job also writes its compile
to the first target's persistent layer and saves its bundle there, and three more jobs follow,
each on a new EMPTY cache dir with the job's own TCPStore as the live store:

* ``ours restart, persist T`` for each target T: from the persistent layer alone (the other
  targets get a copy of the first one's objects first, untimed);
* ``ours restart, bundle``: from the first target's bundle alone (``--coordinator-restore``).

Below the table: the bundle's size, its save time (at the cold job's exit) and its fetch and
install times, and what each rank's exit waited for its persistent writes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import common

JOBS = ("stock cold", "ours cold", "stock restart", "ours restart")


def restart_names(pairs: int) -> list[str]:
    """The restarts after the cold jobs: ``pairs`` pairs, alternating which goes first
    (stock, ours, ours, stock, ...); the first pair is named as in ``JOBS``, a later one
    with its number."""
    names = []
    for i in range(pairs):
        pair = [f"stock restart{'' if i == 0 else f' {i + 1}'}", f"ours restart{'' if i == 0 else f' {i + 1}'}"]
        names += pair if i % 2 == 0 else pair[::-1]
    return names


def is_stock_restart(name: str) -> bool:
    return name.startswith("stock restart")


def is_ours_restart(name: str) -> bool:
    """An ours' restart from the live store (not one from the persistent layer, a bundle or a variant)."""
    return re.fullmatch(r"ours restart( \d+)?", name) is not None


def variant_env(name: str) -> tuple[str, str] | None:
    """The variable and value of a ``--variant`` restart's name (``ours restart, VAR=VALUE #k``)."""
    found = re.fullmatch(r"ours restart, (\w+)=(\S*)( #\d+)?", name)
    return (found.group(1), found.group(2)) if found else None


def with_variants(names: list[str], variants: list[str]) -> list[str]:
    """``names`` with each ``--variant`` restart after each of ours' restarts from the live store."""
    out = []
    for name in names:
        out.append(name)
        if is_ours_restart(name):
            k = sum(is_ours_restart(n) for n in out)
            out += [f"ours restart, {variant}" + ("" if k == 1 else f" #{k}") for variant in variants]
    return out


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def run_job(name: str, model: str, n: int, dirs: dict[str, Path], args: argparse.Namespace,
            profile: str | None = None, persist: dict[str, str] | None = None) -> dict:
    """One of the jobs (``JOBS``, and with ``--persist`` the restarts from each target and from a
    bundle): the stock restart on the cache dir its cold job left, every other job on its own."""
    ours = name.startswith("ours")
    cache = dirs["stock cold"] if is_stock_restart(name) else dirs[name]
    store: Path | None = dirs["store"]
    env = {}
    if ours and args.precompile:
        env["COORDINATOR_PRECOMPILE"] = "1"
    if persist and name == "ours cold":  # also into the first target: its persistent layer and a bundle
        first = next(iter(persist.values()))
        env.update(COORDINATOR_PERSIST=first, COORDINATOR_SAVE_BUNDLE=first)
    elif variant_env(name):  # a variant: ours' restart with one more variable set
        env.update([variant_env(name)])
    elif persist and name.startswith("ours restart, "):  # the job's own TCPStore, and one source each
        store = None
        target = name.removeprefix("ours restart, ")
        if target == "bundle":
            env["COORDINATOR_RESTORE_BUNDLE"] = next(iter(persist.values()))
        else:
            env["COORDINATOR_PERSIST"] = persist[target.removeprefix("persist ")]
    if ours and args.bypass_split_graphs and name == "ours cold":
        env["COORDINATOR_CACHE_DDP_GRAPHS"] = "0"  # no split graph in the store: the restart runs AOTAutograd
    job, output = common.stock_or_ours_job(name, model, n, args, cache=cache, work=dirs["work"], store=store, env=env,
                                           profile=profile)
    return {**job, **transfer_times(output)}


def transfer_times(log: str) -> dict:
    """What a job's log says of its bundle and persistent-layer transfers."""
    found: dict = {}
    saved = re.search(r"saved a ([\d.]+) MB bundle as \S+ in \S+ in ([\d.]+)s", log)
    if saved:
        found["bundle_mb"], found["bundle_save_s"] = float(saved.group(1)), float(saved.group(2))
    restored = re.search(r"'fetch_s': ([\d.]+), 'install_s': ([\d.]+)", log)
    if restored:
        found["bundle_fetch_s"], found["bundle_install_s"] = float(restored.group(1)), float(restored.group(2))
    writes = re.findall(r"wrote (\d+) values \(([\d.]+) MB\) to the persistent layer \S+; ([\d.]+)s at exit", log)
    if writes:
        found["persist_written"] = sum(int(w[0]) for w in writes)
        found["persist_mb"] = sum(float(w[1]) for w in writes)
        found["persist_exit_s"] = max(float(w[2]) for w in writes)
    return found


class MotoServer:
    """moto's S3 server on this machine (``--persist moto``), its endpoint and test credentials
    in this process's environment, which the jobs inherit."""

    def __init__(self, workdir: Path) -> None:
        from coordinator.testing import free_port

        port = free_port()
        self.log = open(workdir / "moto.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        if not common.wait_for_port(port, 30, self.proc):
            raise SystemExit("moto's server did not start: pip install 'moto[s3]' flask flask-cors")
        os.environ.update(AWS_ENDPOINT_URL_S3=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                          AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                          AWS_EC2_METADATA_DISABLED="true")
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).call_s3("create_bucket", Bucket="coordinator-bench")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


def persist_targets(targets: list[str], where: str, tmp: Path) -> dict[str, str]:
    """Each ``--persist`` target's label and URL, for one model and world size (``where``)."""
    urls = {}
    for target in targets:
        if target == "moto":
            urls[target] = f"s3://coordinator-bench/{where}"
        elif target == "file":
            urls[target] = f"file://{tmp / 'persist'}"
        else:
            urls[target] = target.rstrip("/") + "/" + where
    return urls


def copy_objects(src_url: str, dst_url: str) -> None:
    """Every object of one store into another (untimed, between two jobs)."""
    from coordinator.protocol.stores import open_store

    src, dst = open_store(src_url), open_store(dst_url)
    for key in src.list_keys(""):
        value = src.get(key)
        if value is not None:
            dst.set(key, value)


def timeline(job: dict) -> dict:
    """Where a job's wall went: launch (the launcher's start to the script's first line, the
    earliest rank), set-up (to the first step: imports, model, NCCL), steps, exit (the last
    step to the launcher's end) and, of it, the ranks' exit handlers (the longest)."""
    ranks = job["ranks"]
    if not all("script_began" in r for r in ranks):
        return {}
    launched = min(r["launched"] for r in ranks)
    began = min(r["script_began"] for r in ranks)
    start = max(r["start"] for r in ranks)
    last = max(r["step_ends"][-1] for r in ranks)
    return {"launch_s": began - launched, "setup_s": start - began, "steps_s": last - start,
            "exit_s": launched + job["wall_s"] - last,
            "imports_s": max(r["imported"] - r["script_began"] for r in ranks),
            "exit_handlers_s": max(r.get("exit_handlers_s", 0.0) for r in ranks),
            "workers_shutdown_s": max(r.get("workers_shutdown_s", 0.0) for r in ranks)}


def row(job: dict, stock_restart_s: float, cold_losses: list[str]) -> dict:
    ranks = job["ranks"]
    served = sum(((r.get("stats") or {}).get("ddp_split_graphs") or {}).get("served", 0) for r in ranks)
    prefetch = [(r.get("stats") or {}).get("prefetch") or {} for r in ranks]
    return {
        "model": job["model"], "n": job["n"], "job": job["job"], "wall_s": job["wall_s"],
        "ratio": job["wall_s"] / stock_restart_s,
        "compile_s": common.compile_seconds(ranks), "compile_all_s": common.compile_seconds(ranks, "total_wall_time"),
        "aot": common.aot_counts(ranks), "served": served, "loads_s": ranks[0].get("module_loads_s", 0.0),
        "losses_apart": max(common.losses_apart(r["losses"], cold_losses) for r in ranks),
        "frames": sum(r.get("frames_traced", 0) for r in ranks),
        "prepared": sum(p.get("prepared", 0) for p in prefetch), "used": sum(p.get("used", 0) for p in prefetch),
        **timeline(job),
    }


def markdown(args: argparse.Namespace, raw: dict, table: list[dict]) -> str:
    lines = [
        *common.heading(args.label, f"Command: `{raw['command']}`"),
        f"Machine: {raw['machine']}. Model size `{args.size}`, {args.steps} steps, then one at a new shape (a "
        "recompile). Stock restarts on the cache dir its cold job left; ours restarts from the store with an "
        "empty one.",
        "",
        *common.table_head("model", "N", "job", "wall (s)", "÷ stock restart", "compile inside, per rank (s)",
                           "AOT hit / miss / bypass", "DDP split graphs served", "frames traced, all ranks",
                           "module loads, rank 0 (s)", "losses vs its cold job"),
    ]
    for r in table:
        compile_s = ", ".join(f"{a:.1f} ({b:.1f})" for a, b in zip(r["compile_s"], r["compile_all_s"], strict=True))
        if r["job"].startswith("ours restart, "):
            r = dict(r, job=r["job"] + f" ({r['wall_s'] / r['file_restart_s']:.2f}× ours restart)")
        lines.append(
            f"| {r['model']} | {r['n']} | {r['job']} | {r['wall_s']:.1f} | {r['ratio']:.2f}× | {compile_s} | "
            f"{r['aot']['hit']} / {r['aot']['miss']} / {r['aot']['bypass']} | {r['served']} | {r.get('frames', '')} | "
            f"{r['loads_s']:.2f} | {common.apart(r['losses_apart'])} |"
        )
    timed = [r for r in table if "launch_s" in r]
    if timed:
        lines += ["", "Where each job's wall went (s): launch (the launcher's start to the script's first line), "
                  "set-up (imports, model, NCCL, to the first step; of it torch's import), the steps, exit (the "
                  "last step to the launcher's end; of it Inductor's compile workers' shutdown and the other exit "
                  "handlers, the longest rank each), and the entries prepared "
                  "ahead and used (all ranks):", "",
                  *common.table_head("model", "N", "job", "launch", "set-up (torch import)", "steps",
                                     "exit (workers, handlers)", "prepared / used")]
        for r in timed:
            lines.append(f"| {r['model']} | {r['n']} | {r['job']} | {r['launch_s']:.1f} | {r['setup_s']:.1f} "
                         f"({r['imports_s']:.1f}) | {r['steps_s']:.1f} | {r['exit_s']:.1f} "
                         f"({r['workers_shutdown_s']:.1f}, {r['exit_handlers_s']:.1f}) | "
                         f"{r['prepared']} / {r['used']} |")
    for model, n in dict.fromkeys((r["model"], r["n"]) for r in table):
        jobs = [r for r in table if (r["model"], r["n"]) == (model, n)]
        stock = [r["wall_s"] for r in jobs if is_stock_restart(r["job"])]
        ours = [r for r in jobs if is_ours_restart(r["job"])]
        cold = [r["wall_s"] for r in jobs if r["job"] == "stock cold"]
        if len(stock) > 1 and ours and cold:
            ours_s = mean([r["wall_s"] for r in ours])
            lines += ["", f"{model} N={n}, means of {len(stock)} restarts each: stock {mean(stock):.1f} s, ours "
                          f"{ours_s:.1f} s: **{ours_s / mean(stock):.2f}×** stock's restart, "
                          f"**{ours_s / cold[0]:.2f}×** stock's cold job; ours' compile inside, per rank, at most "
                          f"{max(max(r['compile_s']) for r in ours):.1f} s"]
            for variant in args.variant:
                walls = [r["wall_s"] for r in jobs if r["job"].startswith(f"ours restart, {variant}")]
                lines.append(f"; ours with {variant}: {mean(walls):.1f} s, {mean(walls) / ours_s:.2f}× ours' restart")
            if all("launch_s" in r for r in jobs):
                for part in ("launch_s", "exit_s"):
                    stock_part = mean([r[part] for r in jobs if is_stock_restart(r["job"])])
                    ours_part = mean([r[part] for r in ours])
                    lines.append(f"; {part[:-2]}: ours {ours_part:.1f} s, stock {stock_part:.1f} s "
                                 f"({ours_part - stock_part:+.1f} s)")
    transfers = [job for job in raw["jobs"] if any(k in job for k in ("bundle_save_s", "bundle_fetch_s",
                                                                       "persist_written"))]
    if transfers:
        lines.append("")
    for job in transfers:
        parts = []
        if "bundle_save_s" in job:
            parts.append(f"bundle {job['bundle_mb']:.1f} MB saved in {job['bundle_save_s']:.2f} s at exit")
        if "bundle_fetch_s" in job:
            parts.append(f"bundle fetched and verified in {job['bundle_fetch_s']:.2f} s, installed in "
                         f"{job['bundle_install_s']:.2f} s")
        if "persist_written" in job:
            parts.append(f"{job['persist_written']} values ({job['persist_mb']:.1f} MB) written to the persistent "
                         f"layer, exit waited {job['persist_exit_s']:.1f} s for them")
        lines.append(f"- {job['model']} N={job['n']} {job['job']}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_suite_args(p, models=["llama", "convnext"], ranks=[1, 3], size="bench")
    p.add_argument("--precompile", action="store_true", help="ours with precompiled functions (setting precompile)")
    p.add_argument("--bypass-split-graphs", action="store_true",
                   help="ours' cold job with cache_ddp_graphs off: no split graph is in the store, so ours' restart "
                        "runs AOTAutograd for every one, as stock's does (the cost of split graphs that are refused)")
    p.add_argument("--profile-restarts", default=None, metavar="DIR",
                   help="after the four jobs, run both restarts once more under cProfile into DIR (not timed)")
    p.add_argument("--pairs", type=int, default=1,
                   help="restart pairs after the cold jobs, alternating which goes first (2: stock, ours, ours, "
                        "stock); ratios are to the mean of stock's restarts")
    p.add_argument("--variant", action="append", default=[], metavar="VAR=VALUE",
                   help="after each of ours' restarts, one more with this variable set (repeatable): what a "
                        "setting or a torch switch changes, on the same machine")
    p.add_argument("--persist", nargs="+", default=None, metavar="TARGET",
                   help="also restart from a persistent layer, and from a bundle: moto (a moto S3 server started "
                        "here), file (a file:// dir) or a store URL; ours' cold job writes to the first")
    args = p.parse_args()
    raw = common.record("restart.py", args, jobs=[])
    table: list[dict] = []
    common.warm_page_cache()
    names = with_variants([*JOBS[:2], *restart_names(args.pairs)], args.variant)
    if args.persist:
        names += [f"ours restart, persist {target}" for target in args.persist] + ["ours restart, bundle"]
    moto = None
    if args.persist and "moto" in args.persist:
        moto_dir = Path(tempfile.mkdtemp(prefix="restart-moto-"))
        moto = MotoServer(moto_dir)
    for model in args.models:
        for n in args.ranks:
            with tempfile.TemporaryDirectory(prefix="restart-") as tmp:
                dirs = {"work": Path(tmp), "store": Path(tmp) / "store",
                        **{name: Path(tmp) / re.sub(r"[ ,]+", "-", name) for name in names
                           if not is_stock_restart(name)}}
                persist = (persist_targets(args.persist, f"{args.label}-{model}-n{n}", Path(tmp))
                           if args.persist else None)
                jobs = {}
                for name in names:
                    target = name.removeprefix("ours restart, persist ")
                    if persist and target != name and target != args.persist[0]:
                        copy_objects(persist[args.persist[0]], persist[target])
                    jobs[name] = run_job(name, model, n, dirs, args, persist=persist)
                    raw["jobs"].append(jobs[name])
                    save_run(args, raw, table)  # the raw jobs so far, should a later one not finish
                    print(f"{model} N={n} {name:<13}: wall {jobs[name]['wall_s']:6.1f}s, compile "
                          f"{[round(t, 1) for t in common.compile_seconds(jobs[name]['ranks'])]}",
                          flush=True)
                stock_restart_s = mean([jobs[name]["wall_s"] for name in names if is_stock_restart(name)])
                ours_restart_s = mean([jobs[name]["wall_s"] for name in names if is_ours_restart(name)])
                for name in names:
                    cold = jobs["ours cold" if name.startswith("ours") else "stock cold"]["ranks"][0]["losses"]
                    table.append(dict(row(jobs[name], stock_restart_s, cold), file_restart_s=ours_restart_s))
                if args.profile_restarts:  # once more each, profiled; not in the table
                    Path(args.profile_restarts).mkdir(parents=True, exist_ok=True)
                    for name in ("stock restart", "ours restart"):
                        if name == "ours restart":
                            dirs[name] = Path(tmp) / "ours-restart-profiled"
                        run_job(name, model, n, dirs, args,
                                profile=str(Path(args.profile_restarts) / f"{model}-n{n}-{name.replace(' ', '-')}"))
            save_run(args, raw, table)
    if moto is not None:
        moto.close()
    print(markdown(args, raw, table))


def save_run(args: argparse.Namespace, raw: dict, table: list[dict]) -> None:
    common.save(args.label, raw, markdown(args, raw, table), results_dir=args.results_dir, out=args.out)


if __name__ == "__main__":
    main()
