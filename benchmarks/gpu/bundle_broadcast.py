"""NCCL bundle broadcast on a 2-GPU host: correctness of a follower's first step and bandwidth.

    torchrun --standalone --virtual-local-rank --nproc-per-node 2 benchmarks/gpu/bundle_broadcast.py

Rank 0 compiles the example GPT (d=512, T=256) and runs step 1, then broadcasts its
bundle; rank 1 then runs step 1 and counts FX-graph misses, Triton compiles (new
artifacts put into Triton's cache by a compile, not by the bundle's emit) and
autotune benchmarks. Then a synthetic bundle of --synthetic-gb GiB is broadcast and
verified, next to a plain NCCL broadcast of a tensor of the same size.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
fresh = tempfile.mkdtemp(prefix=f"bundle-rank{os.environ['RANK']}-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = fresh
os.environ["TRITON_CACHE_DIR"] = os.path.join(fresh, "triton")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # so Triton compiles happen in this process

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import coordinator  # noqa: E402
from coordinator.bundles.broadcast import broadcast_bytes  # noqa: E402
from coordinator.bundles.format import build_bundle, pack_bundle, read_bundle  # noqa: E402
from coordinator.testing import GPT, count_triton_compiles  # noqa: E402

triton_compiles = count_triton_compiles()


def step(model, gen):
    idx = torch.randint(256, (8, 256), generator=gen).cuda()
    loss = model(idx, torch.roll(idx, -1, dims=1))
    loss.backward()
    torch.cuda.synchronize()
    return loss.item()


def synthetic(gib: float, rank: int) -> dict:
    """A synthetic bundle of ``gib`` GiB broadcast and verified, vs a plain broadcast of as many bytes."""
    n = int(gib * 2**30)
    blob = build_bundle({"megacache": os.urandom(n)}) if rank == 0 else None
    dist.barrier()
    received, seconds = broadcast_bytes(blob, 0)
    if rank == 1:
        read_bundle(received)  # verified end to end
    size = len(blob if blob is not None else received)
    plain = torch.empty(size, dtype=torch.uint8, device="cuda")
    dist.broadcast(plain, 0)  # warm-up
    torch.cuda.synchronize()
    dist.barrier()
    t = time.perf_counter()
    dist.broadcast(plain, 0)
    torch.cuda.synchronize()
    plain_s = time.perf_counter() - t
    return dict(synthetic_bytes=size, synthetic_broadcast_s=seconds, synthetic_gbps=size / seconds / 1e9,
                plain_broadcast_s=plain_s, plain_gbps=size / plain_s / 1e9)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--synthetic-gb", type=float, default=1.0)
    p.add_argument("--mode", default="default")
    args = p.parse_args()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = torch.compile(GPT(256, 512, 4, 8, 256).cuda(), mode=args.mode)
    gen = torch.Generator().manual_seed(7)
    out: dict = {"rank": rank, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "mode": args.mode}
    if rank == 0:
        t = time.perf_counter()
        out["loss"] = step(model, gen)
        out["step1_s"] = time.perf_counter() - t
    dist.barrier()
    if rank == 0:
        packed = read_bundle(pack_bundle())
        out["bundle_autotune_files"] = len(packed.autotune)
        out["bundle_kernel_files"] = len(packed.kernels)
        on_disk = [str(p) for p in Path(fresh).rglob("*.best_config")]
        out["best_config_on_disk"] = len(on_disk)
        out["best_config_example"] = on_disk[:2]
    result = coordinator.broadcast_bundle(0)
    out["bundle_bytes"], out["bundle_broadcast_s"] = result["bytes"], result["broadcast_s"]
    if rank == 1:
        out["install"] = result
        out["best_config_before_step"] = len(list(Path(fresh).rglob("*.best_config")))
        compiles_before = triton_compiles()
        t = time.perf_counter()
        out["loss"] = step(model, gen)
        out["step1_s"] = time.perf_counter() - t
        out["fx_misses"] = counters["inductor"].get("fxgraph_cache_miss", 0)
        out["fx_hits"] = counters["inductor"].get("fxgraph_cache_hit", 0)
        out["triton_compiles"] = triton_compiles() - compiles_before
        out["autotune_benchmarks"] = sum(v for k, v in counters["inductor"].items() if k.startswith("benchmarking."))
        out["kernels_emitted"] = counters["inductor"].get("triton_bundler_read_and_emit_kernel", 0)
        out["counters"] = {k: v for k, v in counters["inductor"].items()
                           if "bench" in k or "autotune" in k or "coordesc" in k}

    out.update(synthetic(args.synthetic_gb, rank))
    everyone = [None, None]
    dist.all_gather_object(everyone, out)
    if rank == 0:
        print(json.dumps(everyone, indent=1))
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], f"bundle_{args.mode}.json").write_text(json.dumps(everyone, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
