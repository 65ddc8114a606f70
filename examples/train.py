"""A small GPT trained with DDP under torch.compile, compiling each graph once per job.

Run with torchrun, e.g. 4 ranks on a CPU machine (gloo) or one rank per GPU (NCCL):

    torchrun --standalone --nproc-per-node 4 examples/train.py

Every rank gets empty Inductor and Triton cache dirs of its own (``--shared-local-cache`` keeps
the usual one), as ranks on separate nodes would, so the run shows what the
coordinator saves: one rank compiles each graph, the others receive it over the job's
own TCPStore. ``--no-coordinator`` runs the same job with every rank compiling alone.
Rank 0 prints each rank's step-1 time and the coordinator's stats.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import coordinator
from coordinator.testing import GPT


def setup_distributed(fresh_cache: bool = True) -> torch.device:
    """Give this rank empty Inductor/Triton cache dirs (as on a node of its own), pick its
    device and join the process group: NCCL on GPUs, gloo on CPU."""
    if fresh_cache:
        fresh = tempfile.mkdtemp(prefix=f"inductor-rank{os.environ.get('RANK', 0)}-")
        atexit.register(shutil.rmtree, fresh, ignore_errors=True)  # nothing left in the temp dir
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = fresh
        os.environ["TRITON_CACHE_DIR"] = os.path.join(fresh, "triton")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        dist.init_process_group("nccl")
        return torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo")
    return torch.device("cpu")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--mode", default="default", help="torch.compile mode")
    p.add_argument("--store", default=None, help="compile_once store URL (default: the job's TCPStore)")
    p.add_argument("--no-coordinator", action="store_true", help="every rank compiles alone")
    p.add_argument("--shared-local-cache", action="store_true", help="keep Inductor's usual cache dir")
    p.add_argument("--json", default=None, help="rank 0 writes the per-rank results here")
    args = p.parse_args()

    device = setup_distributed(fresh_cache=not args.shared_local_cache)
    use_cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    vocab = 256
    model = GPT(vocab, args.dim, args.layers, heads=4, seq=args.seq).to(device)
    # Compile the module, then wrap it in DDP (on torch 2.13 Dynamo skips DDP's own forward).
    ddp = nn.parallel.DistributedDataParallel(torch.compile(model, mode=args.mode))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1234 + rank)

    context = contextlib.nullcontext() if args.no_coordinator else coordinator.compile_once(args.store)
    dist.barrier()
    start = time.time()
    step1 = None
    with context:
        for step in range(args.steps):
            idx = torch.randint(vocab, (args.batch, args.seq), generator=gen).to(device)
            loss = ddp(idx, torch.roll(idx, -1, dims=1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if use_cuda:
                torch.cuda.synchronize()
            if step == 0:
                step1 = time.time()
    from torch._dynamo.utils import counters

    mine = {
        "rank": rank,
        "start": start,
        "step1_end": step1,
        "step1_s": step1 - start,
        "loss": loss.item(),
        "fx_misses": counters["inductor"].get("fxgraph_cache_miss", 0),
        "fx_hits": counters["inductor"].get("fxgraph_cache_hit", 0),
        "stats": coordinator.stats() if not args.no_coordinator else {},
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        print(f"{'rank':>4} {'step 1 (s)':>10} {'compiled':>8} {'received':>8} {'waited (s)':>10} {'loss':>8}")
        for r in everyone:
            s = r["stats"]
            # Received from other ranks (a backward this rank compiled early is a local hit later).
            print(f"{r['rank']:>4} {r['step1_s']:>10.2f} {r['fx_misses']:>8} {s.get('graphs_received', 0):>8} "
                  f"{s.get('waited_s', 0.0):>10.2f} {r['loss']:>8.4f}")
        all_done = max(r["step1_end"] for r in everyone) - min(r["start"] for r in everyone)
        print(f"all {world} ranks finished step 1 in {all_done:.2f}s; "
              f"FX graphs compiled across ranks: {sum(r['fx_misses'] for r in everyone)}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "all_done_s": all_done, "ranks": everyone}, f)
    dist.barrier()
    # DDP before its process group: a gloo group destroyed by DDP's reducer, which holds the
    # interpreter lock, can wait forever on its worker thread, which needs that lock.
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
