"""Timeout scenario: one rank warm, one cold, a short process-group timeout, DDP step 1.

    python benchmarks/timeout_scenario.py --timeout 10 [--coordinator] [model flags]

First fills a cache dir by compiling the model in a single process (the warm rank's
cache from an earlier run). Then a 2-rank job (torchrun --virtual-local-rank,
process-group timeout ``--timeout`` s; NCCL on GPUs, gloo on CPU): rank 0 uses the warm
cache, rank 1 an empty one and a starved compiler (``TORCHINDUCTOR_COMPILE_THREADS=1``,
as on a node where 8 ranks compile at once) and, with ``--cold-extra-s S``, S more
seconds in each graph it compiles (a post-grad pass with a constant uuid, installed in the
fill too so keys match: it stands in for a slower compile, such as max-autotune's, and
for the NCCL run outruns Inductor's own timeout extension on cache hits, which adds the
compile time the warm entries record). Without the coordinator rank 0 reaches
DDP's first all-reduce while rank 1 still compiles, and the collective times out (the
NCCL watchdog kills the job unless Inductor's own extension on cache hits covers the
gap; gloo has no such extension). With ``--coordinator`` (``compile_once`` over the
job's store), rank 0 publishes its local graphs or waits on the store while rank 1
compiles. Prints one JSON line per run: the exit code, whether a collective timed out,
each rank's step-1 time and what the coordinator did.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    if rank == 0 and args.warm_dir:
        cache = args.warm_dir
    else:
        cache = tempfile.mkdtemp(prefix=f"timeout-rank{rank}-")
        if args.starve_cold:
            os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    import contextlib
    import logging

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    import coordinator
    from coordinator.testing import GPT

    job = int(os.environ["WORLD_SIZE"]) > 1  # not the one-process fill
    extra_s = args.cold_extra_s if job and cache != args.warm_dir else 0.0

    class SlowCompile(CustomGraphPass):
        """Sleeps ``extra_s`` in each graph this process really compiles (never on a cache hit)."""

        def __call__(self, graph) -> None:
            time.sleep(extra_s)

        def uuid(self) -> str:  # constant, so the FX keys match across ranks and the fill
            return "timeout-scenario-slow-compile"

    inductor_config.post_grad_custom_post_pass = SlowCompile()

    logging.basicConfig(format=f"[rank{rank}] %(name)s: %(message)s")
    logging.getLogger("coordinator").setLevel(logging.INFO)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timedelta(seconds=args.timeout))
    torch.manual_seed(0)
    model = torch.compile(GPT(256, args.dim, args.layers, 8, args.seq).to(device))
    gen = torch.Generator().manual_seed(rank)
    idx = torch.randint(256, (args.batch, args.seq), generator=gen).to(device)
    # DDP in the one-process fill too: Dynamo splits DDP graphs at bucket boundaries, and
    # the warm cache must hold the graphs the 2-rank job looks up.
    model = nn.parallel.DistributedDataParallel(model)
    dist.barrier()
    start = time.time()
    context = coordinator.compile_once() if args.coordinator else contextlib.nullcontext()
    with context:
        model(idx, torch.roll(idx, -1, dims=1)).backward()
        if device == "cuda":
            torch.cuda.synchronize()
    print(f"RESULT rank {rank} step1 {time.time() - start:.2f}", flush=True)
    if args.coordinator:
        print(f"STATS rank {rank} {json.dumps(coordinator.stats())}", flush=True)
    if dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()
    # Leave without running destructors: freeing the DDP reducer of the one-rank gloo fill
    # can deadlock on torch 2.13 (~ProcessGroupGloo joins its worker thread while holding the
    # GIL, and that thread needs the GIL to free a finished work's thread-local state).
    sys.stdout.flush()
    os._exit(0)


#: What a timed-out collective prints: the NCCL watchdog, gloo's transport.
TIMEOUT_MESSAGES = ("Watchdog caught collective operation timeout", "Timed out waiting")
REPORTED = ("graphs_compiled", "graphs_received", "graphs_shared_from_local_cache", "waited_s")


def torchrun(n: int, argv: list[str], env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--virtual-local-rank",
           f"--nproc-per-node={n}", __file__, "--worker", *argv]
    return subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--coordinator", action="store_true")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--no-starve", dest="starve_cold", action="store_false",
                   help="let the cold rank use Inductor's parallel compile workers")
    p.add_argument("--cold-extra-s", type=float, default=0.0,
                   help="seconds added to each graph the cold rank compiles (stands in for a slower compile)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--warm-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--log", default=None, help="append the job's output here")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    env = dict(os.environ, PYTHONPATH=str(ROOT), NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    model = ["--layers", str(args.layers), "--dim", str(args.dim), "--seq", str(args.seq), "--batch", str(args.batch),
             "--timeout", str(args.timeout), "--cold-extra-s", str(args.cold_extra_s),
             *([] if args.starve_cold else ["--no-starve"])]
    with tempfile.TemporaryDirectory() as warm:
        started = time.monotonic()
        fill = torchrun(1, [*model, "--warm-dir", warm], env)
        assert fill.returncode == 0, fill.stdout[-3000:]
        fill_s = time.monotonic() - started
        started = time.monotonic()
        job = torchrun(2, [*model, "--warm-dir", warm, *(["--coordinator"] if args.coordinator else [])], env)
        job_s = time.monotonic() - started
    if args.log:
        with open(args.log, "a") as f:
            f.write(f"===== coordinator={args.coordinator} timeout={args.timeout}s rc={job.returncode}\n{job.stdout}\n")
    steps = {rank: float(s) for rank, s in re.findall(r"RESULT rank (\d+) step1 ([\d.]+)", job.stdout)}
    stats = {int(rank): json.loads(s) for rank, s in re.findall(r"STATS rank (\d+) (.*)", job.stdout)}
    print(json.dumps({
        "coordinator": args.coordinator, "pg_timeout_s": args.timeout, "exit_code": job.returncode,
        "collective_timed_out": any(text in job.stdout for text in TIMEOUT_MESSAGES),
        "step1_s_by_rank": steps, "warm_fill_s": round(fill_s, 1), "job_wall_s": round(job_s, 1),
        "coordinator_by_rank": {rank: {k: s[k] for k in REPORTED} for rank, s in sorted(stats.items())},
        "model": {"layers": args.layers, "dim": args.dim, "seq": args.seq, "batch": args.batch},
        "cold_extra_s_per_graph": args.cold_extra_s,
    }), flush=True)


if __name__ == "__main__":
    main()
