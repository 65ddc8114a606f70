"""One cold-start job for ``benchmarks/cold_start.py``: every rank runs step 1 of the example GPT.

    torchrun --nproc-per-node N benchmarks/cold_start_job.py --method METHOD --json OUT [model flags]

Methods (how ranks get their compiled graphs):

* ``alone``: every rank compiles (empty cache dirs, as on separate nodes);
* ``inductor-redis``: PyTorch's own remote caches (FX graph, AOTAutograd, autotune),
  every rank pointed at one Redis server (``--redis-url``);
* ``megacache``: Mega-Cache by hand: rank 0 compiles (forward + backward through a DDP
  over a one-rank group, so no collective waits on it), saves the artifacts to the job's
  TCPStore; the others wait on the store, load them, then everyone runs step 1;
* ``compile-once``: ``coordinator.compile_once`` over the job's store (or ``--store URL``);
* ``bundle``: rank 0 compiles as for ``megacache``; the others wait on the store, then
  all ranks join ``coordinator.broadcast_bundle`` (NCCL under CUDA, gloo on CPU).

Time is measured from a barrier after ``init_process_group`` to the end of each rank's
step 1 (DDP forward, backward with its all-reduce, optimizer step). Rank 0 writes
every rank's figures to ``--json``. ``--cache-dir`` uses one given cache dir instead of
empty ones (for the local-warm reference). ``--emulate-gpus K`` puts local rank r on GPU
r mod K, to emulate more ranks than GPUs (use gloo then).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from self_profile import start_self_profile, stop_self_profile

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("alone", "inductor-redis", "megacache", "compile-once", "bundle")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--mode", default="default")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    p.add_argument("--emulate-gpus", type=int, default=0)
    p.add_argument("--store", default=None, help="compile-once store URL (default: the job's TCPStore)")
    p.add_argument("--redis-url", default=None, help="Redis for inductor-redis (and bytes moved)")
    p.add_argument("--cache-dir", default=None, help="use this Inductor cache dir instead of an empty one")
    p.add_argument("--profile-self", default=None, metavar="PREFIX",
                   help="sample this rank's process alone with py-spy until step 1 ends, into PREFIX-rank<R>.txt")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    rank_env = os.environ.get("RANK", "0")
    profile = f"{args.profile_self}-rank{rank_env}.txt" if args.profile_self else None
    sampler = start_self_profile(profile) if profile else None
    if os.environ.get("COLD_START_LOG_LEVEL"):  # the coordinator's log lines, for debugging a run
        import logging

        logging.basicConfig(format=f"[rank{rank_env}] %(relativeCreated)d ms %(name)s: %(message)s")
        logging.getLogger("coordinator").setLevel(os.environ["COLD_START_LOG_LEVEL"])
    if args.emulate_gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(int(os.environ.get("LOCAL_RANK", "0")) % args.emulate_gpus)
    cache = args.cache_dir or tempfile.mkdtemp(prefix=f"cold-start-rank{rank_env}-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    if args.method == "inductor-redis":
        from urllib.parse import urlparse

        url = urlparse(args.redis_url)
        os.environ.update(TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE="1", TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE="1",
                          TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE="1", TORCHINDUCTOR_REDIS_HOST=url.hostname,
                          TORCHINDUCTOR_REDIS_PORT=str(url.port))

    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import coordinator
    from coordinator.protocol.stores.c10d import C10dStore
    from coordinator.testing import GPT

    cuda = torch.cuda.is_available()
    triton_compiles = lambda: 0  # noqa: E731  (no Triton on CPU)
    if cuda:
        from coordinator.testing import count_triton_compiles

        triton_compiles = count_triton_compiles()
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(0 if args.emulate_gpus else local_rank % torch.cuda.device_count())
    backend = args.backend if args.backend != "auto" else ("nccl" if cuda else "gloo")
    dist.init_process_group(backend, timeout=timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    store = dist.distributed_c10d._get_default_store()

    torch.manual_seed(0)
    vocab = 256
    compiled = torch.compile(GPT(vocab, args.dim, args.layers, heads=4, seq=args.seq).to(device), mode=args.mode)
    ddp = nn.parallel.DistributedDataParallel(compiled)
    # Rank 0 compiles for megacache/bundle through a DDP of its own (a one-rank group), so
    # it compiles the graphs step 1 runs (Dynamo splits graphs at DDP's buckets) while no
    # collective waits on it. new_group is collective: every rank creates it.
    warm_up = None
    if args.method in ("megacache", "bundle"):
        solo = dist.new_group([0])
        if rank == 0:
            warm_up = nn.parallel.DistributedDataParallel(compiled, process_group=solo)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1234 + rank)
    idx = torch.randint(vocab, (args.batch, args.seq), generator=gen).to(device)
    targets = torch.roll(idx, -1, dims=1)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    moved = 0
    dist.barrier()
    start = time.time()
    ready = start  # when this rank has what it needs from others and its own work begins
    if args.method in ("megacache", "bundle"):
        if rank == 0:  # compile forward and backward: no collective outside the one-rank group
            warm_up(idx, targets).backward()
            opt.zero_grad(set_to_none=True)
            sync()
            del warm_up  # its reducer's gradient hooks go with it
            gc.collect()
            if args.method == "megacache":
                blob = (torch.compiler.save_cache_artifacts() or (b"",))[0]
                # Chunked (TCPStore refuses messages over 8 MiB), then a flag to wait on.
                C10dStore(store, prefix="bench/").set("megacache", blob)
                store.set("bench/megacache-ready", b"1")
                moved = len(blob) * (world - 1)
            else:
                store.set("bench/bundle-ready", b"1")
        else:
            if args.method == "megacache":
                store.wait(["bench/megacache-ready"])  # waits on the store, not in a collective
                blob = C10dStore(store, prefix="bench/").get("megacache")
                ready = time.time()
                torch.compiler.load_cache_artifacts(blob)
            else:
                store.wait(["bench/bundle-ready"])
        if args.method == "bundle":
            if rank != 0:
                ready = time.time()
            result = coordinator.broadcast_bundle(0)
            if rank == 0:
                moved = result["bytes"] * (world - 1)

    import contextlib

    context = coordinator.compile_once(args.store) if args.method == "compile-once" else contextlib.nullcontext()
    with context:
        loss = ddp(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        step1_end = time.time()
        # Steps 2 to 6: the kernels every rank runs once compiled and tuned (median).
        later = []
        for _ in range(5):
            began = time.perf_counter()
            loss = ddp(idx, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            later.append(time.perf_counter() - began)
        step2_s = sorted(later)[len(later) // 2]
    if sampler:
        stop_self_profile(sampler)
    from torch._dynamo.utils import counters

    stats = coordinator.stats() if args.method == "compile-once" else {}
    if args.method == "compile-once":
        moved = stats.get("bytes_received", 0)
        ready = start + stats.get("waited_s", 0.0)
    inductor = counters["inductor"]
    mine = {
        "rank": rank,
        "pid": os.getpid(),
        "start": start,
        "step1_end": step1_end,
        "step1_s": step1_end - start,
        "own_step1_s": step1_end - ready,
        "step2_s": step2_s,
        "loss": loss.item(),
        "fx_misses": inductor.get("fxgraph_cache_miss", 0),
        "fx_hits": inductor.get("fxgraph_cache_hit", 0),
        "triton_compiles": triton_compiles(),
        "autotune_benchmarks": sum(v for k, v in inductor.items()
                                   if k.startswith("benchmarking.") and k.endswith(".benchmark_gpu")),
        "cpu_s": cpu_seconds(),
        "moved_bytes": moved,
        "waited_s": stats.get("waited_s", 0.0),
        "stats": stats,
        "phases": compile_phases(),
        "profile": profile,
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        all_done_s = max(r["step1_end"] for r in everyone) - min(r["start"] for r in everyone)
        result = {"world": world, "method": args.method, "all_done_s": all_done_s, "ranks": everyone,
                  "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__}
        if args.method == "inductor-redis":
            result["redis_bytes"] = redis_bytes(args.redis_url)
        Path(args.json).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def compile_phases(top: int = 40) -> dict[str, list[float]]:
    """Where this process's compile time went: Dynamo's and Inductor's timed phases
    (``dynamo_timed``), name -> [seconds summed, calls], the longest first. Phases nest,
    so they do not add up; compare one phase across runs (the results JSON keeps them per rank)."""
    from torch._dynamo.utils import compilation_time_metrics

    totals = {name: [round(sum(times), 3), len(times)] for name, times in compilation_time_metrics.items()}
    return dict(sorted(totals.items(), key=lambda item: -item[1][0])[:top])


def cpu_seconds() -> float:
    """CPU time of this process and its live descendants (Inductor's compile workers)."""
    try:
        import psutil
    except ImportError:
        import resource

        usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        return sum(u.ru_utime + u.ru_stime for u in usage)
    me = psutil.Process()
    total = sum(me.cpu_times()[:4])  # user, system, children_user, children_system
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def redis_bytes(url: str) -> int:
    """Bytes the Redis server sent to clients so far (its own counter)."""
    import redis

    return int(redis.Redis.from_url(url).info("stats")["total_net_output_bytes"])


if __name__ == "__main__":
    main()
