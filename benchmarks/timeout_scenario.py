"""NCCL-timeout scenario: one rank warm, one cold, a short NCCL timeout, DDP step 1.

    python benchmarks/gpu/nccl_timeout.py --timeout 10 [--coordinator] [model flags]

First fills a cache dir by compiling the model in a single process (the warm rank's
cache from an earlier run). Then a 2-rank NCCL job (torchrun --virtual-local-rank,
process-group timeout ``--timeout`` s): rank 0 uses the warm cache, rank 1 an empty one
and a starved compiler (``TORCHINDUCTOR_COMPILE_THREADS=1``, as on a node where 8 ranks
compile at once). Without the coordinator rank 0 reaches DDP's first all-reduce while
rank 1 still compiles, and the NCCL watchdog kills the job unless Inductor's own
extension on cache hits covers the gap. Prints one JSON line per run: the exit code,
whether the watchdog fired, and each rank's step-1 time.
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

ROOT = Path(__file__).resolve().parents[2]


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

    sys.path.insert(0, str(ROOT / "examples"))
    import coordinator
    from train import GPT

    logging.basicConfig(format=f"[rank{rank}] %(name)s: %(message)s")
    logging.getLogger("coordinator").setLevel(logging.INFO)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", timeout=timedelta(seconds=args.timeout))
    torch.manual_seed(0)
    model = torch.compile(GPT(256, args.dim, args.layers, 8, args.seq).cuda())
    gen = torch.Generator().manual_seed(rank)
    idx = torch.randint(256, (8, args.seq), generator=gen).cuda()
    if dist.get_world_size() > 1:
        model = nn.parallel.DistributedDataParallel(model)
        dist.barrier()
    start = time.time()
    context = coordinator.compile_once() if args.coordinator else contextlib.nullcontext()
    with context:
        model(idx, torch.roll(idx, -1, dims=1)).backward()
        torch.cuda.synchronize()
    print(f"RESULT rank {rank} step1 {time.time() - start:.2f}", flush=True)
    if dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


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
    p.add_argument("--no-starve", dest="starve_cold", action="store_false",
                   help="let the cold rank use Inductor's parallel compile workers")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--warm-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--log", default=None, help="append the job's output here")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    env = dict(os.environ, PYTHONPATH=str(ROOT), NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               PYTHONUNBUFFERED="1")
    model = ["--layers", str(args.layers), "--dim", str(args.dim), "--seq", str(args.seq), "--timeout", str(args.timeout),
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
    print(json.dumps({
        "coordinator": args.coordinator, "nccl_timeout_s": args.timeout, "exit_code": job.returncode,
        "watchdog_fired": "Watchdog caught collective operation timeout" in job.stdout,
        "step1_s_by_rank": steps, "warm_fill_s": round(fill_s, 1), "job_wall_s": round(job_s, 1),
        "model": {"layers": args.layers, "dim": args.dim, "seq": args.seq},
    }), flush=True)


if __name__ == "__main__":
    main()
